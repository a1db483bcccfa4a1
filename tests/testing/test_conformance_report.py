"""What a conformance check reports (testing/conformance_report.py): mismatches, merged over ranks, and the error."""

from __future__ import annotations

import torch

from physicsnemo_shardext.comparison import Tolerance, compare
from physicsnemo_shardext.testing.conformance_report import ConformanceError, ConformanceReport, Mismatch, _merge


def test_the_same_mismatch_on_several_ranks_is_one_entry_with_the_worst_error():
    a = Mismatch("output[0]", "not within tolerance", 0.5)
    b = Mismatch("output[0]", "not within tolerance", 2.0)
    other = Mismatch("output[1]", "shape (3,) != reference (4,)")
    merged = _merge([[a, other], [b]])
    assert [(m.what, m.max_abs_error, m.ranks) for m in merged] == [
        ("output[0]", 2.0, (0, 1)),
        ("output[1]", None, (0,)),
    ]


def test_a_comparison_is_described_by_its_worst_element():
    result = compare(torch.tensor([0.0, 1.0]), torch.zeros(2), Tolerance(1e-4, 1e-5))
    text = Mismatch("output[0]", "not within rtol", comparison=result, ranks=(1,)).describe()
    assert text.startswith("output[0]: max abs error 1.000e+00") and "worst at [1]" in text and text.endswith("[1])")


def test_error_lists_every_mismatch_and_the_plugins_that_ran():
    error = ConformanceError(
        [Mismatch("output[0]", "x", ranks=(0,)), Mismatch("buffer 'b'", "y", ranks=(1,))],
        " (tanh)",
        plugins=["p (d==1) for torch.tanh"],
    )
    assert isinstance(error, AssertionError) and len(error.mismatches) == 2
    assert str(error).splitlines() == [
        "sharded run does not match the single-process reference (tanh):",
        "  - output[0]: x (rank(s) [0])",
        "  - buffer 'b': y (rank(s) [1])",
        "  plugin handlers that ran: p (d==1) for torch.tanh",
    ]


def test_report_says_when_the_check_ran_under_autocast():
    report = ConformanceReport(max_abs_errors={"output[0]": 0.25}, autocast=("cpu", torch.bfloat16))
    assert str(report).startswith(
        "conformant under torch.autocast('cpu', dtype=torch.bfloat16) (worst abs error 2.50e-01"
    )
