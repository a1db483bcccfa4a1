"""Conformance check: does a sharded run match the single-process reference, on every rank?

:func:`check_conformance` runs a module or function

1. on the full inputs, locally on each rank (the reference), and
2. on ShardTensor inputs (sharded as the caller says, evenly or unevenly),

then compares the outputs (``full_tensor()``), the outputs' placements, the
input gradients, every parameter gradient and every buffer after the run
(running statistics, counters), using a deterministic random
cotangent sharded like the output. Mismatches from all ranks are gathered and
raised on every rank as one :class:`ConformanceError` (an ``AssertionError``)
that names the tensor, the max abs error and the ranks. A second pass, on fresh
copies, counts the collectives and bytes of forward and backward
(:class:`~physicsnemo_shardext.testing.comm_accounting.CommCounter`).

Every rank of the world must call it (it gathers results over the default group),
with identical module parameters and full inputs (multirank tests are seeded
identically on every rank; this is checked).

Example (inside ``@pytest.mark.multirank(2)`` with the ``domain_mesh`` fixture)::

    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 17, 8)
    report = check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
    assert report.comms.forward.total_calls >= 1   # the halo exchange
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.utils._pytree import tree_leaves

from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext.testing.comm_accounting import CommCounter, PhaseCommStats
from physicsnemo_shardext.testing.sharding import SplitSizes, shard_tensor

__all__ = ["ConformanceError", "ConformanceReport", "Mismatch", "ShardSpec", "check_conformance"]

ParamMode = Literal["distribute", "plain"]

# ShardTensor is not a DTensor subclass; both carry a mesh and placements.
_DISTRIBUTED = (ShardTensor, DTensor)


@dataclass(frozen=True)
class ShardSpec:
    """How to shard one full input: mesh, placements, optional split sizes (see :func:`shard_tensor`).

    >>> ShardSpec(mesh, [Shard(2)], split_sizes=[10, 7])  # doctest: +SKIP
    """

    mesh: DeviceMesh
    placements: Sequence[Placement]
    split_sizes: SplitSizes = None


@dataclass(frozen=True)
class Mismatch:
    """One failed comparison: ``what`` (e.g. ``"gradient of parameter 'weight'"``), where and by how much."""

    what: str
    detail: str
    max_abs_error: float | None = None
    ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        """One line for the error message."""
        error = "" if self.max_abs_error is None else f"max abs error {self.max_abs_error:.3e}; "
        return f"{self.what}: {error}{self.detail} (rank(s) {list(self.ranks)})"


class ConformanceError(AssertionError):
    """The sharded run differs from the reference; ``mismatches`` lists every difference."""

    def __init__(self, mismatches: Sequence[Mismatch], context: str = "") -> None:
        self.mismatches = list(mismatches)
        lines = [f"sharded run does not match the single-process reference{context}:"]
        lines += [f"  - {m.describe()}" for m in self.mismatches]
        super().__init__("\n".join(lines))


@dataclass
class ConformanceReport:
    """What a passing check measured on this rank."""

    max_abs_errors: dict[str, float] = field(default_factory=dict)
    output_placements: list[tuple[Placement, ...] | None] = field(default_factory=list)
    comms: PhaseCommStats | None = None

    def __str__(self) -> str:
        worst = max(self.max_abs_errors.values(), default=0.0)
        return f"conformant (worst abs error {worst:.2e}); comms {self.comms}"


# -- building the two runs ------------------------------------------------------------------
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
            result.append(shard_tensor(x, spec.mesh, spec.placements, spec.split_sizes, requires_grad=_needs_grad(x)))
    return result


def _to_mesh_device(fn: Callable[..., Any], inputs: Sequence[Any], mesh: DeviceMesh) -> tuple[Callable[..., Any], list[Any]]:
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
    """A random cotangent (same on every rank) laid out like ``output``."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(full_shape, generator=generator, dtype=output.dtype).to(output.device)
    if not isinstance(output, _DISTRIBUTED):
        return full
    # Partial outputs take Replicate gradients.
    placements = [Replicate() if isinstance(p, Partial) else p for p in output.placements]
    spec = output._spec
    split_sizes: dict[int, list[int]] = {}
    if isinstance(output, ShardTensor):
        shapes = spec.sharding_shapes()
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                split_sizes[mesh_dim] = [s[p.dim % len(full_shape)] for s in shapes[mesh_dim]]
        return shard_tensor(full, output.device_mesh, placements, split_sizes or None)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, output.device_mesh, placements)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


