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

This module holds the check itself, carved into its steps (`_prepare`, `_reference`,
`_forward`, `_compare_outputs`, `_backward`, `_verdict`). What the steps use lives in
modules of their own, and every name stays importable from here:
`physicsnemo_shardext.testing.conformance_report` (`Mismatch`, `ConformanceError`,
`ConformanceReport`), `physicsnemo_shardext.testing.conformance_runs` (`ShardSpec`,
building and comparing the two runs), `physicsnemo_shardext.testing.autocast_tolerance`,
`physicsnemo_shardext.testing.attribution` (errors of the code under test, and the plugin
behind them), `physicsnemo_shardext.testing.compile_check` and
`physicsnemo_shardext.testing.comm_measurement` (`measure_comms`).

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

    What a failing check raises on every rank, an ``AssertionError`` listing the mismatches:

    >>> error = ConformanceError([Mismatch("output[0]", "shape (3,) != reference (4,)", ranks=(0, 1))])
    >>> isinstance(error, AssertionError), [m.what for m in error.mismatches]
    (True, ['output[0]'])
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from physicsnemo_shardext.comparison import Comparison
from physicsnemo_shardext.engine.trace import HandlerRecorder
from physicsnemo_shardext.testing.attribution import (  # noqa: F401 - every name importable from here, as before
    _Attribution,
    _backward_target,
    _first_line,
    _Guard,
    _is_code_error,
    _labels,
    _plugin_label,
)
from physicsnemo_shardext.testing.autocast_tolerance import (  # noqa: F401 - every name importable from here
    AUTOCAST_ERROR_FACTOR,
    _autocast_region,
    _AutocastTolerance,
    _full_precision_results,
    _resolve_autocast,
)
from physicsnemo_shardext.testing.comm_measurement import measure_comms
from physicsnemo_shardext.testing.compile_check import (  # noqa: F401 - every name importable from here
    COMPILE_STEPS,
    _check_compiled,
    _resolve_compile,
    _sharded_steps,
)
from physicsnemo_shardext.testing.conformance_report import (  # noqa: F401 - every name importable from here
    ConformanceError,
    ConformanceReport,
    Mismatch,
    _describe_autocast,
    _merge,
)
from physicsnemo_shardext.testing.conformance_runs import (  # noqa: F401 - every name importable from here
    _DISTRIBUTED,
    ParamMode,
    ShardSpec,
    _all_gather,
    _checksum,
    _compare,
    _cotangent_for,
    _expected_placements_for,
    _gathered,
    _needs_grad,
    _param_grad,
    _prepare_callable,
    _reference_inputs,
    _sharded_inputs,
    _specs_for,
    _tensor_leaves,
    _to_mesh_device,
)

__all__ = [
    "AUTOCAST_ERROR_FACTOR",
    "ConformanceError",
    "ConformanceReport",
    "Mismatch",
    "ShardSpec",
    "check_conformance",
]


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
    check = _prepare(
        fn,
        inputs,
        shardings,
        rtol=rtol,
        atol=atol,
        grad_rtol=grad_rtol,
        grad_atol=grad_atol,
        params=params,
        kwargs=kwargs,
        seed=seed,
        autocast=autocast,
        autocast_factor=autocast_factor,
        compile=compile,
    )
    reference = _reference(check)
    sharded = _forward(check, reference)
    _compare_outputs(check, reference, sharded, expected_placements)
    if sharded.gathered:
        _backward(check, reference, sharded)
    if isinstance(check.fn, torch.nn.Module) and sharded.ran:
        _compare_buffers(
            cast(torch.nn.Module, sharded.module),
            cast(torch.nn.Module, reference.module),
            check.rtol,
            check.atol,
            check.mismatches,
            check.report.max_abs_errors,
            check.tolerance,
            check.report.comparisons,
        )
    if check.backend is not None and not check.mismatches:
        # Only a conformant eager run is worth comparing the compiled one with.
        _check_compiled(
            check.fn,
            check.inputs,
            check.specs,
            check.params,
            check.kwargs,
            check.seed,
            check.backend,
            check.compare,
            (check.rtol, check.atol, check.grad_rtol, check.grad_atol),
            check.mismatches,
        )
    _verdict(check, sharded)
    if count_comms:
        check.report.comms = measure_comms(
            check.fn, check.inputs, check.specs, params=params, kwargs=check.kwargs, seed=seed, autocast=autocast
        )
    return check.report


