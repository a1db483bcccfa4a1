"""Tests of the ``shardext`` command (physicsnemo_shardext.tools.cli)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from physicsnemo_shardext.testing.plugin_packages import write_plugin_distribution
from physicsnemo_shardext.tools.cli import main


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
    unsqueeze = rows[("torch.unsqueeze", "function")]
    assert unsqueeze["provider"] == "physicsnemo" and unsqueeze["distribution"].startswith("nvidia-physicsnemo==2.2")
    assert rows[("aten.view.default", "dispatch")]["provider"] == "physicsnemo"
    assert any(p["plugin"] == "pointwise" and p["status"] == "loaded" for p in data["plugins"])


def test_list_table_and_plugin_filter():
    text = run_cli("list", "--plugin", "pointwise")
    header = text.splitlines()[0].split()
    assert header == ["TARGET", "LEVEL", "HANDLER", "PROVIDER", "DISTRIBUTION", "PRIORITY", "OVERRIDES", "RECORDED"]
    assert "torch.nn.functional.silu" in text and "torch.nn.functional.conv2d" not in text


def test_doctor_reports_versions_backends_and_plugins():
    text = run_cli("doctor")
    for needle in (
        "torch",
        "nvidia-physicsnemo",
        "pluggy",
        "physicsnemo-shardext",
        "gloo",
        "nccl",
        "cuda",
        "loaded",
        "Conflicts",
    ):
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
    write_plugin_distribution(
        tmp_path, "oops-dist", "0.2", {"oops": "oops_cli"}, {"oops_cli": "import no_such_module_zz"}
    )
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
    from physicsnemo_shardext.engine.provenance import PluginInfo

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
    from physicsnemo_shardext.engine.provenance import PluginInfo

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


# -- live handlers and drift ------------------------------------------------------------------
def _rows(*argv):
    data = json.loads(run_cli("list", "--json", *argv))
    assert data["schema_version"] == 3 and data["errors"] == []
    return {(r["target"], r["level"]): r for r in data["handlers"]}


def test_list_shows_live_handler_next_to_recorded_one():
    gelu = _rows()[("torch.nn.functional.gelu", "function")]
    assert gelu["handler"] == gelu["recorded_handler"] == "physicsnemo_shardext.patches.pointwise.local_pointwise"
    assert gelu["drift"] is False and gelu["drift_reason"] is None
    assert run_cli("list", "--plugin", "pointwise").splitlines()[1].split()[-1] == "same"


def test_trace_wrappers_are_not_drift(registry_snapshot):
    import physicsnemo_shardext

    registry = physicsnemo_shardext.get_registry()
    registry.set_trace(True)
    try:
        gelu = _rows()[("torch.nn.functional.gelu", "function")]
    finally:
        registry.set_trace(False)
    assert gelu["handler"].endswith("local_pointwise") and gelu["drift"] is False


def _overwrite(func, types, args, kwargs):
    """A handler written straight into ShardTensor's registry, bypassing the framework."""


def test_direct_registry_write_over_a_plugin_slot_is_flagged(registry_snapshot):
    import torch.nn.functional as F
    from physicsnemo.domain_parallel import ShardTensor

    ShardTensor._function_registry[F.gelu] = _overwrite
    gelu = _rows()[("torch.nn.functional.gelu", "function")]
    assert gelu["provider"] == "pointwise"  # provenance still names the plugin ...
    assert gelu["handler"] == f"{__name__}._overwrite"  # ... but this is what ShardTensor calls
    assert gelu["recorded_handler"].endswith("local_pointwise")
    assert gelu["drift"] is True and "outside the framework" in gelu["drift_reason"]
    text = run_cli("list", "--plugin", "pointwise")
    assert "DRIFT (recorded: physicsnemo_shardext.patches.pointwise.local_pointwise)" in text
    assert "Handlers ShardTensor calls that are not the recorded ones:" in text
    doctor = json.loads(run_cli("doctor", "--json"))
    assert [(d["target"], d["handler"]) for d in doctor["drift"]] == [
        ("torch.nn.functional.gelu", f"{__name__}._overwrite")
    ]
    assert "DRIFT function torch.nn.functional.gelu: ShardTensor calls" in run_cli("doctor")