# -- comparing ------------------------------------------------------------------------------
def _compare(
    what: str, actual: torch.Tensor | None, expected: torch.Tensor | None, rtol: float, atol: float,
    mismatches: list[Mismatch], errors: dict[str, float],
) -> None:
    if expected is None and actual is None:
        return
    if actual is None or expected is None:
        missing = "sharded run" if actual is None else "reference"
        mismatches.append(Mismatch(what, f"no gradient in the {missing}"))
        return
    if actual.shape != expected.shape:
        mismatches.append(Mismatch(what, f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"))
        return
    actual, expected = actual.detach(), expected.detach()
    # Complex values are compared as complex (.double() would drop the imaginary part).
    wide = torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    error = (actual.to(wide) - expected.to(wide)).abs().max().item() if actual.numel() else 0.0
    errors[what] = error
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
        mismatches.append(Mismatch(what, f"not within rtol={rtol:g}, atol={atol:g}", error))


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


def _compare_buffers(
    sharded: torch.nn.Module, reference: torch.nn.Module, rtol: float, atol: float,
    mismatches: list[Mismatch], errors: dict[str, float],
) -> None:
    """Buffers after the run (running stats, counters) must equal the reference's, on every rank.

    A distributed buffer is compared through its local copy when Replicate (every rank must
    hold the full, identical value), else gathered. Cheap: buffers are small.
    """
    sh_buffers = dict(sharded.named_buffers())
    for name, ref_buffer in reference.named_buffers():
        what = f"buffer {name!r}"
        if name not in sh_buffers:
            mismatches.append(Mismatch(what, "buffer missing from the sharded module"))
            continue
        actual = sh_buffers[name]
        if isinstance(actual, _DISTRIBUTED):
            replicated = all(isinstance(p, Replicate) for p in actual.placements)
            actual = actual.to_local() if replicated else actual.full_tensor()
        _compare(what, actual, ref_buffer, rtol, atol, mismatches, errors)


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


def _merge(per_rank: list[list[Mismatch]]) -> list[Mismatch]:
    merged: dict[tuple[str, str], Mismatch] = {}
    for rank, mismatches in enumerate(per_rank):
        for m in mismatches:
            key = (m.what, m.detail)
            previous = merged.get(key)
            if previous is None:
                merged[key] = Mismatch(m.what, m.detail, m.max_abs_error, (rank,))
            else:
                errors = [e for e in (previous.max_abs_error, m.max_abs_error) if e is not None]
                merged[key] = Mismatch(m.what, m.detail, max(errors) if errors else None, previous.ranks + (rank,))
    return list(merged.values())


# -- the check ----------------------------------------------------------------------------
def check_conformance(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    shardings: ShardSpec | Sequence[ShardSpec | None],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    grad_rtol: float | None = None,
    grad_atol: float | None = None,
    expected_placements: Any = "input",
    params: ParamMode = "distribute",
    kwargs: dict[str, Any] | None = None,
    count_comms: bool = True,
    seed: int = 0,
) -> ConformanceReport:
    """Check that ``fn`` on sharded inputs equals ``fn`` on the full inputs, values and gradients.

    Args:
        fn: an ``nn.Module`` (deep-copied for each run) or a function.
        inputs: full inputs, identical on every rank; non-tensors are passed through.
        shardings: one :class:`ShardSpec` for all tensor inputs, or one per input
            (``None``: pass that input unsharded).
        rtol: relative tolerance for outputs.
        atol: absolute tolerance for outputs.
        grad_rtol: relative tolerance for gradients (default: ``rtol``).
        grad_atol: absolute tolerance for gradients (default: ``atol``).
        expected_placements: ``"input"`` (default: every output keeps the first sharded
            input's placements), a placements sequence for all outputs, a list of them
            (one per output; ``None`` for a plain-tensor output), or ``None`` to skip the check.
        params: ``"distribute"`` wraps the module copy with ``distribute_module`` (parameters
            Replicate over the first input's mesh; gradients must come back Replicate and
            reduced); ``"plain"`` leaves parameters as plain tensors.
        kwargs: extra keyword arguments for ``fn`` (not sharded).
        count_comms: also count collectives/bytes of forward and backward in a separate pass.
        seed: seed of the random cotangents.

    Returns:
        A :class:`ConformanceReport` (errors measured, output placements, comm counts).

    Raises:
        ConformanceError: on every rank, if any rank saw a mismatch.
    """
    kwargs = kwargs or {}
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    grad_atol = atol if grad_atol is None else grad_atol
    specs = _specs_for(inputs, shardings)
    sharded_specs = [s for s in specs if s is not None]
    if not sharded_specs:
        raise ValueError("no input is sharded")
    mesh = sharded_specs[0].mesh
    default_placements = tuple(sharded_specs[0].placements)
    fn, inputs = _to_mesh_device(fn, inputs, mesh)
    _assert_same_on_all_ranks(fn, inputs)

    report = ConformanceReport()
    mismatches: list[Mismatch] = []

    # Reference: the full computation, locally.
    reference = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    ref_inputs = _reference_inputs(inputs)
    ref_outputs = _tensor_leaves(reference(*ref_inputs, **kwargs))

    # Sharded run.
    sharded = _prepare_callable(fn, mesh, params)
    sh_inputs = _sharded_inputs(inputs, specs)
    sh_outputs = _tensor_leaves(sharded(*sh_inputs, **kwargs))
    if len(sh_outputs) != len(ref_outputs):
        raise ConformanceError([Mismatch("outputs", f"{len(sh_outputs)} tensors, reference has {len(ref_outputs)}")])

    for i, (sh_out, ref_out) in enumerate(zip(sh_outputs, ref_outputs)):
        full, placements = _gathered(sh_out)
        report.output_placements.append(placements)
        _compare(f"output[{i}]", full, ref_out, rtol, atol, mismatches, report.max_abs_errors)
        wanted = _expected_placements_for(i, expected_placements, default_placements)
        if wanted is not False and placements != wanted:
            mismatches.append(Mismatch(f"placements of output[{i}]", f"{placements} != expected {wanted}"))

    _backward(ref_outputs, sh_outputs, seed)
    for i, (sh_in, ref_in) in enumerate(zip(sh_inputs, ref_inputs)):
        if specs[i] is not None and _needs_grad(inputs[i]):
            grad = sh_in.grad
            _compare(
                f"gradient of input[{i}]", _gathered(grad)[0] if grad is not None else None, ref_in.grad,
                grad_rtol, grad_atol, mismatches, report.max_abs_errors,
            )
    if isinstance(fn, torch.nn.Module):
        sh_params = dict(sharded.named_parameters())
        for name, ref_param in reference.named_parameters():
            what = f"gradient of parameter {name!r}"
            if name not in sh_params:
                mismatches.append(Mismatch(what, "parameter missing from the sharded module"))
                continue
            actual = _param_grad(name, sh_params[name], params, mismatches)
            _compare(what, actual, ref_param.grad, grad_rtol, grad_atol, mismatches, report.max_abs_errors)
        _compare_buffers(sharded, reference, rtol, atol, mismatches, report.max_abs_errors)

    merged = _merge(_all_gather(mismatches))
    if merged:
        raise ConformanceError(merged, f" ({getattr(fn, '__name__', type(fn).__name__)})")

    if count_comms:
        report.comms = measure_comms(fn, inputs, specs, params=params, kwargs=kwargs, seed=seed)
    return report


def _backward(ref_outputs: list[torch.Tensor], sh_outputs: list[torch.Tensor], seed: int) -> None:
    pairs = [(s, r) for s, r in zip(sh_outputs, ref_outputs) if r.requires_grad]
    if not pairs:
        return
    ref_cots = [_cotangent_for(r, r.shape, seed + i) for i, (_, r) in enumerate(pairs)]
    sh_cots = [_cotangent_for(s, r.shape, seed + i) for i, (s, r) in enumerate(pairs)]
    torch.autograd.backward([r for _, r in pairs], ref_cots)
    torch.autograd.backward([s for s, _ in pairs], sh_cots)


def measure_comms(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    shardings: ShardSpec | Sequence[ShardSpec | None],
    *,
    params: ParamMode = "distribute",
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
) -> PhaseCommStats:
    """Count collectives and payload bytes of one sharded forward and one backward (fresh copies).

    Setup work (sharding the inputs, ``distribute_module``, building the cotangent) is
    not counted.

    Example::

        stats = measure_comms(conv, [x], ShardSpec(mesh, [Shard(2)]))
        print(stats.forward.counts, stats.backward.total_bytes)
    """
    kwargs = kwargs or {}
    specs = _specs_for(inputs, shardings)
    mesh = next(s for s in specs if s is not None).mesh
    fn, inputs = _to_mesh_device(fn, inputs, mesh)
    sharded = _prepare_callable(fn, mesh, params)
    sh_inputs = _sharded_inputs(inputs, specs)
    stats = PhaseCommStats()
    with CommCounter() as forward:
        outputs = _tensor_leaves(sharded(*sh_inputs, **kwargs))
    stats.forward = forward.stats
    differentiable = [o for o in outputs if o.requires_grad]
    if differentiable:
        # Cotangents are built outside the counter; they need no communication.
        cots = [_cotangent_for(o, o.shape, seed + i) for i, o in enumerate(differentiable)]
        with CommCounter() as backward:
            torch.autograd.backward(differentiable, cots)
        stats.backward = backward.stats
    return stats


def _assert_same_on_all_ranks(fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        tensors += list(fn.state_dict().values())
    digests = _all_gather(_checksum(tensors))
    if len(set(digests)) > 1:
        raise ValueError(
            "check_conformance needs identical module parameters and full inputs on every rank "
            f"(checksums per rank: {digests}); seed before creating them"
        )
