"""Building and comparing the two runs of a conformance check (testing/conformance_runs.py).

The comparison test moved from test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing.conformance_runs import (
    ShardSpec,
    _cotangent_for,
    _expected_placements_for,
    _reference_inputs,
    _specs_for,
)


def test_shard_spec_accepts_the_old_name_of_its_sizes():
    assert ShardSpec(None, [Shard(0)], split_sizes=[3, 2]).sizes_by_mesh_dim == [3, 2]
    with pytest.raises(TypeError, match="not both"):
        ShardSpec(None, [Shard(0)], [3, 2], split_sizes=[3, 2])


def test_one_spec_covers_every_tensor_input_and_a_list_must_match_the_inputs():
    spec = ShardSpec(None, [Shard(0)])
    assert _specs_for([torch.ones(2), 3, torch.ones(2)], spec) == [spec, None, spec]
    with pytest.raises(ValueError, match="2 inputs but 1 shardings"):
        _specs_for([torch.ones(2), torch.ones(2)], [spec])


def test_reference_inputs_are_detached_copies_and_only_floats_need_grad():
    x, i = torch.ones(3, requires_grad=True) * 2, torch.arange(3)
    rx, ri, other = _reference_inputs([x, i, "keep"])
    assert rx.requires_grad and rx.grad_fn is None and torch.equal(rx, x)
    assert not ri.requires_grad and other == "keep"


def test_plain_cotangents_are_seeded_and_drawn_in_float32_for_reduced_dtypes():
    out = torch.zeros(4, 3)
    assert torch.equal(_cotangent_for(out, out.shape, 7), _cotangent_for(out, out.shape, 7))
    assert not torch.equal(_cotangent_for(out, out.shape, 7), _cotangent_for(out, out.shape, 8))
    low = _cotangent_for(out.bfloat16(), out.shape, 7)
    assert low.dtype == torch.bfloat16 and torch.equal(low, _cotangent_for(out, out.shape, 7).bfloat16())


def test_expected_placements_read_every_form():
    default = (Shard(1),)
    assert _expected_placements_for(0, None, default) is False
    assert _expected_placements_for(0, "input", default) == default
    assert _expected_placements_for(1, [[Shard(0)], None], default) is None
    assert _expected_placements_for(0, [Shard(2)], default) == (Shard(2),)


def test_comparisons_use_the_one_rule_near_zero_and_name_the_worst_element():
    from physicsnemo_shardext.testing.conformance import ConformanceReport, _compare, _merge

    report, mismatches = ConformanceReport(), []
    # A zero-initialised layer's gradient, 1e-8 off its exactly zero reference: within atol, no mismatch.
    _compare(
        "gradient of parameter 'q'",
        torch.full((4, 4), 1e-8),
        torch.zeros(4, 4),
        1e-4,
        1e-5,
        mismatches,
        report.max_abs_errors,
        results=report.comparisons,
    )
    assert not mismatches and report.max_abs_errors["gradient of parameter 'q'"] == pytest.approx(1e-8)
    assert report.comparisons["gradient of parameter 'q'"].max_rel_error < 1e-2
    wrong = torch.zeros(4, 4)
    wrong[3, 0] = 1.0
    _compare("output[0]", wrong, torch.zeros(4, 4), 1e-4, 1e-5, mismatches, report.max_abs_errors)
    (mismatch,) = _merge([mismatches, mismatches])  # the same on both ranks: one entry
    assert mismatch.ranks == (0, 1) and mismatch.comparison is not None
    text = mismatch.describe()
    assert text.startswith("output[0]: max abs error 1.000e+00, max rel error") and "worst at [3, 0]" in text
    assert "(1 of 16 elements outside); not within rtol=0.0001, atol=1e-05" in text
