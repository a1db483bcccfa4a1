"""The two runs of a conformance check, built and compared: inputs, module copies, cotangents, one rule.

`ShardSpec` says how to shard one full input. The reference run gets detached copies
of the full inputs (`_reference_inputs`); the sharded run gets ShardTensors cut from
them (`_sharded_inputs`) and a module copy with replicated parameters
(`_prepare_callable`); both get the same random cotangents (`_cotangent_for`, laid out
like each output). `_compare` compares one tensor by the rule of
`physicsnemo_shardext.comparison` and records a `Mismatch`; `_all_gather` and
`_checksum` compare what the ranks hold.

Examples:
    >>> from torch.distributed.tensor import Shard
    >>> x = torch.ones(2, 3)
    >>> _specs_for([x, "mode"], ShardSpec(None, [Shard(1)]))    # a non-tensor stays unsharded
    [ShardSpec(mesh=None, placements=[Shard(dim=1)], sizes_by_mesh_dim=None), None]
    >>> ref = _reference_inputs([x])[0]
    >>> ref.requires_grad, ref is x
    (True, False)
    >>> mismatches, errors = [], {}
    >>> _compare("output[0]", x + 1e-3, x, 1e-4, 1e-5, mismatches, errors)
    >>> [m.what for m in mismatches], round(errors["output[0]"], 6)
    (['output[0]'], 0.001)
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.utils._pytree import tree_leaves

from physicsnemo_shardext.comparison import Comparison, Tolerance, compare
from physicsnemo_shardext.testing.conformance_report import Mismatch
from physicsnemo_shardext.testing.sharding import SplitSizes, shard_tensor

__all__ = ["ParamMode", "ShardSpec"]

ParamMode = Literal["distribute", "plain"]

# ShardTensor is not a DTensor subclass; both carry a mesh and placements.
_DISTRIBUTED = (ShardTensor, DTensor)


@dataclass(frozen=True)
class ShardSpec:
    """How to shard one full input: mesh, placements, optional split sizes (see `shard_tensor`).

    ``split_sizes`` is the name ``sizes_by_mesh_dim`` had before 0.2, still accepted by the constructor.

    Examples:
        >>> ShardSpec(mesh, [Shard(2)], sizes_by_mesh_dim=[10, 7])  # doctest: +SKIP
    """

    mesh: DeviceMesh
    placements: Sequence[Placement]
    sizes_by_mesh_dim: SplitSizes = None
    split_sizes: InitVar[SplitSizes] = None

    def __post_init__(self, split_sizes: SplitSizes) -> None:
        if split_sizes is not None:
            if self.sizes_by_mesh_dim is not None:
                raise TypeError("ShardSpec: pass sizes_by_mesh_dim or its old name split_sizes, not both")
            object.__setattr__(self, "sizes_by_mesh_dim", split_sizes)


def _specs_for(inputs: Sequence[Any], shardings: ShardSpec | Sequence[ShardSpec | None]) -> list[ShardSpec | None]:
    if isinstance(shardings, ShardSpec):
        return [shardings if isinstance(x, torch.Tensor) else None for x in inputs]
    specs = list(shardings)
    if len(specs) != len(inputs):
        raise ValueError(f"{len(inputs)} inputs but {len(specs)} shardings")
    return specs


def _needs_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _reference_inputs(inputs: Sequence[Any]) -> list[Any]:
    return [x.detach().clone().requires_grad_(_needs_grad(x)) if isinstance(x, torch.Tensor) else x for x in inputs]


def _sharded_inputs(inputs: Sequence[Any], specs: Sequence[ShardSpec | None]) -> list[Any]:
    result = []
    for x, spec in zip(inputs, specs):
        if spec is None or not isinstance(x, torch.Tensor):
            result.append(x)
        else:
            result.append(
                shard_tensor(x, spec.mesh, spec.placements, spec.sizes_by_mesh_dim, requires_grad=_needs_grad(x))
            )
    return result


def _to_mesh_device(
    fn: Callable[..., Any], inputs: Sequence[Any], mesh: DeviceMesh
) -> tuple[Callable[..., Any], list[Any]]:
    """Move a module copy and the full inputs to the mesh's device (tests build them on CPU)."""
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(mesh.device_type)
    moved = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
    if isinstance(fn, torch.nn.Module):
        fn = copy.deepcopy(fn).to(device)
    return fn, moved


