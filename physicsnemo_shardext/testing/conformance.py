"""Conformance check: does a sharded run match the single-process reference, on every rank?

`check_conformance` runs a module or function

1. on the full inputs, locally on each rank (the reference), and
2. on ShardTensor inputs (sharded as the caller says, evenly or unevenly),

then compares the outputs (``full_tensor()``), the outputs' placements, the
input gradients, every parameter gradient and every buffer after the run
(running statistics, counters), using a deterministic random
cotangent sharded like the output. Every tensor is compared by the one rule of
`physicsnemo_shardext.comparison` (``|a - r| <= atol + rtol * |r|`` per element). Mismatches from all ranks are gathered and
raised on every rank as one `ConformanceError` (an ``AssertionError``)
that names the tensor, the max abs error and the ranks.

Errors the code under test *raises* (a shape, dtype or placement error in a
handler, or autograd's ``Mismatch in shape`` in backward when a handler returned
a wrong-shaped result) are reported the same way: a mismatch naming the output
or gradient concerned, the ranks, and, where a plugin handler ran, the plugin
(found through the handler calls recorded by
`HandlerRecorder` and the registry's provenance).
``MissingShardPatch`` and the framework's own errors propagate unchanged. Such an
error must be raised on every rank alike; one raised on some ranks only leaves
the others in their collectives (the multirank watchdog reports that hang). A second pass, on fresh
copies, counts the collectives and bytes of forward and backward
(`CommCounter`).

With ``autocast=torch.bfloat16`` (or ``("cuda", torch.float16)``) both forwards run
under `torch.autocast` and the tolerances come from the single-process
autocast-vs-fp32 error (see `check_conformance`).

Every rank of the world must call it (it gathers results over the default group),
with identical module parameters and full inputs (multirank tests are seeded
identically on every rank; this is checked).

Examples:
    Inside ``@pytest.mark.multirank(2)`` with the ``domain_mesh`` fixture:

    ```python
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 17, 8)
    report = check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
    assert report.comms.forward.total_calls >= 1   # the halo exchange
    ```
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.utils._pytree import tree_leaves

from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext.comparison import Comparison, Tolerance, compare
from physicsnemo_shardext.errors import MissingShardPatch, ShardextError
from physicsnemo_shardext.testing.comm_accounting import CommCounter, PhaseCommStats
from physicsnemo_shardext.trace import HandlerCall, HandlerRecorder
from physicsnemo_shardext.testing.sharding import SplitSizes, shard_tensor

__all__ = [
    "AUTOCAST_ERROR_FACTOR", "ConformanceError", "ConformanceReport", "Mismatch", "ShardSpec", "check_conformance",
]

ParamMode = Literal["distribute", "plain"]

# Under autocast, a compared tensor may differ from the single-process autocast reference by
# up to this many times the reference's own autocast-vs-fp32 error (see check_conformance).
AUTOCAST_ERROR_FACTOR = 4.0

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


@dataclass(frozen=True)
class Mismatch:
    """One failed comparison: ``what`` (e.g. ``"gradient of parameter 'weight'"``), where and by how much.

    ``comparison`` is the `Comparison` of a tensor outside its tolerance (the worst over the ranks).

    Examples:
        >>> Mismatch("output[0]", "shape (3,) != reference (4,)", ranks=(0,)).describe()
        'output[0]: shape (3,) != reference (4,) (rank(s) [0])'
    """

    what: str
    detail: str
    max_abs_error: float | None = None
    ranks: tuple[int, ...] = ()
    comparison: Comparison | None = None

    def describe(self) -> str:
        """One line for the error message."""
        error = "" if self.max_abs_error is None else f"max abs error {self.max_abs_error:.3e}; "
        found = self.comparison
        if found is not None:
            where = f", worst at {list(found.worst_index)}" if found.worst_index else ""
            error = (f"max abs error {found.max_abs_error:.3e}, max rel error {found.max_rel_error:.3e}{where} "
                     f"({found.mismatched} of {found.numel} elements outside); ")
        return f"{self.what}: {error}{self.detail} (rank(s) {list(self.ranks)})"


class ConformanceError(AssertionError):
    """The sharded run differs from the reference; ``mismatches`` lists every difference.

    ``plugins`` names the plugin handlers that ran in the sharded run (``"label for target"``).

    Examples:
        >>> print(ConformanceError([Mismatch("output[0]", "shape (3,) != reference (4,)", ranks=(0, 1))],
        ...                        plugins=["demo (demo-dist==1.0) for torch.tanh"]))
        sharded run does not match the single-process reference:
          - output[0]: shape (3,) != reference (4,) (rank(s) [0, 1])
          plugin handlers that ran: demo (demo-dist==1.0) for torch.tanh
    """

    def __init__(self, mismatches: Sequence[Mismatch], context: str = "", plugins: Sequence[str] = ()) -> None:
        self.mismatches = list(mismatches)
        self.plugins = list(plugins)
        lines = [f"sharded run does not match the single-process reference{context}:"]
        lines += [f"  - {m.describe()}" for m in self.mismatches]
        if self.plugins:
            lines.append(f"  plugin handlers that ran: {', '.join(self.plugins)}")
        super().__init__("\n".join(lines))


@dataclass
class ConformanceReport:
    """What a passing check measured on this rank."""

    max_abs_errors: dict[str, float] = field(default_factory=dict)
    #: Every compared tensor's `Comparison` on this rank (both errors, worst element), by name.
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    output_placements: list[tuple[Placement, ...] | None] = field(default_factory=list)
    comms: PhaseCommStats | None = None
    #: ``(device_type, dtype)`` when the check ran under ``torch.autocast``, else ``None``.
    autocast: tuple[str, torch.dtype] | None = None
    #: Under autocast: max abs error of the single-process autocast run against the same
    #: run in full precision, per compared tensor (what the tolerances are derived from).
    autocast_reference_errors: dict[str, float] = field(default_factory=dict)
    #: Under autocast: the ``atol`` each tensor was compared with.
    autocast_atols: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        worst = max(self.max_abs_errors.values(), default=0.0)
        relative = max((c.max_rel_error for c in self.comparisons.values()), default=0.0)
        under = "" if self.autocast is None else f" under {_describe_autocast(self.autocast)}"
        return f"conformant{under} (worst abs error {worst:.2e}, worst rel error {relative:.2e}); comms {self.comms}"


# -- autocast -------------------------------------------------------------------------------
def _resolve_autocast(
    option: torch.dtype | tuple[str, torch.dtype] | None, mesh: DeviceMesh
) -> tuple[str, torch.dtype] | None:
    """``None``, a dtype (on the mesh's device type) or ``(device_type, dtype)``."""
    if option is None:
        return None
    if isinstance(option, torch.dtype):
        device_type, dtype = mesh.device_type, option
    elif isinstance(option, (tuple, list)) and len(option) == 2 and isinstance(option[1], torch.dtype):
        device_type, dtype = str(option[0]), option[1]
    else:
        raise TypeError(f"autocast must be a torch.dtype or a (device_type, dtype) pair, got {option!r}")
    if device_type != mesh.device_type:
        raise ValueError(
            f"autocast device type {device_type!r} differs from the mesh's {mesh.device_type!r}: "
            "the ops would run outside the autocast region"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"autocast dtype must be a floating-point dtype, got {dtype}")
    return device_type, dtype


def _describe_autocast(autocast: tuple[str, torch.dtype]) -> str:
    return f"torch.autocast({autocast[0]!r}, dtype={autocast[1]})"


def _autocast_region(autocast: tuple[str, torch.dtype] | None) -> contextlib.AbstractContextManager[Any]:
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(autocast[0], dtype=autocast[1])


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
            result.append(shard_tensor(x, spec.mesh, spec.placements, spec.sizes_by_mesh_dim, requires_grad=_needs_grad(x)))
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
    spec = output._spec
    sizes: dict[int, list[int]] = {}
    if isinstance(output, ShardTensor):
        shapes = spec.sharding_shapes()
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                sizes[mesh_dim] = [s[p.dim % len(full_shape)] for s in shapes[mesh_dim]]
        return shard_tensor(full, output.device_mesh, placements, sizes or None)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, output.device_mesh, placements)


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