def test_removed_plugin_slot_and_unrecorded_write_are_flagged(registry_snapshot):
    import torch
    import torch.nn.functional as F
    from physicsnemo.domain_parallel import ShardTensor

    del ShardTensor._function_registry[F.gelu]
    ShardTensor._function_registry[torch.cumprod] = _overwrite  # no plugin, no built-in
    rows = _rows()
    gelu, cumprod = rows[("torch.nn.functional.gelu", "function")], rows[("torch.cumprod", "function")]
    assert gelu["handler"] is None and gelu["drift"] is True and "removed" in gelu["drift_reason"]
    assert cumprod["provider"] == "external" and cumprod["recorded_handler"] is None
    assert cumprod["drift"] is True and "outside the framework" in cumprod["drift_reason"]


def test_replaced_builtin_is_flagged(registry_snapshot):
    import torch
    from physicsnemo.domain_parallel import ShardTensor

    ShardTensor._function_registry[torch.unsqueeze] = _overwrite
    unsqueeze = _rows()[("torch.unsqueeze", "function")]
    assert unsqueeze["recorded_handler"].startswith("physicsnemo.") and unsqueeze["drift"] is True
    assert "built-in" in unsqueeze["drift_reason"] and "outside the framework" in unsqueeze["drift_reason"]


