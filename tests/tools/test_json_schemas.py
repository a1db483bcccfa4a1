"""The published JSON Schemas match what the commands print, and `shardext schema` needs no torch."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from verify_support.records import rank_record

from physicsnemo_shardext.tools import cli
from physicsnemo_shardext.tools.json_schemas import SCHEMAS, validate
from physicsnemo_shardext.tools.model_check import VerifyConfig, build_report


@pytest.mark.parametrize("command", ["list", "doctor"])
def test_real_outputs_conform(command):
    out = io.StringIO()
    assert cli.main([command, "--json"], out=out) == 0
    assert validate(json.loads(out.getvalue()), SCHEMAS[command]) == []


def test_verify_reports_conform_for_every_status():
    config = VerifyConfig("m:f", (1, 2, 9, 4))
    error = {
        "type": "MissingShardPatch",
        "unsupported": True,
        "message": "no",
        "op": "torch.tanh",
        "configuration": "",
        "site": None,
    }
    reports = [
        build_report(config, [rank_record(), rank_record(rel=0.5)]),
        build_report(config, [rank_record(error=error)] * 2),
        build_report(config, [{"rank": 0, "bad_input": "no such file"}]),
    ]
    assert [r["status"] for r in reports] == ["mismatch", "unsupported", "bad-input"]
    for report in reports:
        assert validate(json.loads(json.dumps(report)), SCHEMAS["verify"]) == []


def test_the_validator_finds_what_is_wrong():
    problems = validate(
        {"schema_version": 3, "handlers": [{"target": 1}], "plugins": [], "errors": []}, SCHEMAS["list"]
    )
    assert "$.handlers[0].target: int is not string" in problems
    assert "$.handlers[0]: missing 'level'" in problems


def test_schema_command_prints_json_without_importing_torch():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "physicsnemo_shardext_cli", "schema", "verify"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["title"].startswith("shardext verify --json")
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "torch" not in imported and "physicsnemo" not in imported
