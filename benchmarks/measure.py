"""Measuring one case on the ranks of a world: single-process, sharded, and sharded with its family off.

`measure_case` runs a case (``cases.py``) three ways in the same processes: the
op on the whole field (the reference for the output, every gradient and memory),
on ShardTensors with every plugin loaded, and inside
``physicsnemo_shardext.disabled(plugins=[family])`` (ShardTensor's DTensor
fallback, or PhysicsNeMo's own handler). Each sharded run is a counted forward
and backward (``_common.counted_pass``), compared with the reference by the
package's one comparison rule, then one step under ``_common.peak_memory``. A
variant that a probe world (``probes.py``) saw kill the process is not run.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from _common import counted_pass, first_line, peak_memory, sync
from cases import Setup, Shape

__all__ = ["CaseResult", "Measured", "Reference", "Run", "cotangent_like", "kills", "measure_case"]


@dataclass
class CaseResult:
    """What one rank measured for one case."""

    family: str
    op: str
    ranks: int
    rank: int
    bound_text: str
    exchange: bool
    forward_bytes: int | None = None
    backward_bytes: int | None = None
    forward_calls: int | None = None
    backward_calls: int | None = None
    forward_bound: int = 0
    backward_bound: int = 0
    peak_mib: float | None = None
    single_peak_mib: float | None = None
    max_error: float | None = None
    status: str = "ok"
    fallback_path: str = ""
    fallback_status: str = "ok"
    fallback_forward_bytes: int | None = None
    fallback_backward_bytes: int | None = None
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_peak_mib: float | None = None
    fallback_max_error: float | None = None
    fallback_partial_grads: bool = False


def cotangent_like(output: torch.Tensor, full: torch.Tensor) -> torch.Tensor | None:
    """``full`` laid out like ``output`` (ShardTensor shards and split, Replicate, or plain); None for scalars."""
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from physicsnemo_shardext.testing import shard_tensor

    if output.dim() == 0:
        return None
    if not isinstance(output, (ShardTensor, DTensor)):
        return full
    placements = [Replicate() if isinstance(p, Partial) else p for p in output.placements]
    if isinstance(output, ShardTensor):
        shapes = output._spec.sharding_shapes()
        sizes = {m: [shape[p.dim] for shape in shapes[m]] for m, p in enumerate(placements) if isinstance(p, Shard)}
        return shard_tensor(full, output.device_mesh, placements, sizes or None)
    return distribute_tensor(full, output.device_mesh, placements)


def _full(t: torch.Tensor) -> torch.Tensor:
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, (ShardTensor, DTensor)) else t


def _fallback_path(targets: Sequence[Any]) -> str:
    """Who answers the op once its family is off: PhysicsNeMo's own handler, another plugin, or DTensor."""
    import physicsnemo_shardext
    from physicsnemo_shardext import shard_registries
    from physicsnemo_shardext.shard_registries import PatchLevel

    for target in targets:
        with contextlib.suppress(Exception):
            if shard_registries.current_handler(PatchLevel.FUNCTION, target) is not None:
                installed = physicsnemo_shardext.get_registry().provenance(target)
                return "PhysicsNeMo handler" if installed is None else f"plugin {installed.plugin.name}"
    return "DTensor fallback"


class Run:
    """The sharded op, its inputs and parameters on this rank: counted passes and a measured step."""

    def __init__(self, setup: Setup, mesh: Any, device: torch.device) -> None:
        from torch.distributed.tensor import Shard, distribute_module

        from physicsnemo_shardext.testing import shard_tensor

        self.setup = setup
        self.module = distribute_module(copy.deepcopy(setup.module).to(device), mesh) if setup.module else None
        self.inputs = [
            t.to(device) if d is None else shard_tensor(t.to(device), mesh, [Shard(d)], setup.split, requires_grad=g)
            for t, d, g in zip(setup.inputs, setup.shard_dims, setup.grads)
        ]
        self.cotangent: torch.Tensor | None = None

    def clear(self) -> None:
        for t in self.inputs:
            t.grad = None
        if self.module is not None:
            self.module.zero_grad(set_to_none=True)

    def forward(self) -> torch.Tensor:
        return self.setup.fn(self.module, *self.inputs)

    def backward(self, out: torch.Tensor) -> None:
        out.backward(self.cotangent)

    def step(self) -> None:
        self.clear()
        self.backward(self.forward())


