"""The rank-side pieces of `shardext verify` that need no ranks: splits, factories, the report's statuses."""

from __future__ import annotations

import pytest

from verify_support.records import rank_record as _rank

from physicsnemo_shardext.model_check import (
    EXIT_CODES, REPORT_VERSION, BadInput, VerifyConfig, build_report, load_factory, load_plugin_object, split_sizes,
)


@pytest.mark.parametrize(
    ("length", "parts", "split", "sizes"),
    [(17, 2, "even", [9, 8]), (8, 4, "even", [2, 2, 2, 2]), (6, 4, "even", [2, 2, 1, 1]),
     (17, 2, "uneven", [11, 6]), (64, 4, "uneven", [20, 16, 16, 12]), (5, 2, "2,3", [2, 3]), (5, 2, "0,5", [0, 5])],
)
def test_split_sizes(length, parts, split, sizes):
    assert split_sizes(length, parts, split) == sizes and sum(sizes) == length


@pytest.mark.parametrize(
    ("length", "parts", "split", "message"),
    [(3, 4, "even", "more ranks than rows"), (2, 2, "uneven", "too few for an uneven split"),
     (5, 2, "2,2", "summing to 5"), (5, 2, "a,b", "comma-separated sizes")],
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
    plugin, name = load_plugin_object("patches.pointwise")
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
    error = {"type": "MissingShardPatch", "unsupported": True, "message": "no", "op": "torch.tanh",
             "configuration": "", "site": None}
    refused = build_report(config, [_rank(error=error), _rank(error=error)])
    assert refused["status"] == "unsupported" and refused["exit_code"] == EXIT_CODES["unsupported"] == 2
    assert "first error: MissingShardPatch in torch.tanh" in refused["summary"]
