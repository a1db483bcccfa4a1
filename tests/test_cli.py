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
    assert gelu["priority"] == 0 and gelu["overrides_builtin"] is False and gelu["replaced"] is None
    conv = rows[("torch.nn.functional.conv2d", "function")]  # first-party override of a built-in
    assert conv["provider"] == "convolution" and conv["overrides_builtin"] is True
    assert conv["replaced"].startswith("physicsnemo.domain_parallel.shard_utils.conv_patches.")
    unbind = rows[("torch.unbind", "function")]
    assert unbind["provider"] == "physicsnemo" and unbind["distribution"].startswith("nvidia-physicsnemo==2.2")
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
    patches.function(torch.cumprod, h, priority=3)
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
    assert "torch.cumprod (priority 3): left, right -> resolved: right wins by SHARDEXT_PREFER" in doctor.stdout
    assert "oops (oops-dist==0.2)" in doctor.stdout


def test_override_shows_what_it_replaced(pristine_registries):
    import torch.nn.functional as F

    import physicsnemo_shardext
    from physicsnemo_shardext import PatchSet, ShardextWarning
    from physicsnemo_shardext.provenance import PluginInfo

    def better_interpolate(func, types, args, kwargs):
        return physicsnemo_shardext.builtin_handler(F.interpolate)(func, types, args, kwargs)

    patches = PatchSet("interp-override")
    patches.function(F.interpolate, better_interpolate, override=True, priority=2)
    registry = physicsnemo_shardext.get_registry()
    with registry.sandbox():
        import pytest

        with pytest.warns(ShardextWarning):
            registry.add_plugin(PluginInfo("interp-override", "interp-dist", "0.3"), list(patches))
        rows = {r["target"]: r for r in json.loads(run_cli("list", "--json"))["handlers"]}
        row = rows["torch.nn.functional.interpolate"]
        assert row["provider"] == "interp-override" and row["distribution"] == "interp-dist==0.3"
        assert row["overrides_builtin"] is True and row["priority"] == 2
        assert row["replaced"].endswith("unpooling_patches.generic_interpolate_wrapper")
        assert "yes" in run_cli("list", "--plugin", "interp-override")
    assert physicsnemo_shardext.get_registry().provenance(F.interpolate) is None


def test_attribute_replacement_is_listed_with_its_reason(pristine_registries):
    import physicsnemo_shardext
    from physicsnemo_shardext import PatchSet
    from physicsnemo_shardext.provenance import PluginInfo

    class Owner:
        value = 1

    patches = PatchSet("attr-fix")
    patches.replace_attribute(Owner, "value", 2, reason="one is wrong here")
    registry = physicsnemo_shardext.get_registry()
    with registry.sandbox():
        registry.add_plugin(PluginInfo("attr-fix", "attr-dist", "0.1"), list(patches))
        rows = [r for r in json.loads(run_cli("list", "--json"))["handlers"] if r["provider"] == "attr-fix"]
        assert len(rows) == 1 and rows[0]["level"] == "attribute" and rows[0]["description"] == "one is wrong here"
        assert rows[0]["target"].endswith("Owner.value")
        assert "attribute" in run_cli("list", "--plugin", "attr-fix")
    assert Owner.value == 1
