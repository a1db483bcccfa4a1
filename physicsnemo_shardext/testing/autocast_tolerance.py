"""Tolerances under autocast: how far a sharded autocast run may be from the single-process autocast one.

With ``autocast=``, `check_conformance` runs both forwards under `torch.autocast`
(`_autocast_region`; `_resolve_autocast` reads the option) and the reference once more
in full precision (`_full_precision_results`). `_AutocastTolerance` then compares each
tensor with ``atol = max(atol, k * max(e, eps * max|reference|))``: ``e`` the
reference's own autocast-vs-full-precision error, ``eps`` the autocast dtype's machine
epsilon, ``k`` `AUTOCAST_ERROR_FACTOR` unless the caller says otherwise (the rule and
its reasons are in `check_conformance`).

Examples:
    >>> from types import SimpleNamespace
    >>> from physicsnemo_shardext.testing.conformance_report import ConformanceReport
    >>> _resolve_autocast(torch.bfloat16, SimpleNamespace(device_type="cpu"))
    ('cpu', torch.bfloat16)

    The reference's own autocast error is 0.1, so a sharded run 0.2 off it passes, 1.0 off fails:

    >>> full = torch.tensor([1.0, 2.0, 3.0])
    >>> reference = full + torch.tensor([0.0, 0.0, 0.1])
    >>> report, mismatches = ConformanceReport(), []
    >>> tolerance = _AutocastTolerance(("cpu", torch.bfloat16), 4.0, {"output[0]": full}, report)
    >>> tolerance.compare("output[0]", reference + 0.2, reference, 1e-4, 1e-5, mismatches, {})
    >>> mismatches, round(report.autocast_atols["output[0]"], 3)
    ([], 0.4)
    >>> tolerance.compare("output[0]", reference + 1.0, reference, 1e-4, 1e-5, mismatches, {})
    >>> [m.what for m in mismatches]
    ['output[0]']
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_shardext.testing.conformance_report import ConformanceReport, Mismatch
from physicsnemo_shardext.testing.conformance_runs import (
    ShardSpec,
    _compare,
    _needs_grad,
    _reference_inputs,
    _tensor_leaves,
)

__all__ = ["AUTOCAST_ERROR_FACTOR"]

# Under autocast, a compared tensor may differ from the single-process autocast reference by
# up to this many times the reference's own autocast-vs-fp32 error (see check_conformance).
AUTOCAST_ERROR_FACTOR = 4.0


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


def _autocast_region(autocast: tuple[str, torch.dtype] | None) -> contextlib.AbstractContextManager[Any]:
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(autocast[0], dtype=autocast[1])


class _AutocastTolerance:
    """Per-tensor tolerances under autocast, from the single-process autocast-vs-full-precision error.

    ``baseline`` holds what the reference run produced in full precision (same inputs,
    parameters and cotangents, no autocast), by the name used in mismatches. See
    `check_conformance` for the rule; dtypes must equal the reference's.
    """

    def __init__(
        self,
        autocast: tuple[str, torch.dtype],
        factor: float,
        baseline: dict[str, torch.Tensor | None],
        report: ConformanceReport,
    ) -> None:
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
        self,
        what: str,
        actual: torch.Tensor | None,
        expected: torch.Tensor | None,
        rtol: float,
        atol: float,
        mismatches: list[Mismatch],
        errors: dict[str, float],
    ) -> None:
        """`_compare` with ``atol`` widened by the reference's own autocast error (see `check_conformance`)."""
        error, scale = self.reference_error(what, expected)
        used = max(atol, self.factor * scale)
        self.report.autocast_reference_errors[what] = error
        self.report.autocast_atols[what] = used
        note = (
            f"; autocast reference vs fp32 error {error:.3e}, "
            f"atol = max({atol:g}, {self.factor:g} x max(that, eps x max|reference|))"
        )
        _compare(
            what,
            actual,
            expected,
            rtol,
            used,
            mismatches,
            errors,
            check_dtype=True,
            note=note,
            results=self.report.comparisons,
        )


def _full_precision_results(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    specs: Sequence[ShardSpec | None],
    kwargs: dict[str, Any],
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
