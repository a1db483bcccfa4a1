"""The one rule for "equal to single-process": a tensor against its reference, within a `Tolerance`.

Every check that compares a sharded (or parallel) run with the single-process
reference uses `compare`: `check_conformance`, `shardext verify` (`check_model`)
and `verify_training`. The rule, for an actual tensor ``a`` and its reference ``r``:

* **Verdict**, element by element, as `torch.isclose` and `numpy.isclose`:
  ``|a - r| <= atol + rtol * |r|`` for every element. Non-finite values match only
  themselves: NaN where the reference has NaN (``equal_nan``: a sharded run that
  reproduces the reference's NaN is conformant), ``+inf`` where it has ``+inf``.
  A different shape is a mismatch; so is a different dtype unless
  ``check_dtype=False``. Complex tensors are compared as complex (``|.|`` the modulus).
* **Absolute error**: ``max|a - r|`` over the elements (``inf`` where a
  non-finite value does not match).
* **Relative error**: ``max|a - r| / max(max|r|, atol)``, normwise: the largest
  error relative to the reference's largest magnitude, which is the usual
  relative error wherever the reference is distinguishable from zero. Where the
  whole reference is within ``atol`` of zero (a zero-initialised layer's
  gradient), it is measured against ``atol`` instead, so ``1e-8`` against an
  exact zero reads ``1e-3`` of ``atol``, not a huge ratio. Both numbers are
  reported; the verdict is the elementwise rule alone (a match can show a
  relative error above ``rtol`` when its absolute part covers it, and vice versa).
* **Worst element**: the one that uses the largest share of its allowance,
  ``|a - r| / (atol + rtol * |r|)``; above 1 means outside.

`DEFAULT_TOLERANCES` holds the defaults by dtype (used by `shardext verify` and
by `Tolerance.for_dtype`): float64 ``rtol 1e-10, atol 1e-10``, float32
``rtol 1e-4, atol 1e-5``, bfloat16 ``rtol 5e-2, atol 2e-2``, float16
``rtol 2e-2, atol 2e-3`` (complex as their real dtype; integers and bool exact).
A sharded run sums in another order than the reference, so float results differ
by rounding: a few units of the dtype's epsilon times the values' scale. The
defaults leave room for that over a whole model's forward and backward, and are
far below what a wrong result gives (a missing halo, a doubled or unreduced
gradient is off by the size of the values).

Examples:
    A zero-initialised layer's gradient: exactly zero in the reference, ``1e-8``
    in the sharded run. It matches, and the relative error is not a huge ratio:

    >>> result = compare(torch.full((2, 3), 1e-8), torch.zeros(2, 3))
    >>> result.passed, result.max_rel_error < 1e-2
    (True, True)
    >>> print(result.describe())
    max abs err 1.0e-08 (atol 1e-05), max rel err 1.0e-03 (rtol 1e-04; reference within atol of 0:
    relative to atol), worst at [0, 0]: match

    A wrong element is named:

    >>> print(compare(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])).describe())
    max abs err 5.0e-01 (atol 1e-05), max rel err 2.5e-01 (rtol 1e-04), worst at [1]:
    MISMATCH (1 of 2 elements)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DEFAULT_TOLERANCES", "RULE", "Comparison", "Tolerance", "compare", "exact_float32"]

#: The rule in one line (the text reports print).
RULE = "|a - r| <= atol + rtol * |r| elementwise; rel = max|a - r| / max(max|r|, atol)"


@dataclass(frozen=True)
class Tolerance:
    """How close is equal: ``|a - r| <= atol + rtol * |r|`` for every element.

    Attributes:
        rtol: the relative part, a fraction of the reference element's magnitude.
        atol: the absolute part; also the magnitude below which a reference counts as zero.

    Examples:
        >>> Tolerance.for_dtype(torch.float32)
        Tolerance(rtol=0.0001, atol=1e-05)
        >>> str(Tolerance(1e-4, 1e-5))
        'rtol 1e-04, atol 1e-05'
    """

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0 or math.isinf(value):
                raise ValueError(f"Tolerance.{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def for_dtype(cls, dtype: torch.dtype | str) -> Tolerance:
        """The default tolerance for ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"bfloat16"``).

        Complex dtypes take their real dtype's; other dtypes (integers, bool) are compared exactly.

        Examples:
            >>> Tolerance.for_dtype("bfloat16"), Tolerance.for_dtype(torch.int64)
            (Tolerance(rtol=0.05, atol=0.02), Tolerance(rtol=0.0, atol=0.0))
        """
        name = str(dtype).removeprefix("torch.")
        name = {
            "complex128": "float64",
            "cdouble": "float64",
            "complex64": "float32",
            "cfloat": "float32",
            "double": "float64",
            "float": "float32",
            "half": "float16",
        }.get(name, name)
        return DEFAULT_TOLERANCES.get(name, cls(0.0, 0.0))

    def __str__(self) -> str:
        return f"rtol {self.rtol:.0e}, atol {self.atol:.0e}"


#: Default tolerances by dtype name (the module docstring says why these).
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-10, atol=1e-10),
    "float32": Tolerance(rtol=1e-4, atol=1e-5),
    "bfloat16": Tolerance(rtol=5e-2, atol=2e-2),
    "float16": Tolerance(rtol=2e-2, atol=2e-3),
}


@dataclass(frozen=True)
class Comparison:
    """The result of `compare`: the verdict, both error measures and where it is worst.

    Attributes:
        passed: every element within ``atol + rtol * |r|`` (and shape, dtype agree).
        max_abs_error: ``max|a - r|`` (``inf``: a shape or dtype problem, or an unmatched non-finite value).
        max_rel_error: ``max|a - r| / max(max|r|, atol)`` (``inf`` as above).
        tolerance: the `Tolerance` used.
        worst_index: the element using the largest share of its allowance (``None``: all equal, or a problem).
        worst_ratio: that share, ``|a - r| / (atol + rtol * |r|)``: above 1 is outside.
        mismatched: how many elements are outside.
        numel: how many elements were compared.
        problem: why nothing could be compared elementwise (``"shape (3,) != reference (4,)"``), else ``""``.
        reference_scale: ``max|r|`` over the finite elements (below ``atol``: the relative error is relative to ``atol``).

    Examples:
        >>> compare(torch.ones(3), torch.ones(4)).problem
        'shape (3,) != reference (4,)'
    """

    passed: bool
    max_abs_error: float
    max_rel_error: float
    tolerance: Tolerance
    worst_index: tuple[int, ...] | None = None
    worst_ratio: float = 0.0
    mismatched: int = 0
    numel: int = 0
    problem: str = ""
    reference_scale: float = 0.0

    @property
    def verdict(self) -> str:
        """``"match"`` or ``"MISMATCH"``."""
        return "match" if self.passed else "MISMATCH"

    def describe(self) -> str:
        """One line: both errors with their part of the tolerance, the worst element, the verdict.

        Examples:
            >>> print(compare(torch.ones(2), torch.ones(2)).describe())
            max abs err 0.0e+00 (atol 1e-05), max rel err 0.0e+00 (rtol 1e-04): match
        """
        if self.problem:
            return f"{self.problem}: {self.verdict}"
        tol = self.tolerance
        text = (
            f"max abs err {self.max_abs_error:.1e} (atol {tol.atol:.0e}), "
            f"max rel err {self.max_rel_error:.1e} (rtol {tol.rtol:.0e}"
        )
        if self.reference_scale < tol.atol and self.max_abs_error > 0:
            text += "; reference within atol of 0: relative to atol"
        text += ")"
        if self.worst_index is not None and self.worst_index:
            text += f", worst at {list(self.worst_index)}"
        text += f": {self.verdict}"
        if not self.passed:
            text += f" ({self.mismatched} of {self.numel} elements)"
        return text


def _failed(problem: str, tolerance: Tolerance, numel: int) -> Comparison:
    inf = math.inf
    return Comparison(False, inf, inf, tolerance, None, inf, numel, numel, problem)


def compare(
    actual: Tensor, expected: Tensor, tolerance: Tolerance | None = None, *, check_dtype: bool = True
) -> Comparison:
    """Compare ``actual`` with its reference ``expected`` by the rule of this module.

    Args:
        actual: the tensor under test (a plain tensor: gather a ShardTensor first).
        expected: the reference.
        tolerance: default `Tolerance.for_dtype` of ``expected``'s dtype.
        check_dtype: a different dtype is a mismatch (values are still compared when ``False``).

    Returns:
        The `Comparison` (computed in float64, or complex128 for complex tensors).

    Examples:
        >>> result = compare(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
        >>> result.passed, result.max_abs_error
        (True, 0.0)
        >>> compare(torch.tensor([float("nan")]), torch.tensor([0.0])).passed
        False
    """
    tolerance = Tolerance.for_dtype(expected.dtype) if tolerance is None else tolerance
    numel = expected.numel()
    if tuple(actual.shape) != tuple(expected.shape):
        return _failed(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}", tolerance, numel)
    if check_dtype and actual.dtype != expected.dtype:
        return _failed(f"dtype {actual.dtype} != reference {expected.dtype}", tolerance, numel)
    if numel == 0:
        return Comparison(True, 0.0, 0.0, tolerance, numel=0)
    wide = torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    a = actual.detach().to(dtype=wide).reshape(-1)
    r = expected.detach().to(device=a.device, dtype=wide).reshape(-1)
    finite = torch.isfinite(a) & torch.isfinite(r)
    same_nonfinite = ~finite & ((a == r) | (torch.isnan(a) & torch.isnan(r)))
    diff = torch.where(finite, (a - r).abs(), 0.0)
    allowed = tolerance.atol + tolerance.rtol * torch.where(finite, r.abs(), 0.0)
    outside = torch.where(finite, diff > allowed, ~same_nonfinite)
    mismatched = int(outside.sum())
    # Share of the allowance each element uses (an unmatched non-finite value: all of it and more).
    ratio = torch.where(
        allowed > 0, diff / allowed.clamp_min(torch.finfo(torch.float64).tiny), torch.where(diff > 0, math.inf, 0.0)
    )
    ratio = torch.where(finite, ratio, torch.where(same_nonfinite, 0.0, math.inf))
    worst_flat = int(ratio.argmax())
    worst_ratio = float(ratio[worst_flat])
    worst_index = (
        None
        if worst_ratio == 0.0
        else tuple(int(i) for i in torch.unravel_index(torch.tensor(worst_flat), tuple(expected.shape)))
    )
    max_abs = math.inf if bool((~finite & ~same_nonfinite).any()) else float(diff.max())
    finite_r = r[torch.isfinite(r)]
    scale = max(float(finite_r.abs().max()) if finite_r.numel() else 0.0, tolerance.atol)
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return Comparison(
        mismatched == 0,
        max_abs,
        max_rel,
        tolerance,
        worst_index,
        worst_ratio,
        mismatched,
        numel,
        reference_scale=float(finite_r.abs().max()) if finite_r.numel() else 0.0,
    )


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Switch TF32 off (matmuls and cuDNN convolutions) while two runs are compared; restore it after.

    On Ampere and newer GPUs cuDNN convolutions use TF32 by default, which rounds float32
    products to 10 mantissa bits (about 1e-3 relative). A sharded run picks other kernels
    than the single-process one (other shapes), so two correct runs would differ by far
    more than the float32 tolerance (measured on an H100: FNO's output 3e-4 relative,
    a UNet's gradients up to 1e-1). With TF32 off, both runs compute in float32.

    Examples:
        >>> with exact_float32():
        ...     torch.backends.cudnn.allow_tf32
        False
    """
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])