def _prepare_callable(fn: Callable[..., Any], mesh: DeviceMesh, params: ParamMode) -> Callable[..., Any]:
    if not isinstance(fn, torch.nn.Module):
        return fn
    module = copy.deepcopy(fn)
    if params == "distribute":
        # Replicates every parameter over the mesh, as a user of ShardTensor would.
        module = distribute_module(module, mesh)
    elif params != "plain":
        raise ValueError(f"params must be 'distribute' or 'plain', got {params!r}")
    return module


def _cotangent_for(output: torch.Tensor, full_shape: torch.Size, seed: int) -> torch.Tensor:
    """A random cotangent (same on every rank) laid out like ``output``.

    Drawn in float32 and cast for the reduced-precision float dtypes, so an autocast run
    and its full-precision counterpart get the same values (up to rounding).
    """
    generator = torch.Generator().manual_seed(seed)
    if output.dtype in (torch.bfloat16, torch.float16):
        full = torch.randn(full_shape, generator=generator).to(output.dtype)
    else:
        full = torch.randn(full_shape, generator=generator, dtype=output.dtype)
    full = full.to(output.device)
    if not isinstance(output, _DISTRIBUTED):
        return full
    # Partial outputs take Replicate gradients.
    placements = [Replicate() if isinstance(p, Partial) else p for p in output.placements]
    sizes: dict[int, list[int]] = {}
    if isinstance(output, ShardTensor):
        shapes = output._spec.sharding_shapes()
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                sizes[mesh_dim] = [s[p.dim % len(full_shape)] for s in shapes[mesh_dim]]
        return cast(torch.Tensor, shard_tensor(full, output.device_mesh, placements, sizes or None))
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, output.device_mesh, placements)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _compare(
    what: str,
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    rtol: float,
    atol: float,
    mismatches: list[Mismatch],
    errors: dict[str, float],
    *,
    check_dtype: bool = True,
    note: str = "",
    results: dict[str, Comparison] | None = None,
) -> None:
    """Compare by the one rule (`physicsnemo_shardext.comparison.compare`); record the error, note a mismatch."""
    if expected is None and actual is None:
        return
    if actual is None or expected is None:
        missing = "sharded run" if actual is None else "reference"
        mismatches.append(Mismatch(what, f"no gradient in the {missing}"))
        return
    result = compare(actual, expected, Tolerance(rtol, atol), check_dtype=check_dtype)
    if result.problem:
        extra = note if result.problem.startswith("dtype") else ""
        mismatches.append(Mismatch(what, f"{result.problem}{extra}"))
        return
    errors[what] = result.max_abs_error
    if results is not None:
        results[what] = result
    if not result.passed:
        mismatches.append(
            Mismatch(what, f"not within rtol={rtol:g}, atol={atol:g}{note}", result.max_abs_error, comparison=result)
        )


def _gathered(value: torch.Tensor) -> tuple[torch.Tensor, tuple[Placement, ...] | None]:
    if isinstance(value, _DISTRIBUTED):
        return value.full_tensor(), tuple(value.placements)
    return value, None


def _expected_placements_for(
    index: int, expected: Any, default: tuple[Placement, ...] | None
) -> tuple[Placement, ...] | None | Literal[False]:
    """``False``: don't check; ``None``: expect a plain tensor; else the placements."""
    if expected is None:
        return False
    if isinstance(expected, str) and expected == "input":
        return default
    if expected and isinstance(expected[0], (list, tuple)) or (expected and expected[0] is None):
        return tuple(expected[index]) if expected[index] is not None else None
    return tuple(expected)


def _param_grad(name: str, param: torch.Tensor, params: ParamMode, mismatches: list[Mismatch]) -> torch.Tensor | None:
    grad = param.grad
    if grad is None or not isinstance(grad, _DISTRIBUTED):
        return grad
    if params == "distribute" and not all(isinstance(p, Replicate) for p in grad.placements):
        mismatches.append(
            Mismatch(f"gradient of parameter {name!r}", f"placements {tuple(grad.placements)}, expected Replicate")
        )
    # A Replicate grad must already hold the reduced value on every rank: compare the local copy.
    if all(isinstance(p, Replicate) for p in grad.placements):
        return grad.to_local()
    return grad.full_tensor()


def _checksum(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha1()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _all_gather(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