# -- the steps ------------------------------------------------------------------------------
@dataclass
class _Check:
    """One `check_conformance` call as its steps share it: the prepared inputs, the options, the findings."""

    fn: Callable[..., Any]  # on the mesh's device (a module: a copy)
    inputs: list[Any]  # full inputs, on the mesh's device
    specs: list[ShardSpec | None]
    kwargs: dict[str, Any]
    mesh: DeviceMesh
    params: ParamMode
    seed: int
    rtol: float
    atol: float
    grad_rtol: float
    grad_atol: float
    amp: tuple[str, torch.dtype] | None  # the resolved autocast option
    autocast_factor: float
    backend: str | None  # the resolved compile option
    default_placements: tuple[Placement, ...]  # the first sharded input's: what outputs keep by default
    report: ConformanceReport
    mismatches: list[Mismatch] = field(default_factory=list)
    tolerance: _AutocastTolerance | None = None  # under autocast: the tolerances per tensor

    def compare(self, what: str, actual: Any, expected: Any, rtol: float, atol: float) -> None:
        """Compare one tensor with the reference's (under autocast by its tolerance); record the error."""
        if self.tolerance is None:
            _compare(
                what,
                actual,
                expected,
                rtol,
                atol,
                self.mismatches,
                self.report.max_abs_errors,
                results=self.report.comparisons,
            )
        else:
            self.tolerance.compare(what, actual, expected, rtol, atol, self.mismatches, self.report.max_abs_errors)


@dataclass
class _Reference:
    """The single-process run: its module copy (or the function), its inputs and its outputs."""

    module: Callable[..., Any]
    inputs: list[Any]
    outputs: list[torch.Tensor]


@dataclass
class _Sharded:
    """The sharded run: module copy, ShardTensor inputs, outputs, and who ran (`HandlerRecorder`)."""

    module: Callable[..., Any]
    inputs: list[Any]
    outputs: list[torch.Tensor]
    recorder: HandlerRecorder
    who: _Attribution
    ran: bool  # the forward completed
    gathered: bool  # ... and every output was gathered (so backward can run)


def _prepare(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    shardings: ShardSpec | Sequence[ShardSpec | None],
    *,
    rtol: float,
    atol: float,
    grad_rtol: float | None,
    grad_atol: float | None,
    params: ParamMode,
    kwargs: dict[str, Any] | None,
    seed: int,
    autocast: torch.dtype | tuple[str, torch.dtype] | None,
    autocast_factor: float,
    compile: bool | str,  # noqa: A002 - named like torch.compile
) -> _Check:
    """Read the options, move ``fn`` and the inputs to the mesh's device, check every rank holds the same."""
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
    fn, moved = _to_mesh_device(fn, inputs, mesh)
    _assert_same_on_all_ranks(fn, moved)
    return _Check(
        fn,
        moved,
        specs,
        kwargs,
        mesh,
        params,
        seed,
        rtol,
        atol,
        grad_rtol,
        grad_atol,
        amp,
        autocast_factor,
        backend,
        default_placements,
        ConformanceReport(autocast=amp),
    )


def _reference(check: _Check) -> _Reference:
    """The full computation, locally; under autocast also once in full precision, which sets the tolerances."""
    fn = check.fn
    reference = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    ref_inputs = _reference_inputs(check.inputs)
    with _autocast_region(check.amp):
        ref_outputs = _tensor_leaves(reference(*ref_inputs, **check.kwargs))
    if check.amp is not None:
        # The same reference in full precision, with the same cotangents: its error sets the tolerances.
        # Numbered as _backward numbers them: the j-th output that requires grad gets seed + j.
        cotangents: list[torch.Tensor | None] = []
        for r in ref_outputs:
            j = sum(c is not None for c in cotangents)
            cotangents.append(_cotangent_for(r, r.shape, check.seed + j) if r.requires_grad else None)
        baseline = _full_precision_results(fn, check.inputs, check.specs, check.kwargs, cotangents)
        check.tolerance = _AutocastTolerance(check.amp, check.autocast_factor, baseline, check.report)
    return _Reference(reference, ref_inputs, ref_outputs)


def _forward(check: _Check, reference: _Reference) -> _Sharded:
    """The sharded forward, its handler calls recorded; an error of the code under test becomes a mismatch."""
    sharded = _prepare_callable(check.fn, check.mesh, check.params)
    sh_inputs = _sharded_inputs(check.inputs, check.specs)
    recorder = HandlerRecorder()  # which handlers ran: names the plugin behind a failure
    who = _Attribution(recorder)
    forward = _Guard("output", "the sharded forward", check.mismatches, lambda e: who.blame("forward"))
    sh_outputs: list[torch.Tensor] = []
    with forward, _autocast_region(check.amp), recorder.recording("forward"):
        sh_outputs = _tensor_leaves(sharded(*sh_inputs, **check.kwargs))
    if not forward.failed and len(sh_outputs) != len(reference.outputs):
        raise ConformanceError(
            [Mismatch("outputs", f"{len(sh_outputs)} tensors, reference has {len(reference.outputs)}")],
            plugins=who.ran(),
        )
    return _Sharded(sharded, sh_inputs, sh_outputs, recorder, who, ran=not forward.failed, gathered=not forward.failed)


