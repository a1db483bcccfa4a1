"""The one comparison rule (physicsnemo_shardext.comparison): verdict as torch.isclose, errors robust near zero."""

from __future__ import annotations

import math

import pytest
import torch

from physicsnemo_shardext.comparison import DEFAULT_TOLERANCES, RULE, Comparison, Tolerance, compare


def test_a_zero_reference_and_a_tiny_difference_match_without_a_huge_relative_error():
    # issue 29: a zero-initialised layer's q/k/v gradients, 1e-8 off an exactly zero reference,
    # were reported as relative error 3.8e5 by a measure that divides by the reference's scale alone.
    result = compare(torch.full((4, 8), 1e-8), torch.zeros(4, 8))
    assert result.passed and result.mismatched == 0
    assert result.max_abs_error == pytest.approx(1e-8)
    assert result.max_rel_error == pytest.approx(1e-8 / 1e-5)  # relative to atol, not to 0
    text = result.describe()
    assert "max abs err 1.0e-08 (atol 1e-05)" in text and "(rtol 1e-04" in text and text.endswith(": match")
    assert "relative to atol" in text and "e+05" not in text


def test_a_nearly_zero_reference_does_not_blow_up_the_relative_error_either():
    reference = torch.full((3,), 2.6e-14)
    result = compare(reference + 1e-8, reference)
    assert result.passed and result.max_rel_error <= 1e-3  # the old measure: 1e-8 / 2.6e-14 = 3.8e5


def test_the_relative_error_is_the_usual_one_where_the_reference_is_not_zero():
    result = compare(torch.tensor([1.0, 2.0, 4.5]), torch.tensor([1.0, 2.0, 4.0]))
    assert not result.passed and result.mismatched == 1 and result.worst_index == (2,)
    assert result.max_abs_error == 0.5 and result.max_rel_error == 0.5 / 4.0
    assert result.describe().endswith("worst at [2]: MISMATCH (1 of 3 elements)")


@pytest.mark.parametrize("seed", range(6))
def test_the_verdict_is_torch_isclose_elementwise(seed):
    generator = torch.Generator().manual_seed(seed)
    expected = torch.randn(7, 5, generator=generator) * 10 ** torch.randint(-8, 3, (7, 5), generator=generator)
    actual = expected + torch.randn(7, 5, generator=generator) * 10 ** torch.randint(
        -9, -3, (7, 5), generator=generator
    )
    actual[0, 0], expected[0, 0] = float("nan"), float("nan")  # NaN matches NaN
    if seed % 2:
        actual[1, 1] = float("inf")  # ... but inf does not match a finite value
    tolerance = Tolerance(rtol=1e-4, atol=1e-6)
    close = torch.isclose(actual.double(), expected.double(), rtol=1e-4, atol=1e-6, equal_nan=True)
    result = compare(actual, expected, tolerance)
    assert result.passed == bool(close.all()) and result.mismatched == int((~close).sum())
    if not result.passed:
        assert not close[result.worst_index]  # the worst element is one of those outside


def test_the_worst_element_is_the_one_using_most_of_its_allowance():
    expected = torch.tensor([[100.0, 0.0], [1.0, 0.5]], dtype=torch.float64)
    actual = expected + torch.tensor([[5e-3, 0.0], [0.0, 1e-4]], dtype=torch.float64)
    result = compare(actual, expected, Tolerance(1e-4, 1e-5))  # 5e-3 on 100 is within, 1e-4 on 0.5 is not
    assert not result.passed and result.worst_index == (1, 1) and result.worst_ratio > 1
    assert result.max_abs_error == pytest.approx(5e-3)  # the largest difference is elsewhere, and allowed


def test_non_finite_values_match_only_themselves():
    inf, nan = float("inf"), float("nan")
    assert compare(torch.tensor([inf, -inf, nan, 1.0]), torch.tensor([inf, -inf, nan, 1.0])).passed
    for actual, expected in [([inf], [-inf]), ([nan], [0.0]), ([1.0], [inf]), ([1.0], [nan])]:
        result = compare(torch.tensor(actual), torch.tensor(expected))
        assert not result.passed and math.isinf(result.max_abs_error) and math.isinf(result.max_rel_error)


def test_shape_and_dtype_differences_are_mismatches_that_say_so():
    shape = compare(torch.ones(3, 13), torch.ones(4, 13))
    assert not shape.passed and shape.problem == "shape (3, 13) != reference (4, 13)"
    assert shape.describe() == "shape (3, 13) != reference (4, 13): MISMATCH"
    dtype = compare(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not dtype.passed and dtype.problem == "dtype torch.float32 != reference torch.float64"
    assert compare(torch.ones(2), torch.ones(2, dtype=torch.float64), check_dtype=False).passed


def test_complex_integer_and_empty_tensors():
    assert compare(torch.tensor([1 + 1j]), torch.tensor([1 + 1j + 1e-9j])).passed
    assert not compare(torch.tensor([1 + 1j]), torch.tensor([1 - 1j])).passed  # the imaginary part counts
    assert not compare(torch.tensor([3]), torch.tensor([4])).passed  # integers: exact by default
    assert compare(torch.tensor([3]), torch.tensor([4]), Tolerance(0.0, 1.0)).passed
    empty = compare(torch.ones(0, 3), torch.ones(0, 3))
    assert empty.passed and empty.max_abs_error == 0.0 and empty.numel == 0


def test_scalars_have_no_index_in_the_description():
    result = compare(torch.tensor(2.0), torch.tensor(1.0))
    assert not result.passed and result.worst_index == () and "worst at" not in result.describe()


def test_defaults_by_dtype_are_stated_once():
    assert Tolerance.for_dtype(torch.float32) == DEFAULT_TOLERANCES["float32"] == Tolerance(1e-4, 1e-5)
    assert Tolerance.for_dtype("torch.float64") == DEFAULT_TOLERANCES["float64"]
    assert Tolerance.for_dtype(torch.complex64) == DEFAULT_TOLERANCES["float32"]
    assert Tolerance.for_dtype(torch.bfloat16).rtol > Tolerance.for_dtype(torch.float16).rtol > 1e-4
    assert Tolerance.for_dtype(torch.int32) == Tolerance(0.0, 0.0)
    # with no tolerance, the reference's dtype chooses
    assert compare(torch.ones(2, dtype=torch.bfloat16) * 1.01, torch.ones(2, dtype=torch.bfloat16)).passed
    assert not compare(torch.ones(2) * 1.01, torch.ones(2)).passed
    assert "atol + rtol * |r|" in RULE


@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf"), True])
def test_tolerance_refuses_what_is_not_a_finite_non_negative_number(value):
    with pytest.raises(ValueError, match="finite number >= 0"):
        Tolerance(rtol=value, atol=0.0)


def test_passed_implies_the_absolute_error_is_within_the_tolerance_of_the_largest_value():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        expected = torch.randn(50, generator=generator)
        actual = expected + 1e-5 * torch.randn(50, generator=generator)
        result = compare(actual, expected)
        assert isinstance(result, Comparison)
        if result.passed:
            assert result.max_abs_error <= 1e-5 + 1e-4 * float(expected.abs().max())
