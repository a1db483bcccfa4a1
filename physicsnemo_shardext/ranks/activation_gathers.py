"""Detect all-gathers that rebuild an activation during a sharded forward pass.

Domain parallelism only pays off if no rank ever holds a whole feature map.
The usual way a patch (or the DTensor fallback) breaks that promise is an
all-gather that reassembles an activation: ``Shard -> Replicate``
redistribution, ``full_tensor()``, PhysicsNeMo's uneven ``all_gather_v``.
`GatherRecorder` is a ``TorchDispatchMode`` (like
`CommCounter`) that records
every all-gather issued while it is active, with this rank's payload and the
size of the gathered result.

**Criterion** (`GatherRecorder.activation_gathers`): an all-gather is an
*activation gather* when

1. its payload is floating point or complex: the metadata exchanges of
   ShardTensor (``all_gather_object`` pickles as ``uint8``, shapes as integers)
   are not data; and
2. the tensor it assembles holds at least ``min_numel`` elements, where the
   assembled numel is the sum over ranks of the gathered chunks (for the padded
   ``all_gather_into_tensor`` PhysicsNeMo uses on uneven shards, world size x
   padded chunk).

Pick ``min_numel`` with `smallest_activation_numel`: the fewest elements
of any feature map the model produces on the *full* input (global size). A
gather that rebuilds a feature map, even only the smallest one, reaches it.
What stays below it in a sensible test configuration: statistics (a mean and
variance per channel: ``2 * C`` elements), parameter-sized values (the
parameters of a domain-parallel model are replicated, they are not gathered),
and halo slabs, which are a few rows of one feature map. The threshold is
only as sharp as the configuration: choose models whose smallest feature map
is larger than ``2 * C_max`` and larger than every halo slab (``world_size x
halo width x`` the other extents). `halo_bound` computes the latter.

Only all-gathers are classified (``c10d`` ``allgather*``/``_allgather_base_``/
``gather_`` and the functional ``all_gather_into_tensor*``); an activation moved
by ``all_to_all`` or ``broadcast`` is not reported here (count those with
``CommCounter``).

Examples:
    Inside ``@pytest.mark.multirank(2)``:

    ```python
    floor = smallest_activation_numel(model, [x_full])
    with GatherRecorder() as gathers:
        y = distributed_model(x_sharded)
    assert not gathers.activation_gathers(floor), gathers.describe(floor)
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "ActivationGatherError",
    "GatherRecord",
    "GatherRecorder",
    "assert_no_activation_gather",
    "halo_bound",
    "smallest_activation_numel",
]

# c10d ops: (index of this rank's payload, index of the output buffer(s)).
_C10D_GATHERS: dict[str, tuple[int, int]] = {
    "allgather_": (1, 0),
    "_allgather_base_": (1, 0),
    "allgather_coalesced_": (1, 0),
    "allgather_into_tensor_coalesced_": (1, 0),
    "gather_": (1, 0),
}
# Functional collectives return the gathered tensor; payload is argument 0, group size argument 1.
_FUNCTIONAL_GATHERS = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_data(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.is_floating_point() or t.is_complex() for t in tensors)


@dataclass(frozen=True)
class GatherRecord:
    """One all-gather: op key, this rank's payload shapes and dtype, and the assembled numel."""

    op: str
    payload_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None
    gathered_numel: int
    is_data: bool

    def __str__(self) -> str:
        shapes = ", ".join(str(list(s)) for s in self.payload_shapes)
        return f"{self.op}(payload {shapes} {self.dtype}) -> {self.gathered_numel} elements gathered"