def _compare_outputs(check: _Check, reference: _Reference, sharded: _Sharded, expected_placements: Any) -> None:
    """Each output gathered and compared with the reference's, its placements with the expected ones."""
    who = sharded.who
    for i, (sh_out, ref_out) in enumerate(zip(sharded.outputs, reference.outputs) if sharded.gathered else ()):
        what = f"output[{i}]"
        # The guard is entered below, in this iteration: its blame may read the loop variable.
        guard = _Guard(what, "gathering it", check.mismatches, lambda e: who.blame("forward", [sh_out]))
        with guard:
            full, placements = _gathered(sh_out)
        if guard.failed:
            sharded.gathered = False
            continue
        check.report.output_placements.append(placements)
        check.compare(what, full, ref_out, check.rtol, check.atol)
        wanted = _expected_placements_for(i, expected_placements, check.default_placements)
        if wanted is not False and placements != wanted:
            clause = who.blame("forward", [sh_out])
            check.mismatches.append(
                Mismatch(
                    f"placements of output[{i}]",
                    f"{placements} != expected {wanted}" + (f"; {clause}" if clause else ""),
                )
            )


def _backward(check: _Check, reference: _Reference, sharded: _Sharded) -> None:
    """Backward of both runs with the same cotangents; then input and parameter gradients compared."""
    if not _run_backward(
        reference.outputs, sharded.outputs, check.seed, sharded.recorder, sharded.who, check.mismatches
    ):
        return
    _compare_gradients(
        check.specs,
        check.inputs,
        sharded.inputs,
        reference.inputs,
        check.compare,
        check.grad_rtol,
        check.grad_atol,
        check.mismatches,
        sharded.who,
    )
    if isinstance(check.fn, torch.nn.Module):
        _compare_param_grads(
            cast(torch.nn.Module, sharded.module),
            cast(torch.nn.Module, reference.module),
            check.params,
            check.compare,
            check.grad_rtol,
            check.grad_atol,
            check.mismatches,
            sharded.who,
        )


def _verdict(check: _Check, sharded: _Sharded) -> None:
    """Every rank's mismatches, merged; raised on every rank as one `ConformanceError` naming the plugins that ran."""
    merged = _merge(_all_gather(check.mismatches))
    if merged:
        under = "" if check.amp is None else f", forward under {_describe_autocast(check.amp)}"
        name = getattr(check.fn, "__name__", type(check.fn).__name__)
        raise ConformanceError(merged, f" ({name}{under})", plugins=sharded.who.ran())


# -- the steps' parts -----------------------------------------------------------------------
def _run_backward(
    ref_outputs: list[torch.Tensor],
    sh_outputs: list[torch.Tensor],
    seed: int,
    recorder: HandlerRecorder,
    who: _Attribution,
    mismatches: list[Mismatch],
) -> bool:
    """Backward of both runs; an error of the sharded one becomes a mismatch. Returns whether it completed."""
    indices = [i for i, r in enumerate(ref_outputs) if r.requires_grad]
    if not indices:
        return True
    torch.autograd.backward(
        [ref_outputs[i] for i in indices],
        [_cotangent_for(ref_outputs[i], ref_outputs[i].shape, seed + j) for j, i in enumerate(indices)],
    )
    produced = [sh_outputs[i] for i in indices]
    cotangents = []
    for j, i in enumerate(indices):
        guard = _Guard(
            f"output[{i}]", "building its cotangent", mismatches, lambda e: who.blame("forward", [sh_outputs[i]])
        )  # entered below, in this iteration
        with guard:
            cotangents.append(_cotangent_for(sh_outputs[i], ref_outputs[i].shape, seed + j))
        if guard.failed:
            return False
    # Autograd's "Mismatch in shape" names output[k] among those passed: map k back to our numbering.
    guard = _Guard(
        lambda e: _backward_target(e, indices),
        "the sharded backward",
        mismatches,
        lambda e: who.blame("backward", produced),
    )
    with guard, recorder.recording("backward"):
        torch.autograd.backward(produced, cotangents)
    return not guard.failed


def _compare_gradients(
    specs: Sequence[ShardSpec | None],
    inputs: Sequence[Any],
    sh_inputs: Sequence[Any],
    ref_inputs: Sequence[Any],
    compare: Callable[..., None],
    rtol: float,
    atol: float,
    mismatches: list[Mismatch],
    who: _Attribution,
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
    sharded: torch.nn.Module,
    reference: torch.nn.Module,
    params: ParamMode,
    compare: Callable[..., None],
    rtol: float,
    atol: float,
    mismatches: list[Mismatch],
    who: _Attribution,
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


def _compare_buffers(
    sharded: torch.nn.Module,
    reference: torch.nn.Module,
    rtol: float,
    atol: float,
    mismatches: list[Mismatch],
    errors: dict[str, float],
    tolerance: _AutocastTolerance | None = None,
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