# -- comparing ------------------------------------------------------------------------------
def _compare(
    what: str, actual: torch.Tensor | None, expected: torch.Tensor | None, rtol: float, atol: float,
    mismatches: list[Mismatch], errors: dict[str, float], *, check_dtype: bool = True, note: str = "",
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
        mismatches.append(Mismatch(what, f"not within rtol={rtol:g}, atol={atol:g}{note}", result.max_abs_error,
                                   comparison=result))


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


class _AutocastTolerance:
    """Per-tensor tolerances under autocast, from the single-process autocast-vs-full-precision error.

    ``baseline`` holds what the reference run produced in full precision (same inputs,
    parameters and cotangents, no autocast), by the name used in mismatches. See
    `check_conformance` for the rule; dtypes must equal the reference's.
    """

    def __init__(self, autocast: tuple[str, torch.dtype], factor: float, baseline: dict[str, torch.Tensor | None],
                 report: ConformanceReport) -> None:
        self.autocast, self.factor, self.baseline, self.report = autocast, factor, baseline, report

    def reference_error(self, what: str, expected: torch.Tensor | None) -> tuple[float, float]:
        """``(e, scale)``: the measured error, and ``max(e, eps * max|expected|)`` where it is not 0."""
        full = self.baseline.get(what)
        if expected is None or full is None or full.shape != expected.shape or not expected.numel():
            return 0.0, 0.0
        wide = torch.complex128 if expected.is_complex() or full.is_complex() else torch.float64
        expected = expected.detach().to(wide)
        error = (expected - full.detach().to(wide)).abs().max().item()
        if error == 0.0:  # autocast did not touch this tensor: the plain tolerance
            return 0.0, 0.0
        # A max over few elements (a bias gradient) can be far below the rounding unit by luck.
        unit = torch.finfo(self.autocast[1]).eps * expected.abs().max().item()
        return error, max(error, unit)

    def compare(
        self, what: str, actual: torch.Tensor | None, expected: torch.Tensor | None, rtol: float, atol: float,
        mismatches: list[Mismatch], errors: dict[str, float],
    ) -> None:
        """`_compare` with ``atol`` widened by the reference's own autocast error (see `check_conformance`)."""
        error, scale = self.reference_error(what, expected)
        used = max(atol, self.factor * scale)
        self.report.autocast_reference_errors[what] = error
        self.report.autocast_atols[what] = used
        note = (f"; autocast reference vs fp32 error {error:.3e}, "
                f"atol = max({atol:g}, {self.factor:g} x max(that, eps x max|reference|))")
        _compare(what, actual, expected, rtol, used, mismatches, errors, check_dtype=True, note=note,
                 results=self.report.comparisons)


def _full_precision_results(
    fn: Callable[..., Any], inputs: Sequence[Any], specs: Sequence[ShardSpec | None], kwargs: dict[str, Any],
    cotangents: Sequence[torch.Tensor | None],
) -> dict[str, torch.Tensor | None]:
    """Run the reference once without autocast and name what it produced like the comparisons do.

    ``cotangents[i]`` is the autocast reference's cotangent of output ``i`` (``None``: no
    gradient flows from it); it is cast to this run's output dtype.
    """
    module = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    run_inputs = _reference_inputs(inputs)
    outputs = _tensor_leaves(module(*run_inputs, **kwargs))
    results: dict[str, torch.Tensor | None] = {f"output[{i}]": o.detach() for i, o in enumerate(outputs)}
    pairs = [(o, c.to(o.dtype)) for o, c in zip(outputs, cotangents) if c is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
    for i, x in enumerate(run_inputs):
        if specs[i] is not None and _needs_grad(inputs[i]):
            results[f"gradient of input[{i}]"] = x.grad
    if isinstance(module, torch.nn.Module):
        for name, param in module.named_parameters():
            results[f"gradient of parameter {name!r}"] = param.grad
        for name, buffer in module.named_buffers():
            results[f"buffer {name!r}"] = buffer.detach()
    return results


def _compare_buffers(
    sharded: torch.nn.Module, reference: torch.nn.Module, rtol: float, atol: float,
    mismatches: list[Mismatch], errors: dict[str, float], tolerance: _AutocastTolerance | None = None,
    results: dict[str, Comparison] | None = None,
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
        if tolerance is None:
            _compare(what, actual, ref_buffer, rtol, atol, mismatches, errors, results=results)
        else:
            tolerance.compare(what, actual, ref_buffer, rtol, atol, mismatches, errors)


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
                merged[key] = Mismatch(m.what, m.detail, m.max_abs_error, (rank,), m.comparison)
            else:
                errors = [e for e in (previous.max_abs_error, m.max_abs_error) if e is not None]
                found = [c for c in (previous.comparison, m.comparison) if c is not None]
                worst = max(found, key=lambda c: (c.max_abs_error, c.worst_ratio)) if found else None
                merged[key] = Mismatch(m.what, m.detail, max(errors) if errors else None, previous.ranks + (rank,),
                                       worst)
    return list(merged.values())


# -- errors raised by the code under test -----------------------------------------------------
def _is_code_error(error: BaseException) -> bool:
    """Shape, dtype, placement and autograd errors of the code under test (not the framework's own)."""
    if isinstance(error, (MissingShardPatch, ShardextError)):
        return False  # tests rely on these propagating unchanged
    return isinstance(error, (RuntimeError, ValueError, TypeError, IndexError))


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(error).__name__}: {line[:limit]}"


def _plugin_label(call: HandlerCall) -> str | None:
    """``"plugin (dist==version) for target"`` of a recorded call to a plugin's handler, else ``None``."""
    import physicsnemo_shardext
    from physicsnemo_shardext.inventory import plugin_of
    from physicsnemo_shardext.targets import describe_target

    plugin = plugin_of(call.handler, physicsnemo_shardext.get_registry())
    return None if plugin is None else f"{plugin.label} for {describe_target(call.target)}"


def _labels(calls: Sequence[HandlerCall]) -> list[str]:
    return list(dict.fromkeys(label for label in map(_plugin_label, calls) if label is not None))


class _Attribution:
    """Names the plugin behind a failure from the handler calls a `HandlerRecorder` saw."""

    def __init__(self, recorder: HandlerRecorder) -> None:
        self.recorder = recorder

    def ran(self) -> list[str]:
        """Every plugin handler that ran in the sharded run."""
        return _labels(self.recorder.calls)

    def producer_of(self, tensor: Any) -> list[str]:
        """The plugin handlers that returned ``tensor``."""
        return _labels([c for c in self.recorder.calls if id(tensor) in c.result_ids])

    def blame(self, phase: str, produced: Sequence[Any] = ()) -> str:
        """A clause naming the plugins: whose handler raised in ``phase``, and who produced ``produced``.

        A handler that only passed an error on (a wrapper of ``torch.autograd.backward``) is
        named with the handlers that built the outputs, so the real culprit is never hidden.
        """
        raised = _labels([c for c in self.recorder.calls if c.phase == phase and c.error is not None])
        producers = list(dict.fromkeys(label for t in produced for label in self.producer_of(t)))
        others = [label for label in (producers or self.ran()) if label not in raised]
        clauses = []
        if raised:
            clauses.append(f"raised in the handler of plugin {', '.join(raised)}")
        if others:
            kind = "produced by the handler of plugin" if producers else "plugin handler(s) that ran:"
            clauses.append(f"{kind} {', '.join(others)}")
        return "; ".join(clauses)


class _Guard:
    """Turn an error of the code under test inside the block into a `Mismatch` (and suppress it)."""

    def __init__(self, what: str, stage: str, mismatches: list[Mismatch], blame: Callable[[BaseException], str]) -> None:
        self.what, self.stage, self.mismatches, self.blame = what, stage, mismatches, blame
        self.failed = False

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if error is None or not _is_code_error(error):
            return False
        self.failed = True
        clause = self.blame(error)
        detail = f"{self.stage} raised {_first_line(error)}" + (f"; {clause}" if clause else "")
        self.mismatches.append(Mismatch(self.what(error) if callable(self.what) else self.what, detail))
        return True


def _backward_target(error: BaseException, indices: Sequence[int]) -> str:
    """Which output a backward error concerns: autograd names it ``output[k]`` among those passed."""
    found = re.search(r"\boutput\[(\d+)\]", str(error))
    if found and int(found.group(1)) < len(indices):
        return f"gradients (backward from output[{indices[int(found.group(1))]}])"
    return "gradients (backward)"


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
    autocast: torch.dtype | tuple[str, torch.dtype] | None = None,
    autocast_factor: float = AUTOCAST_ERROR_FACTOR,
    compile: bool | str = False,  # noqa: A002 - named like torch.compile
) -> ConformanceReport:
    """Check that ``fn`` on sharded inputs equals ``fn`` on the full inputs, values and gradients.

    Args:
        fn: an ``nn.Module`` (deep-copied for each run) or a function.
        inputs: full inputs, identical on every rank; non-tensors are passed through.
        shardings: one `ShardSpec` for all tensor inputs, or one per input
            (``None``: pass that input unsharded).
        rtol: relative tolerance for outputs (and buffers). Every tensor is compared by the
            one rule of `physicsnemo_shardext.comparison`: ``|a - r| <= atol + rtol * |r|``
            per element, NaN matching NaN.
        atol: absolute tolerance for outputs (and buffers).
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
        autocast: run both forwards (reference and sharded; also the comm-counting pass)
            under ``torch.autocast``: a dtype (``torch.bfloat16``, ``torch.float16``) on the
            mesh's device type, or a ``(device_type, dtype)`` pair, which must name the
            mesh's device type. Backward runs outside the region, as torch recommends.
            The reference also runs once in full precision (same parameters, inputs and
            cotangents); for every compared tensor, ``e`` = max abs error of the autocast
            reference against it, and the tensor is compared with
            ``atol = max(atol, autocast_factor * max(e, eps * max|reference|))``, ``eps`` the
            autocast dtype's machine epsilon (``rtol`` unchanged; ``grad_atol`` likewise for
            gradients). Dtypes must equal the reference's. A tensor autocast leaves alone
            (``e == 0``: its ops ran in full precision) keeps the plain ``atol``.
        autocast_factor: ``k`` above (default `AUTOCAST_ERROR_FACTOR`, 4). The sharded
            autocast run rounds in other places than the reference (per-shard partial sums,
            reductions of low-precision partials), so it differs from the reference by about
            the reference's own rounding error, at most a few rounding units of the tensor's
            largest value; the ``eps`` floor covers tensors of few elements, whose max error
            can be far below one unit by chance. A wrong result (a missing halo, an unreduced
            or doubled gradient) is off by the size of the values, far above ``4 eps``
            (3 % of the largest value in bf16, 0.4 % in fp16).
        compile: also run the sharded forward and backward **twice** under
            ``torch.compile(dynamic=False)`` (``True``: the ``"inductor"`` backend; a string
            names the backend, e.g. ``"aot_eager"``), each time against the same steps run
            eagerly on a fresh copy: every output, input gradient and parameter gradient
            must match within ``rtol``/``atol`` (``grad_rtol``/``grad_atol`` for gradients).
            Reported as ``"compiled (<backend>) step <k>: <what>"``. Dynamo is reset
            before and after (the ranks of the test plugin are shared by many tests). Not
            combined with ``autocast``.

    Returns:
        A `ConformanceReport` (errors measured, output placements, comm counts;
        under autocast also the reference errors and the ``atol`` used per tensor).

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
    amp = _resolve_autocast(autocast, mesh)
    backend = _resolve_compile(compile)
    if backend is not None and amp is not None:
        raise ValueError("check_conformance: compile= and autocast= cannot be combined")
    fn, inputs = _to_mesh_device(fn, inputs, mesh)
    _assert_same_on_all_ranks(fn, inputs)

    report = ConformanceReport(autocast=amp)
    mismatches: list[Mismatch] = []

    # Reference: the full computation, locally.
    reference = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    ref_inputs = _reference_inputs(inputs)
    with _autocast_region(amp):
        ref_outputs = _tensor_leaves(reference(*ref_inputs, **kwargs))

    tolerance: _AutocastTolerance | None = None
    if amp is not None:
        # The same reference in full precision, with the same cotangents: its error sets the tolerances.
        # Numbered as _backward numbers them: the j-th output that requires grad gets seed + j.
        cotangents: list[torch.Tensor | None] = []
        for r in ref_outputs:
            j = sum(c is not None for c in cotangents)
            cotangents.append(_cotangent_for(r, r.shape, seed + j) if r.requires_grad else None)
        baseline = _full_precision_results(fn, inputs, specs, kwargs, cotangents)
        tolerance = _AutocastTolerance(amp, autocast_factor, baseline, report)

    def compare(what: str, actual: Any, expected: Any, rtol_: float, atol_: float) -> None:
        if tolerance is None:
            _compare(what, actual, expected, rtol_, atol_, mismatches, report.max_abs_errors,
                     results=report.comparisons)
        else:
            tolerance.compare(what, actual, expected, rtol_, atol_, mismatches, report.max_abs_errors)

    # Sharded run.
    sharded = _prepare_callable(fn, mesh, params)
    sh_inputs = _sharded_inputs(inputs, specs)
    recorder = HandlerRecorder()  # which handlers ran: names the plugin behind a failure
    who = _Attribution(recorder)
    forward = _Guard("output", "the sharded forward", mismatches, lambda e: who.blame("forward"))
    with forward, _autocast_region(amp), recorder.recording("forward"):
        sh_outputs = _tensor_leaves(sharded(*sh_inputs, **kwargs))
    if not forward.failed and len(sh_outputs) != len(ref_outputs):
        raise ConformanceError([Mismatch("outputs", f"{len(sh_outputs)} tensors, reference has {len(ref_outputs)}")],
                               plugins=who.ran())

    gathered = not forward.failed
    for i, (sh_out, ref_out) in enumerate(zip(sh_outputs, ref_outputs) if gathered else ()):
        what = f"output[{i}]"
        guard = _Guard(what, "gathering it", mismatches, lambda e, t=sh_out: who.blame("forward", [t]))
        with guard:
            full, placements = _gathered(sh_out)
        if guard.failed:
            gathered = False
            continue
        report.output_placements.append(placements)
        compare(what, full, ref_out, rtol, atol)
        wanted = _expected_placements_for(i, expected_placements, default_placements)
        if wanted is not False and placements != wanted:
            clause = who.blame("forward", [sh_out])
            mismatches.append(Mismatch(f"placements of output[{i}]",
                                       f"{placements} != expected {wanted}" + (f"; {clause}" if clause else "")))

    if gathered and _run_backward(ref_outputs, sh_outputs, seed, recorder, who, mismatches):
        _compare_gradients(specs, inputs, sh_inputs, ref_inputs, compare, grad_rtol, grad_atol, mismatches, who)
        if isinstance(fn, torch.nn.Module):
            _compare_param_grads(sharded, reference, params, compare, grad_rtol, grad_atol, mismatches, who)
    if isinstance(fn, torch.nn.Module) and not forward.failed:
        _compare_buffers(sharded, reference, rtol, atol, mismatches, report.max_abs_errors, tolerance,
                         report.comparisons)
    if backend is not None and not mismatches:
        # Only a conformant eager run is worth comparing the compiled one with.
        _check_compiled(fn, inputs, specs, params, kwargs, seed, backend, compare,
                        (rtol, atol, grad_rtol, grad_atol), mismatches)

    merged = _merge(_all_gather(mismatches))
    if merged:
        under = "" if amp is None else f", forward under {_describe_autocast(amp)}"
        raise ConformanceError(merged, f" ({getattr(fn, '__name__', type(fn).__name__)}{under})", plugins=who.ran())

    if count_comms:
        report.comms = measure_comms(fn, inputs, specs, params=params, kwargs=kwargs, seed=seed, autocast=autocast)
    return report


# -- torch.compile ----------------------------------------------------------------------------
COMPILE_STEPS = 2
"""Forward+backward passes `check_conformance` runs compiled (the second one reuses the compiled code)."""


def _resolve_compile(option: bool | str) -> str | None:
    """The backend ``compile=`` asks for, or ``None``."""
    if option is False or option is None:
        return None
    if option is True:
        return "inductor"
    if isinstance(option, str) and option:
        return option
    raise ValueError(f"compile must be a bool or a backend name, got {option!r}")


def _sharded_steps(
    call: Callable[..., Any], module: Any, inputs: Sequence[Any], specs: Sequence[ShardSpec | None],
    params: ParamMode, kwargs: dict[str, Any], seed: int, mismatches: list[Mismatch],
) -> list[dict[str, torch.Tensor | None]]:
    """`COMPILE_STEPS` forward+backward passes of ``call`` on fresh sharded inputs: gathered outputs and gradients."""
    steps = []
    for _ in range(COMPILE_STEPS):
        if isinstance(module, torch.nn.Module):
            module.zero_grad(set_to_none=True)
        sh_inputs = _sharded_inputs(inputs, specs)
        outputs = _tensor_leaves(call(*sh_inputs, **kwargs))
        result: dict[str, torch.Tensor | None] = {}
        for i, out in enumerate(outputs):
            result[f"output[{i}]"] = _gathered(out)[0].detach()
        differentiable = [o for o in outputs if o.requires_grad]
        if differentiable:
            torch.autograd.backward(
                differentiable, [_cotangent_for(o, o.shape, seed + j) for j, o in enumerate(differentiable)])
        for i, sh_in in enumerate(sh_inputs):
            if specs[i] is not None and _needs_grad(inputs[i]):
                grad = sh_in.grad
                result[f"gradient of input[{i}]"] = None if grad is None else _gathered(grad)[0]
        if isinstance(module, torch.nn.Module):
            for name, param in module.named_parameters():
                result[f"gradient of parameter {name!r}"] = _param_grad(name, param, params, mismatches)
        steps.append(result)
    return steps


def _check_compiled(
    fn: Callable[..., Any], inputs: Sequence[Any], specs: Sequence[ShardSpec | None], params: ParamMode,
    kwargs: dict[str, Any], seed: int, backend: str, compare: Callable[..., None],
    tolerances: tuple[float, float, float, float], mismatches: list[Mismatch],
) -> None:
    """The sharded steps under ``torch.compile(backend=backend, dynamic=False)`` against the same steps eagerly."""
    rtol, atol, grad_rtol, grad_atol = tolerances
    mesh = next(s for s in specs if s is not None).mesh
    eager_fn = _prepare_callable(fn, mesh, params)
    compiled_fn = _prepare_callable(fn, mesh, params)
    label = f"compiled ({backend})"
    import torch._dynamo  # noqa: PLC0415 - only needed here

    torch._dynamo.reset()
    try:
        eager = _sharded_steps(eager_fn, eager_fn, inputs, specs, params, kwargs, seed, mismatches)
        guard = _Guard(label, f"torch.compile(backend={backend!r}, dynamic=False)", mismatches, lambda e: "")
        with guard:
            call = torch.compile(compiled_fn, backend=backend, dynamic=False)
            compiled = _sharded_steps(call, compiled_fn, inputs, specs, params, kwargs, seed, mismatches)
    finally:
        torch._dynamo.reset()
    if guard.failed:
        return
    for k, (got, want) in enumerate(zip(compiled, eager)):
        for what in sorted(set(got) | set(want)):
            is_grad = what.startswith("gradient")
            compare(f"{label} step {k}: {what}", got.get(what), want.get(what),
                    grad_rtol if is_grad else rtol, grad_atol if is_grad else atol)


def _run_backward(
    ref_outputs: list[torch.Tensor], sh_outputs: list[torch.Tensor], seed: int, recorder: HandlerRecorder,
    who: _Attribution, mismatches: list[Mismatch],
) -> bool:
    """Backward of both runs; an error of the sharded one becomes a mismatch. Returns whether it completed."""
    indices = [i for i, r in enumerate(ref_outputs) if r.requires_grad]
    if not indices:
        return True
    torch.autograd.backward([ref_outputs[i] for i in indices],
                            [_cotangent_for(ref_outputs[i], ref_outputs[i].shape, seed + j) for j, i in enumerate(indices)])
    produced = [sh_outputs[i] for i in indices]
    cotangents = []
    for j, i in enumerate(indices):
        guard = _Guard(f"output[{i}]", "building its cotangent", mismatches,
                       lambda e, t=sh_outputs[i]: who.blame("forward", [t]))
        with guard:
            cotangents.append(_cotangent_for(sh_outputs[i], ref_outputs[i].shape, seed + j))
        if guard.failed:
            return False
    # Autograd's "Mismatch in shape" names output[k] among those passed: map k back to our numbering.
    guard = _Guard(lambda e: _backward_target(e, indices), "the sharded backward", mismatches,
                   lambda e: who.blame("backward", produced))
    with guard, recorder.recording("backward"):
        torch.autograd.backward(produced, cotangents)
    return not guard.failed


def _compare_gradients(
    specs: Sequence[ShardSpec | None], inputs: Sequence[Any], sh_inputs: Sequence[Any], ref_inputs: Sequence[Any],
    compare: Callable[..., None], rtol: float, atol: float, mismatches: list[Mismatch], who: _Attribution,
) -> None:
    """Input gradients of the sharded run against the reference's (gathering one may raise, too)."""
    for i, (sh_in, ref_in) in enumerate(zip(sh_inputs, ref_inputs)):
        if specs[i] is None or not _needs_grad(inputs[i]):
            continue
        what, grad = f"gradient of input[{i}]", sh_in.grad
        guard = _Guard(what, "gathering it", mismatches, lambda e: who.blame("backward"))
        with guard:
            actual = _gathered(grad)[0] if grad is not None else None
        if not guard.failed:
            compare(what, actual, ref_in.grad, rtol, atol)


def _compare_param_grads(
    sharded: torch.nn.Module, reference: torch.nn.Module, params: ParamMode, compare: Callable[..., None],
    rtol: float, atol: float, mismatches: list[Mismatch], who: _Attribution,
) -> None:
    """Parameter gradients: present, Replicate under ``params="distribute"``, equal to the reference's."""
    sh_params = dict(sharded.named_parameters())
    for name, ref_param in reference.named_parameters():
        what = f"gradient of parameter {name!r}"
        if name not in sh_params:
            mismatches.append(Mismatch(what, "parameter missing from the sharded module"))
            continue
        guard = _Guard(what, "gathering it", mismatches, lambda e: who.blame("backward"))
        with guard:
            actual = _param_grad(name, sh_params[name], params, mismatches)
        if not guard.failed:
            compare(what, actual, ref_param.grad, rtol, atol)


def measure_comms(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    shardings: ShardSpec | Sequence[ShardSpec | None],
    *,
    params: ParamMode = "distribute",
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    autocast: torch.dtype | tuple[str, torch.dtype] | None = None,
) -> PhaseCommStats:
    """Count collectives and payload bytes of one sharded forward and one backward (fresh copies).

    Setup work (sharding the inputs, ``distribute_module``, building the cotangent) is
    not counted. ``autocast`` runs the forward under ``torch.autocast`` as in
    `check_conformance`.

    Examples:
        ```python
        stats = measure_comms(conv, [x], ShardSpec(mesh, [Shard(2)]))
        print(stats.forward.counts, stats.backward.total_bytes)
        ```
    """
    kwargs = kwargs or {}
    specs = _specs_for(inputs, shardings)
    mesh = next(s for s in specs if s is not None).mesh
    amp = _resolve_autocast(autocast, mesh)
    fn, inputs = _to_mesh_device(fn, inputs, mesh)
    sharded = _prepare_callable(fn, mesh, params)
    sh_inputs = _sharded_inputs(inputs, specs)
    stats = PhaseCommStats()
    with CommCounter() as forward, _autocast_region(amp):
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
