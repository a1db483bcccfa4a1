"""Tests of the ``shardext`` command (physicsnemo_shardext.cli)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from physicsnemo_shardext.cli import main
from physicsnemo_shardext.testing.plugin_packages import write_plugin_distribution


def run_cli(*argv):
    out = io.StringIO()
    assert main(list(argv), out=out) == 0
    return out.getvalue()


def test_list_json_has_provenance_of_every_handler():
    data = json.loads(run_cli("list", "--json"))
    rows = {(r["target"], r["level"]): r for r in data["handlers"]}
    gelu = rows[("torch.nn.functional.gelu", "function")]
    assert gelu["provider"] == "pointwise"
    assert gelu["distribution"].startswith("physicsnemo-shardext==")
    assert gelu["handler"] == "physicsnemo_shardext.patches.pointwise.local_pointwise"
    assert gelu["priority"] == 0 and gelu["overrides_builtin"] is False
    conv = rows[("torch.nn.functional.conv2d", "function")]
    assert conv["provider"] == "physicsnemo" and conv["distribution"].startswith("nvidia-physicsnemo==2.2")
    assert rows[("aten.view.default", "dispatch")]["provider"] == "physicsnemo"
    assert any(p["plugin"] == "pointwise" and p["status"] == "loaded" for p in data["plugins"])


def test_list_table_and_plugin_filter():
    text = run_cli("list", "--plugin", "pointwise")
    header = text.splitlines()[0].split()
    assert header == ["TARGET", "LEVEL", "HANDLER", "PROVIDER", "DISTRIBUTION", "PRIORITY", "OVERRIDES"]
    assert "torch.nn.functional.silu" in text and "torch.nn.functional.conv2d" not in text


def test_doctor_reports_versions_backends_and_plugins():
    text = run_cli("doctor")
    for needle in ("torch", "nvidia-physicsnemo", "pluggy", "physicsnemo-shardext", "gloo", "nccl", "cuda", "loaded", "Conflicts"):
        assert needle in text
    data = json.loads(run_cli("doctor", "--json"))
    assert data["backends"]["gloo"] is True and "pointwise" in data["plugins"]["loaded"]


def test_console_script_shows_failed_plugin_and_conflict(tmp_path):
    plugin = """
import torch
from physicsnemo_shardext import hookimpl
def h(func, types, args, kwargs): ...
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cumsum, h, priority=3)
"""
    write_plugin_distribution(tmp_path, "left-dist", "1.0", {"left": "left_cli"}, {"left_cli": plugin})
    write_plugin_distribution(tmp_path, "right-dist", "1.0", {"right": "right_cli"}, {"right_cli": plugin})
    write_plugin_distribution(tmp_path, "oops-dist", "0.2", {"oops": "oops_cli"}, {"oops_cli": "import no_such_module_zz"})
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SHARDEXT_PREFER": "right"}
    script = Path(sys.executable).with_name("shardext")
    listing = subprocess.run([str(script), "list"], capture_output=True, text=True, env=env, timeout=300)
    assert listing.returncode == 0, listing.stderr
    assert "Plugins not installed" in listing.stdout and "oops-dist" in listing.stdout
    assert "No module named 'no_such_module_zz'" in listing.stdout
    doctor = subprocess.run(
        [sys.executable, "-m", "physicsnemo_shardext", "doctor"], capture_output=True, text=True, env=env, timeout=300
    )
    assert doctor.returncode == 0, doctor.stderr
    assert "torch.cumsum (priority 3): left, right -> resolved: right wins by SHARDEXT_PREFER" in doctor.stdout
    assert "oops (oops-dist==0.2)" in doctor.stdout