# -- plugins never kill the command -------------------------------------------------------------
def test_anything_raised_while_inspecting_is_reported(monkeypatch):
    import sys as _sys

    from physicsnemo_shardext.tools import inventory

    monkeypatch.setattr(inventory, "handler_rows", lambda *args: _sys.exit(4))
    out = io.StringIO()
    assert main(["list", "--json"], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["handlers"] == [] and data["plugins"]  # the rest of the report is still there
    assert data["errors"] == ["reading ShardTensor's registries: SystemExit: 4"]
    assert "reading ShardTensor's registries: SystemExit: 4" in run_cli("list")

    monkeypatch.setattr(inventory, "doctor_report", lambda *args: (_ for _ in ()).throw(GeneratorExit("gone")))
    assert "building the report: GeneratorExit: gone" in run_cli("doctor")
    assert json.loads(run_cli("doctor", "--json"))["errors"] == ["building the report: GeneratorExit: gone"]


def test_a_real_ctrl_c_still_interrupts(monkeypatch):
    import pytest

    from physicsnemo_shardext.tools import inventory

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(inventory, "handler_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["list"], out=io.StringIO())


def test_import_time_load_errors_reach_the_report(monkeypatch, capfd):
    from physicsnemo_shardext.tools import cli

    monkeypatch.setattr(cli, "_EARLY_ERRORS", [])

    def chatty_failing_load():
        print("plugin says hi")
        os.write(1, b"raw plugin bytes\n")
        raise SystemExit(3)

    cli.autoload_for_cli(chatty_failing_load)
    captured = capfd.readouterr()
    assert captured.out == "" and "plugin says hi" in captured.err and "raw plugin bytes" in captured.err
    data = json.loads(run_cli("list", "--json"))
    assert data["errors"] == ["loading plugins: SystemExit: 3"]


def _console(argv, folder, **env):
    script = Path(sys.executable).with_name("shardext")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDEXT_")}
    full_env.update(PYTHONPATH=str(folder), **env)
    return subprocess.run([str(script), *argv], capture_output=True, text=True, env=full_env, timeout=300)


CHATTY = """
import os, sys
print("chatty: hello at import")
os.write(1, b"chatty: raw bytes at import\\n")
from physicsnemo_shardext import hookimpl
@hookimpl
def shardext_declare_patches(patches):
    print("chatty: hello from the hook")
"""


def test_printing_plugin_keeps_list_json_parseable(tmp_path):
    write_plugin_distribution(tmp_path, "chatty-dist", "1.0", {"chatty": "chatty_cli"}, {"chatty_cli": CHATTY})
    for argv in (["list", "--json"], ["doctor", "--json"]):
        result = _console(argv, tmp_path)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["schema_version"] == 3
        assert "chatty: hello at import" in result.stderr and "chatty: raw bytes at import" in result.stderr
        assert "chatty: hello from the hook" in result.stderr
    assert any(p["plugin"] == "chatty" and p["status"] == "loaded" for p in json.loads(result.stdout)["plugin_details"])


def test_plugin_calling_sys_exit_at_import_does_not_kill_list_or_doctor(tmp_path):
    exits = "import sys\nprint('exiting')\nsys.exit(3)\n"
    write_plugin_distribution(tmp_path, "exiter-dist", "0.1", {"exiter": "exiter_cli"}, {"exiter_cli": exits})
    listing = _console(["list"], tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "exiter-dist" in listing.stdout and "SystemExit: 3" in listing.stdout
    doctor = _console(["doctor"], tmp_path)
    assert doctor.returncode == 0, doctor.stderr
    assert "exiter (exiter-dist==0.1)" in doctor.stdout and "SystemExit" in doctor.stdout
    data = json.loads(_console(["doctor", "--json"], tmp_path).stdout.split("exiting\n")[-1])
    assert "exiter" in data["plugins"]["failed"]


def test_importing_the_package_never_reads_the_command_line():
    # A program whose argv looks like `shardext new --help` imports the package like any other.
    probe = "import sys\nsys.argv = ['shardext', 'new', '--help']\nimport physicsnemo_shardext\nprint('imported')\n"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("imported") and "usage:" not in result.stdout


TIED = """
import torch
from physicsnemo_shardext import hookimpl
def h(func, types, args, kwargs): ...
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cummax, h, priority=2)
"""


def test_strict_tie_is_a_patch_conflict_error_and_list_and_doctor_still_exit_0(tmp_path):
    write_plugin_distribution(tmp_path, "left-dist", "1.0", {"left": "left_tie"}, {"left_tie": TIED})
    write_plugin_distribution(tmp_path, "right-dist", "1.0", {"right": "right_tie"}, {"right_tie": TIED})
    for argv in (["list"], ["doctor"]):
        result = _console(argv, tmp_path, SHARDEXT_STRICT="1")
        assert result.returncode == 0, result.stderr  # docs/reference/cli.md: problems are in the report
        assert "loading plugins: PatchConflictError: conflict on function-level target torch.cummax" in result.stdout
        assert "PluginLoadError" not in result.stdout.split("Errors while loading")[-1]


def test_list_shows_an_unresolved_tie_and_both_claimants(pristine_registries):
    import pytest
    import torch
    import torch.nn.functional as F

    import physicsnemo_shardext
    from physicsnemo_shardext import PatchSet, ShardextWarning
    from physicsnemo_shardext.engine.provenance import PluginInfo

    def h(func, types, args, kwargs): ...

    registry = physicsnemo_shardext.get_registry()
    with registry.sandbox():
        for name in ("left", "right"):
            patches = PatchSet(name)
            patches.function(torch.cummax, h, priority=2)  # no built-in: nothing is called there
            patches.function(F.interpolate, h, priority=2, override=True)  # a built-in stays in place
            with pytest.warns(ShardextWarning):
                registry.add_plugin(PluginInfo(name, f"{name}-dist", "1.0"), list(patches))
        data = json.loads(run_cli("list", "--json"))
        assert data["schema_version"] == 3
        rows = {(r["target"], r["level"]): r for r in data["handlers"]}
        cummax = rows[("torch.cummax", "function")]
        assert cummax["status"] == "unresolved" and cummax["claimants"] == ["left", "right"]
        assert cummax["handler"] is None and cummax["provider"] is None and cummax["priority"] == 2
        interp = rows[("torch.nn.functional.interpolate", "function")]
        assert interp["status"] == "unresolved" and interp["claimants"] == ["left", "right"]
        assert interp["provider"] == "physicsnemo" and interp["handler"].endswith("generic_interpolate_wrapper")
        others = [key for key, row in rows.items() if row["claimants"]]
        assert sorted(others) == [("torch.cummax", "function"), ("torch.nn.functional.interpolate", "function")]
        text = run_cli("list", "--plugin", "left")
        line = next(line for line in text.splitlines() if line.startswith("torch.cummax "))
        assert "UNRESOLVED" in line.split() and line.endswith("UNRESOLVED tie: left, right")
        tail = text.split("Unresolved conflicts:")[1]
        assert "torch.cummax" in tail and "left, right" in tail and "nothing (slow fallback)" in tail
        assert "generic_interpolate_wrapper" in tail
    assert registry.conflicts() == [] or all(c.target != "torch.cummax" for c in registry.conflicts())


def test_doctor_text_shows_plugin_versions():
    from physicsnemo_shardext.engine.requirements import installed_version

    text = run_cli("doctor")
    loaded = next(line for line in text.splitlines() if line.strip().startswith("loaded"))
    assert f"pointwise=={installed_version('physicsnemo-shardext')}" in loaded


def test_list_and_doctor_show_plugin_health_and_load_times(tmp_path, monkeypatch, fresh_registry):
    import warnings

    import physicsnemo_shardext
    from physicsnemo_shardext.engine.loader import PluginLoader
    from physicsnemo_shardext.settings import Settings
    from physicsnemo_shardext.testing.plugin_packages import entry_points_in
    from physicsnemo_shardext.tools.json_schemas import SCHEMAS, validate

    head = "import time, torch\nfrom physicsnemo_shardext import hookimpl\ndef h(func, types, args, kwargs): ...\n"
    plugins = {
        "forgetful": (
            "forgetful_cli_mod",
            head + "def shardext_declare_patches(patches):\n    patches.function(torch.cummin, h)\n",
        ),
        "sluggish": (
            "sluggish_cli_mod",
            head + "time.sleep(0.3)\n@hookimpl\ndef shardext_declare_patches(patches):\n"
            "    patches.function(torch.cummax, h)\n",
        ),
        "gated": ("gated_cli_mod", head + "@hookimpl\ndef shardext_declare_patches(patches):\n    return\n"),
    }
    for name, (module, source) in plugins.items():
        write_plugin_distribution(tmp_path, f"{name}-dist", "0.4", {name: module}, {module: source})
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PluginLoader(fresh_registry, Settings(slow_plugin_seconds=0.2)).load_entry_points(entry_points_in(tmp_path))
    monkeypatch.setattr(physicsnemo_shardext, "_registry", fresh_registry)
    monkeypatch.setenv("SHARDEXT_SLOW_PLUGIN_SECONDS", "0.2")

    listing = run_cli("list").split("Plugin health")[1]
    health = {line.split()[0]: line for line in listing.splitlines()[2:] if line.strip()}
    assert "PROBLEM: shardext_declare_patches() is named like the shardext_declare_patches hook" in health["forgetful"]
    assert "forgetful-dist" in health["forgetful"] and "0.4" in health["forgetful"]
    assert "slow: 0.3" in health["sluggish"] and "PROBLEM" not in health["sluggish"]
    assert "note: declared no patches on this setup" in health["gated"] and "PROBLEM" not in health["gated"]

    doctor = run_cli("doctor")
    assert "forgetful (forgetful-dist==0.4): PROBLEM: shardext_declare_patches() is named like" in doctor
    times = doctor.split("Plugin load times (import and hooks; SHARDEXT_SLOW_PLUGIN_SECONDS: 0.2 s)\n")[1]
    rows = [line.split() for line in times.split("Conflicts")[0].splitlines()]
    assert rows[0][0] == "sluggish" and rows[0][-1] == "SLOW" and float(rows[0][1]) >= 0.3  # slowest first
    assert {row[0] for row in rows} == set(plugins) and all(row[-1] != "SLOW" for row in rows[1:])

    data = json.loads(run_cli("doctor", "--json"))
    assert validate(data, SCHEMAS["doctor"]) == []
    details = {d["plugin"]: d for d in data["plugin_details"]}
    assert details["sluggish"]["slow"] is True and details["sluggish"]["load_seconds"] >= 0.3
    assert len(details["forgetful"]["problems"]) == 1 and details["gated"]["problems"] == []
    assert details["gated"]["patches"] == 0 and details["gated"]["slow"] is False
    assert data["settings"]["slow_plugin_seconds"] == 0.2


def test_json_plugin_health_fields_are_typed_by_the_schema():
    from physicsnemo_shardext.tools.json_schemas import SCHEMAS, validate

    row = {
        "plugin": "p",
        "distribution": "d",
        "version": "1",
        "status": "loaded",
        "patches": 0,
        "stage": "",
        "reason": "",
        "not_applicable": [],
        "problems": "not a list",
        "load_seconds": "fast",
        "slow": 1,
    }
    problems = validate({"schema_version": 3, "handlers": [], "plugins": [row], "errors": []}, SCHEMAS["list"])
    assert problems == [
        "$.plugins[0].problems: str is not array",
        "$.plugins[0].load_seconds: str is not number or null",
        "$.plugins[0].slow: int is not boolean",
    ]


_DRIFT = """
import io, torch
from physicsnemo_shardext import load_plugins, shard_registries
from physicsnemo_shardext.tools import cli
from physicsnemo_shardext.engine.baseline import ensure_builtin_patches
from physicsnemo_shardext.shard_registries import PatchLevel

def roll_handler(func, types, args, kwargs):
    raise AssertionError("not called here")

roll_handler.__module__ = "physicsnemo.domain_parallel.shard_utils.roll_patches"  # as a newer PhysicsNeMo would
ensure_builtin_patches()
shard_registries.set_handler(PatchLevel.FUNCTION, torch.roll, roll_handler)
load_plugins()
assert shard_registries.current_handler(PatchLevel.FUNCTION, torch.roll) is roll_handler
for command in (["doctor"], ["list"]):
    out = io.StringIO()
    assert cli.main(command, out) == 0
    print(out.getvalue())
"""


def test_doctor_and_list_name_a_first_party_slot_a_newer_physicsnemo_took(python_runner):
    result = python_runner(_DRIFT, env={"SHARDEXT_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr
    doctor, listing = result.stdout.split("Versions", 1)[1].split("\n\n", 1)[0], result.stdout
    assert "roll_flip: upstream drift, not installed: torch.roll: PhysicsNeMo now registers a built-in" in doctor
    assert "stepped aside for a newer PhysicsNeMo's built-in" in listing and "torch.roll" in listing


_STEPPED_ASIDE = """
import io, json, torch
from physicsnemo_shardext import PatchSet, hookimpl, load_plugin
from physicsnemo_shardext.tools import cli

class Plugin:
    @hookimpl
    def shardext_declare_patches(self, patches: PatchSet) -> None:
        def handler(func, types, args, kwargs):
            raise AssertionError("never installed")
        patches.function(torch.cummin, handler, needed_on_torch="<1.0")  # a torch newer than 1.0 made it unnecessary

report = load_plugin(Plugin(), "old-fix")
assert report.status.value == "loaded" and report.patches == 0, report
for command in (["doctor"], ["doctor", "--json"]):
    out = io.StringIO()
    assert cli.main(command, out) == 0
    print(out.getvalue())
"""


def test_doctor_says_a_patch_stepped_aside_outside_its_torch_range(python_runner):
    result = python_runner(_STEPPED_ASIDE)
    assert result.returncode == 0, result.stderr
    text, _, json_text = result.stdout.partition("{")
    assert "old-fix: not needed here, not installed: torch.cummin: needed on torch<1.0 only" in text
    (row,) = [r for r in json.loads("{" + json_text)["plugin_details"] if r["plugin"] == "old-fix"]
    (line,) = row["not_applicable"]
    assert line.startswith("torch.cummin: needed on torch<1.0 only; torch 2.") and line.endswith("handles it without")
