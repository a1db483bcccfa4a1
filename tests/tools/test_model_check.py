"""The rank-side pieces of `shardext verify` that need no ranks: splits, factories, the report's statuses."""

from __future__ import annotations

import pytest
from verify_support.records import rank_record as _rank

from physicsnemo_shardext.tools.model_check import (
    EXIT_CODES,
    REPORT_VERSION,
    BadInput,
    VerifyConfig,
    build_report,
    load_factory,
    load_plugin_object,
    split_sizes,
)


@pytest.mark.parametrize(
    ("length", "parts", "split", "sizes"),
    [
        (17, 2, "even", [9, 8]),
        (8, 4, "even", [2, 2, 2, 2]),
        (6, 4, "even", [2, 2, 1, 1]),
        (17, 2, "uneven", [11, 6]),
        (64, 4, "uneven", [20, 16, 16, 12]),
        (5, 2, "2,3", [2, 3]),
        (5, 2, "0,5", [0, 5]),
    ],
)
def test_split_sizes(length, parts, split, sizes):
    assert split_sizes(length, parts, split) == sizes and sum(sizes) == length


@pytest.mark.parametrize(
    ("length", "parts", "split", "message"),
    [
        (3, 4, "even", "more ranks than rows"),
        (2, 2, "uneven", "too few for an uneven split"),
        (5, 2, "2,2", "summing to 5"),
        (5, 2, "a,b", "comma-separated sizes"),
    ],
)
def test_split_sizes_refuses_with_the_reason(length, parts, split, message):
    with pytest.raises(BadInput, match=message):
        split_sizes(length, parts, split)


def test_factories_and_plugins_load_or_say_why(tmp_path):
    assert load_factory("torch.nn:Identity").__name__ == "Identity"
    with pytest.raises(BadInput, match="expected MODULE:FUNCTION"):
        load_factory("just_a_module")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no physicsnemo here')\n")
    with pytest.raises(BadInput, match="no physicsnemo here"):
        load_factory(f"{broken}:make")
    plugin, name = load_plugin_object("physicsnemo_shardext.patches.pointwise")
    assert name == "pointwise" and hasattr(plugin, "shardext_declare_patches")
    with pytest.raises(BadInput, match="cannot import"):
        load_plugin_object("no_such_plugin_module_xyz")


def test_report_statuses_and_exit_codes():
    config = VerifyConfig("m:f", (1, 2, 9, 4))
    match = build_report(config, [_rank(), _rank()])
    assert (match["status"], match["exit_code"], match["schema_version"]) == ("match", 0, REPORT_VERSION)
    assert match["ops"][0]["backward"] == {"collectives": [1, 1], "bytes": [8, 8]}  # per rank
    mismatch = build_report(config, [_rank(), _rank(rel=0.5)])
    assert mismatch["status"] == "mismatch" and mismatch["comparison"][0]["relative_error"] == 0.5
    assert any("SHARDEXT_DISABLE" in step for step in mismatch["next_steps"])
    error = {
        "type": "MissingShardPatch",
        "unsupported": True,
        "message": "no",
        "op": "torch.tanh",
        "configuration": "",
        "site": None,
    }
    refused = build_report(config, [_rank(error=error), _rank(error=error)])
    assert refused["status"] == "unsupported" and refused["exit_code"] == EXIT_CODES["unsupported"] == 2
    assert "first error: MissingShardPatch in torch.tanh" in refused["summary"]


def _runs(reference_grad, sharded_grad):
    """The reference and sharded records `_compare` reads, for a Linear whose weight gradients are given."""
    import copy

    import torch

    reference_model = torch.nn.Linear(4, 3)
    sharded_model = copy.deepcopy(reference_model)
    for model, grad in ((reference_model, reference_grad), (sharded_model, sharded_grad)):
        model.weight.grad, model.bias.grad = grad, torch.ones(3)
    x, out = torch.ones(2, 4), torch.ones(2, 3)
    run = {"loss": torch.tensor(1.0), "output": out, "inputs": [x]}
    return {**run, "model": reference_model}, {**run, "model": sharded_model}


def test_a_zero_initialised_gradient_a_hair_off_zero_matches_with_a_small_relative_error():
    import torch

    from physicsnemo_shardext.tools.model_check import _compare

    # issue 29: 1e-8 against an exactly zero (or 1e-14) reference was reported as relative error 3.8e5
    for reference in (torch.zeros(3, 4), torch.full((3, 4), 2.6e-14)):
        rows = _compare(VerifyConfig("m:f"), *_runs(reference, reference + 1e-8))
        row = next(r for r in rows if r["tensor"] == "grad weight")
        assert row["ok"] and row["relative_error"] < 1e-2 and row["max_abs_error"] == pytest.approx(1e-8)
        assert "(atol 1e-05)" in row["description"] and "e+05" not in row["description"]
    report = build_report(VerifyConfig("m:f"), [{**_rank(), "comparison": rows}])
    assert report["status"] == "match" and (report["rtol"], report["atol"]) == (1e-4, 1e-5)
    assert "atol + rtol * |r|" in report["rule"]


def test_a_gradient_outside_the_tolerance_names_its_worst_element():
    import torch

    from physicsnemo_shardext.tools.model_check import _compare

    wrong = torch.zeros(3, 4)
    wrong[2, 1] = 0.5
    rows = _compare(VerifyConfig("m:f"), *_runs(torch.zeros(3, 4), wrong))
    assert rows[0]["tensor"] == "grad weight" and not rows[0]["ok"]  # mismatches first
    assert rows[0]["worst_index"] == [2, 1] and rows[0]["elements_outside"] == 1
    assert "1 of 12 elements outside" in rows[0]["detail"] and "worst at [2, 1]" in rows[0]["detail"]


def test_tolerances_default_by_dtype_and_follow_the_flags():
    from physicsnemo_shardext.comparison import Tolerance

    assert VerifyConfig("m:f").tolerance == Tolerance.for_dtype("float32")
    assert VerifyConfig("m:f", dtype="float64").tolerance == Tolerance.for_dtype("float64")
    assert VerifyConfig("m:f", rtol=1e-3, atol=0.0).tolerance == Tolerance(1e-3, 0.0)
