"""``shardext verify`` end to end: match, gather, refusal, a wrong plugin (exit 1), bad input and a hang.

The runs start their own ranks (CPU, gloo) from a subprocess with a clean
environment, as a user's shell would; each costs about 20 s, mostly starting
the ranks. Checks of flags the parent refuses run in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from physicsnemo_shardext.tools import cli
from physicsnemo_shardext.tools.json_schemas import SCHEMAS, validate
from physicsnemo_shardext.tools.verify_command import UsageError, _bar_text, parse_mesh, parse_shape

SUPPORT = Path(__file__).parents[1] / "verify_support"
MODELS = SUPPORT / "models.py"
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDEXT_", "TORCHELASTIC_", "PYTEST_")) and k not in LAUNCHER
    }


def verify(tmp_path: Path, factory: str, *flags: str, timeout: float = 300) -> tuple[int, str, str, dict | None]:
    """Run the console command; returns (exit status, stdout, stderr, the JSON report or None)."""
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "physicsnemo_shardext",
        "verify",
        f"{MODELS}:{factory}",
        *flags,
        "--json",
        str(report),
        "--no-progress",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=tmp_path)
    data = json.loads(report.read_text()) if report.exists() else None
    return result.returncode, result.stdout, result.stderr, data


def test_fno_matches_op_by_op_with_every_gradient(tmp_path):
    html = tmp_path / "report.html"
    status, out, err, report = verify(
        tmp_path, "fno", "--input", "1x3x32x32", "--shard", "2", "--ranks", "2", "--html", str(html)
    )
    assert status == 0, out + err
    assert report["schema"] == "physicsnemo-shardext/verify" and report["schema_version"] == 1
    assert validate(report, SCHEMAS["verify"]) == []
    assert report["status"] == "match" and report["split"]["sizes"] == {"0": [20, 12]}
    ops = {op["op"] for op in report["ops"]}
    assert {"torch.nn.functional.conv2d", "torch.fft.rfft2", "torch.fft.irfft2", "torch.einsum"} <= ops
    assert all(op["provider_kind"] in ("plugin", "physicsnemo") for op in report["ops"] if op["output"] != "scalar")
    assert report["totals"]["activation_gathers"] == 0
    fft = next(op for op in report["ops"] if op["op"] == "torch.fft.rfft2")
    assert fft["forward"]["collectives"] == [2, 2] and min(fft["backward"]["bytes"]) > 0  # transposes, both ways
    compared = {row["tensor"] for row in report["comparison"]}
    parameters = {f"grad {name}" for name, _ in _support_models().fno().named_parameters()}
    assert compared == {"loss", "output", "grad input"} | parameters  # every gradient, not only the loss
    assert all(row["ok"] and row["relative_error"] < 1e-5 for row in report["comparison"])
    assert "MATCH:" in out and "grad input" in out
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<table>" in page and 'class="bar fwd"' in page
    assert "<script" not in page and "http" not in page  # self-contained


def _support_models():
    import importlib.util

    spec = importlib.util.spec_from_file_location("verify_support_models", MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_unpatched_op_that_gathers_is_flagged_with_what_to_do(tmp_path):
    status, out, err, report = verify(tmp_path, "gathering", "--input", "1x2x16x8")
    assert status == 0, out + err  # correct, through an all-gather of the whole activation
    median = next(op for op in report["ops"] if op["op"] == "torch.median")
    assert median["provider_kind"] == "dtensor" and median["handler"] == "DTensor fallback"
    assert median["activation_gathers"] >= 1 and median["site"]["line"] > 0
    assert "median" in median["site"]["code"]
    conv = next(op for op in report["ops"] if op["op"] == "torch.nn.functional.conv2d")
    assert conv["provider_kind"] == "plugin" and conv["activation_gathers"] == 0 and conv["stayed_sharded"]
    assert any("shardext new" in step for step in report["next_steps"])
    assert "GATHER" in out and "shardext new" in out


def test_a_refused_configuration_exits_2_naming_op_configuration_and_source_line(tmp_path):
    status, out, err, report = verify(tmp_path, "gelu_model", "--input", "1x2x8x8", "--shard", "1", "--split", "even")
    assert status == 2, out + err
    error = report["error"]
    assert report["status"] == "unsupported" and error["type"] == "MissingShardPatch"
    assert error["op"] == "torch.nn.functional.conv2d" and "Shard(1)" in error["configuration"]
    assert error["site"]["file"].endswith("models.py") and "self.conv(x)" in error["site"]["code"]
    assert "channel" in error["message"]
    assert "first error: MissingShardPatch in torch.nn.functional.conv2d" in out and "self.conv(x)" in out


def test_a_deliberately_wrong_plugin_makes_it_exit_1(tmp_path):
    status, out, err, report = verify(
        tmp_path, "gelu_model", "--input", "1x2x12x6", "--plugin", str(SUPPORT / "wrong_plugin.py")
    )
    assert status == 1, out + err
    assert report["status"] == "mismatch"
    gelu = next(op for op in report["ops"] if op["op"] == "torch.nn.functional.gelu")
    assert gelu["provider"].startswith("wrong-plugin")
    assert not report["comparison"][0]["ok"] and report["comparison"][0]["relative_error"] > 0.1
    assert {"output", "grad conv.weight"} <= {row["tensor"] for row in report["comparison"] if not row["ok"]}
    assert "MISMATCH" in out and "wrong-plugin" in out


def test_a_2d_mesh_and_a_factory_that_returns_its_inputs(tmp_path):
    status, out, err, report = verify(
        tmp_path,
        "model_and_inputs",
        "--shard",
        "2",
        "--shard",
        "3",
        "--ranks",
        "2",
        "--mesh",
        "2x1",
        "--split",
        "7,5/6",
    )
    assert status == 0, out + err
    assert report["split"] == {"placements": ["Shard(2)", "Shard(3)"], "sizes": {"0": [7, 5], "1": [6]}}


def test_a_hanging_rank_ends_with_a_stack_report_within_the_timeout(tmp_path):
    status, out, err, report = verify(tmp_path, "hanging", "--input", "1x2x8x8", "--timeout", "20", timeout=240)
    assert status == 3 and report is None
    assert "hung" in err and "rank 1" in err and "forward" in err  # where rank 1 waits


def test_a_factory_that_raises_is_bad_input(tmp_path):
    status, out, err, report = verify(tmp_path, "broken", "--input", "1x2x8x8")
    assert status == 3 and report["status"] == "bad-input"
    assert "checkpoint file missing" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["nowhere_module_xyz:make", "--input", "1x2x8x8"], "cannot import 'nowhere_module_xyz'"),
        ([f"{MODELS}:no_such_factory", "--input", "1x2x8x8"], "has no callable 'no_such_factory'"),
        ([f"{MODELS}:gelu_model", "--input", "1x2x3x8", "--ranks", "4"], "more ranks than rows"),
        ([f"{MODELS}:gelu_model", "--input", "1x2x8x8", "--shard", "5"], "--shard 5: the input"),
        ([f"{MODELS}:gelu_model", "--input", "1x2x8x8", "--mesh", "2x2"], "has 4 ranks but --ranks is 2"),
        ([f"{MODELS}:gelu_model", "--input", "1x2x8x8", "--split", "3,4"], "summing to 8"),
        ([f"{MODELS}:gelu_model", "--input", "1xtwo"], "expected sizes joined by x"),
    ],
    ids=["unimportable", "no-factory", "ranks>rows", "bad-dim", "bad-mesh", "bad-split", "bad-shape"],
)
def test_bad_input_is_refused_before_any_rank_starts(flags, message, capsys):
    status = cli.main(["verify", *flags])
    assert status == 3
    assert message in capsys.readouterr().err


def test_a_wrong_input_shape_for_the_model_is_bad_input_with_the_reason(tmp_path):
    status, out, err, report = verify(tmp_path, "gelu_model", "--input", "1x5x8x8")
    assert status == 3 and "fails single-process on input shape(s) [[1, 5, 8, 8]]" in report["error"]["message"]


def test_parsers_and_progress_text():
    assert parse_shape("1x3x256x256") == (1, 3, 256, 256)
    assert parse_mesh(None, 4) == (4,) and parse_mesh(None, 4, dims=2) == (2, 2)
    with pytest.raises(UsageError, match="give --mesh"):
        parse_mesh(None, 3, dims=2)
    assert _bar_text("sharded forward", 3, 12) == "sharded forward [#####---------------] 3/12 ops"
    assert _bar_text("comparing", 0, 12) == "comparing"


def test_under_torchrun_every_rank_runs_inline_and_rank_0_reports(tmp_path):
    report_path = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "physicsnemo_shardext",
        "verify",
        f"{MODELS}:gelu_model",
        "--input",
        "1x2x12x6",
        "--ranks",
        "2",
        "--json",
        str(report_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["status"] == "match" and report["ranks"] == 2
    assert result.stdout.count("MATCH:") == 1  # rank 0 prints, the other rank stays quiet


def test_rtol_and_atol_flags_set_the_tolerance_and_the_text_states_both():
    import argparse

    from verify_support.records import rank_record

    from physicsnemo_shardext.comparison import Tolerance
    from physicsnemo_shardext.tools.model_check import build_report
    from physicsnemo_shardext.tools.verify_command import add_arguments, config_from_args, render_text

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["m:f", "--rtol", "1e-3", "--atol", "1e-6"]), None)
    assert config.tolerance == Tolerance(1e-3, 1e-6)
    assert config_from_args(parser.parse_args(["m:f", "--dtype", "float64"]), None).tolerance == Tolerance.for_dtype(
        "float64"
    )
    text = render_text(build_report(config, [rank_record(), rank_record()]))
    assert "|a - r| <= atol + rtol*|r| per element, rtol 1e-03, atol 1e-06" in text