class GatherRecorder(TorchDispatchMode):
    """Record every all-gather issued while active (forward and, if called inside, backward).

    Examples:
        On 2 ranks:

        ```python
        with GatherRecorder() as gathers:
            dist.all_gather_into_tensor(out, torch.ones(4))
        assert gathers.records[0].gathered_numel == 8
        ```
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[GatherRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        record = _classify(func, args, result)
        if record is not None:
            self.records.append(record)
        return result

    def activation_gathers(self, min_numel: int) -> list[GatherRecord]:
        """The recorded gathers that assemble a floating-point tensor of at least ``min_numel`` elements."""
        return [r for r in self.records if r.is_data and r.gathered_numel >= min_numel]

    def describe(self, min_numel: int) -> str:
        """A report listing every gather and marking the activation-sized ones (for assertion messages)."""
        if not self.records:
            return "no all-gather"
        lines = [f"all-gathers (activation threshold {min_numel} elements):"]
        for r in self.records:
            mark = "ACTIVATION" if r.is_data and r.gathered_numel >= min_numel else "ok"
            lines.append(f"  [{mark}] {r}")
        return "\n".join(lines)


def _classify(func: Any, args: tuple, result: Any) -> GatherRecord | None:
    namespace = getattr(func, "namespace", None)
    name = func._schema.name.split("::", 1)[-1] if hasattr(func, "_schema") else ""
    if namespace == "c10d" and name in _C10D_GATHERS:
        payload_index, output_index = _C10D_GATHERS[name]
        payload = _tensors(args[payload_index]) if payload_index < len(args) else []
        outputs = _tensors(args[output_index]) if output_index < len(args) else []
    elif namespace in _FUNCTIONAL_NAMESPACES and name in _FUNCTIONAL_GATHERS:
        payload = _tensors(args[0]) if args else []
        outputs = _tensors(result)
    else:
        return None
    gathered = sum(t.numel() for t in outputs)
    if not gathered and payload and namespace in _FUNCTIONAL_NAMESPACES and len(args) > 1:
        gathered = sum(t.numel() for t in payload) * int(args[1])  # group size, if no output seen
    return GatherRecord(
        op=f"{namespace}.{name}",
        payload_shapes=tuple(tuple(t.shape) for t in payload),
        dtype=payload[0].dtype if payload else None,
        gathered_numel=gathered,
        is_data=_is_data(payload),
    )


def smallest_activation_numel(module: torch.nn.Module, inputs: Sequence[Any], **kwargs: Any) -> int:
    """The fewest elements of any feature map ``module`` produces on the full ``inputs`` (single process).

    Every submodule's tensor outputs with as many dimensions as the first input
    (``(N, C, *spatial)`` feature maps) count, and so do the inputs and the final
    output. The module runs once under ``torch.no_grad`` on the given (unsharded) inputs.

    Examples:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, stride=2, padding=1), torch.nn.Conv2d(4, 2, 1))
        >>> smallest_activation_numel(net, [torch.randn(1, 1, 8, 8)])   # conv out: 1*4*4*4=64, input 64, output 32
        32
    """
    first = next(x for x in inputs if isinstance(x, torch.Tensor))
    ndim = first.ndim
    sizes = [x.numel() for x in inputs if isinstance(x, torch.Tensor) and x.ndim == ndim]

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        sizes.extend(t.numel() for t in _tensors(output) if t.ndim == ndim and t.is_floating_point())

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        with torch.no_grad():
            out = module(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    sizes.extend(t.numel() for t in _tensors(out) if t.ndim == ndim)
    return min(sizes)


def halo_bound(shape: Sequence[int], dim: int, halo: int, world_size: int) -> int:
    """Elements a gather of ``halo`` rows of ``shape`` along ``dim`` from every rank would assemble.

    Examples:
        >>> halo_bound((1, 8, 48, 24), dim=2, halo=3, world_size=2)   # 2 ranks x (1*8*3*24)
        1152
    """
    others = math.prod(s for i, s in enumerate(shape) if i != dim % len(shape))
    return world_size * halo * others


class ActivationGatherError(AssertionError):
    """A forward pass all-gathered an activation."""


def assert_no_activation_gather(fn: Callable[..., Any], inputs: Sequence[Any], min_numel: int, **kwargs: Any) -> Any:
    """Run ``fn(*inputs, **kwargs)`` (a forward pass) and raise if it all-gathers an activation.

    Returns ``fn``'s result. Raises `ActivationGatherError` listing every
    gather (activation-sized ones marked) otherwise.

    Examples:
        ```python
        y = assert_no_activation_gather(sharded_model, [x_shard], smallest_activation_numel(model, [x]))
        ```
    """
    with GatherRecorder() as gathers:
        result = fn(*inputs, **kwargs)
    if gathers.activation_gathers(min_numel):
        raise ActivationGatherError(f"forward pass all-gathered an activation; {gathers.describe(min_numel)}")
    return result