@dataclass
class Reference:
    """The single-process run: output, input and parameter gradients, the cotangent, its peak memory."""

    output: torch.Tensor
    cotangent: torch.Tensor
    input_grads: list[torch.Tensor | None]
    param_grads: dict[str, torch.Tensor]
    peak_mib: float | None


def _single(setup: Setup, device: torch.device) -> Reference:
    """Single-process run on the whole field (also the warm-up), then one measured step."""
    module = copy.deepcopy(setup.module).to(device) if setup.module else None
    inputs = [t.to(device).detach().requires_grad_(g) for t, g in zip(setup.inputs, setup.grads)]
    out = setup.fn(module, *inputs)
    generator = torch.Generator().manual_seed(7)
    cotangent = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(device)
    out.backward(cotangent if out.dim() else None)
    params = {} if module is None else {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    reference = Reference(out.detach(), cotangent, [t.grad for t in inputs], params, None)
    del out

    def clear() -> None:
        for t in inputs:
            t.grad = None
        if module is not None:
            module.zero_grad(set_to_none=True)

    clear()
    with peak_memory(device) as peak:
        result = setup.fn(module, *inputs)
        result.backward(cotangent if result.dim() else None)
        del result
    reference.peak_mib = peak[0]
    return reference


def _difference(what: str, actual: torch.Tensor | None, expected: torch.Tensor | None) -> tuple[float, str]:
    """Max abs difference, and a note when it is beyond round-off.

    By the package's one comparison rule (`physicsnemo_shardext.comparison`): every element within
    ``atol + rtol * |r|``, with ``rtol = 1e-3`` and ``atol = 1e-3`` of the values' scale (at least 1).
    """
    if expected is None:
        return 0.0, ""
    if actual is None:
        return math.inf, f"no {what}"
    full = _full(actual).detach()
    if full.shape != expected.shape:
        return math.inf, f"{what} of shape {tuple(full.shape)}, not {tuple(expected.shape)}"
    if not full.numel():
        return 0.0, ""
    from physicsnemo_shardext.comparison import Tolerance, compare

    scale = max(expected.abs().max().item(), 1.0)
    result = compare(full, expected, Tolerance(rtol=1e-3, atol=1e-3 * scale), check_dtype=False)
    return result.max_abs_error, ("" if result.passed else f"{what} off: {result.describe()}")


def _compare(run: Run, out: torch.Tensor | None, reference: Reference, backward: bool) -> tuple[float, str]:
    """The largest difference from single-process (output, then every gradient) and the first wrong one."""
    checks = [("output", out, reference.output)]
    if backward:
        checks += [
            (f"gradient of input {i}", t.grad, g)
            for i, (t, g) in enumerate(zip(run.inputs, reference.input_grads))
            if g is not None
        ]
        if run.module is not None:
            params = dict(run.module.named_parameters())
            checks += [
                (f"gradient of {n}", params[n].grad if n in params else None, g)
                for n, g in reference.param_grads.items()
            ]
    worst, wrong = 0.0, ""
    for what, actual, expected in checks:
        error, note = _difference(what, actual, expected)
        worst = max(worst, error)
        wrong = wrong or note
    return worst, wrong


@dataclass
class Measured:
    """One variant on one rank: status (``ok``, ``fails: ...``, ``wrong: ...``), collectives, memory, error."""

    status: str = "ok"
    forward: Any = None  # CommStats
    backward: Any = None
    peak_mib: float | None = None
    error: float = math.nan
    partial_grads: bool = False  # a parameter gradient came back Partial: its reduction is left to the caller


def _partial_grads(run: Run) -> bool:
    from torch.distributed.tensor import Partial

    if run.module is None:
        return False
    return any(
        isinstance(pl, Partial)
        for p in run.module.parameters()
        if p.grad is not None
        for pl in getattr(p.grad, "placements", ())
    )


def _failure(stage: str, error: Exception | None) -> str:
    """``fails: TypeError: ...``, ``backward fails: ...``, or ``... fails on another rank``."""
    if error is None:
        return f"{stage}fails on another rank"
    return f"{stage}fails: {type(error).__name__}: {first_line(error)}"


def _measure(run: Run, reference: Reference, device: torch.device) -> Measured:
    """Counted forward and backward, checked against single-process, then one measured step."""
    m = Measured()
    out, forward = counted_pass(run.forward)
    if not forward.ok:
        m.status = _failure("", forward.error)
        return m
    m.forward = forward.stats
    run.cotangent = cotangent_like(out, reference.cotangent)
    _, backward = counted_pass(run.backward, out)
    m.partial_grads = backward.ok and _partial_grads(run)
    m.error, wrong = _compare(run, out, reference, backward.ok)
    del out
    if not backward.ok:
        m.status = _failure("backward ", backward.error)
        return m
    m.backward = backward.stats
    if wrong:
        m.status = f"wrong: {wrong}"
    run.clear()
    sync(device)
    with peak_memory(device) as peak:
        run.step()
    sync(device)
    m.peak_mib = peak[0]
    return m


def measure_case(
    family: str,
    build: Callable[[Shape], Setup],
    shape: Shape,
    mesh: Any,
    device: torch.device,
    *,
    aborted: Mapping[str, str] | None = None,
    unprobed: bool = False,
) -> CaseResult:
    """Single-process, sharded with the family, sharded with the family off: bytes, memory, errors.

    ``aborted``: what the probe world found killing the process (``family|op|variant`` -> why),
    not run again. ``unprobed``: no probe world ran (under torchrun, none can be spawned), so the
    cases that may abort the process are not run.
    """
    import physicsnemo_shardext

    rank = dist.get_rank()
    torch.manual_seed(0)  # module parameters: the same on every rank and in the single-process run
    setup = build(shape)
    fwd_bound, bwd_bound = setup.bounds(rank)
    result = CaseResult(
        family,
        setup.op,
        shape.ranks,
        rank,
        setup.bound_text,
        setup.exchange,
        forward_bound=fwd_bound,
        backward_bound=bwd_bound,
    )
    reference = _single(setup, device)
    result.single_peak_mib = reference.peak_mib

    aborted = dict(aborted or {})
    key = f"{family}|{setup.op}"
    if setup.may_abort and unprobed:
        for variant in ("ours", "fallback"):
            aborted[f"{key}|{variant}"] = (
                "may abort the process: not run under torchrun, where no probe world can be spawned first"
            )
    if f"{key}|ours" in aborted:
        ours = Measured(status=f"fails: {kills(aborted[f'{key}|ours'])}; not run")
    else:
        run = Run(setup, mesh, device)
        ours = _measure(run, reference, device)
        del run
    result.status, result.peak_mib, result.max_error = ours.status, ours.peak_mib, ours.error
    if ours.forward is not None:
        result.forward_bytes, result.forward_calls = ours.forward.total_bytes, ours.forward.total_calls
    if ours.backward is not None:
        result.backward_bytes, result.backward_calls = ours.backward.total_bytes, ours.backward.total_calls

    with physicsnemo_shardext.disabled(plugins=[family]):
        result.fallback_path = _fallback_path(setup.targets)
        if f"{key}|fallback" in aborted:
            fallback = Measured(status=f"fails: {kills(aborted[f'{key}|fallback'])}; not run")
        else:
            run = Run(setup, mesh, device)
            fallback = _measure(run, reference, device)
            del run
    result.fallback_status, result.fallback_peak_mib = fallback.status, fallback.peak_mib
    result.fallback_max_error, result.fallback_partial_grads = fallback.error, fallback.partial_grads
    for stats in (fallback.forward, fallback.backward):
        if stats is not None:
            for key, n in stats.bytes.items():
                result.fallback_ops[key] = result.fallback_ops.get(key, 0) + n
    if fallback.forward is not None:
        result.fallback_forward_bytes = fallback.forward.total_bytes
    if fallback.backward is not None:
        result.fallback_backward_bytes = fallback.backward.total_bytes
    return result


def kills(reason: str) -> str:
    """How a probed variant failed, as a phrase: it hangs, or it aborts the process."""
    return reason if reason.startswith(("hangs", "may")) else f"the process aborts ({reason})"
