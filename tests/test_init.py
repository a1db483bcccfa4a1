"""Tests of import-time behaviour of physicsnemo_shardext (autoload and its switches).

Import-time behaviour needs a fresh interpreter, so these tests run Python in a subprocess.
"""

import json

from physicsnemo_shardext.testing.plugin_packages import write_plugin_distribution

PLUGIN = """
import torch
from physicsnemo_shardext import hookimpl
def handler(func, types, args, kwargs): ...
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cumprod, handler)
"""

BROKEN = "raise RuntimeError('cannot import me')"

REPORT = """
import json, physicsnemo_shardext as s
from physicsnemo.domain_parallel import ShardTensor
import torch
print(json.dumps({
    "reports": {r.plugin.name: [r.status.value, r.plugin.distribution] for r in s.get_registry().reports()},
    "cumsum": torch.cumprod in ShardTensor._function_registry,
    "builtins": len(ShardTensor._function_registry),
}))
"""


def installed_site(tmp_path):
    write_plugin_distribution(
        tmp_path, "cumsum-dist", "2.0", {"cumsum-plugin": "cumsum_plugin"}, {"cumsum_plugin": PLUGIN}
    )
    write_plugin_distribution(tmp_path, "broken-dist", "0.1", {"broken": "broken_plugin"}, {"broken_plugin": BROKEN})
    return [str(tmp_path)]


def run_report(python_runner, path, env=None):
    result = python_runner(REPORT, env=env, path=path)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_import_autoloads_installed_plugins_and_isolates_failures(tmp_path, python_runner):
    report, stderr = run_report(python_runner, installed_site(tmp_path))
    assert report["reports"]["cumsum-plugin"] == ["loaded", "cumsum-dist"]
    assert report["reports"]["pointwise"] == ["loaded", "physicsnemo-shardext"]  # first-party, same path
    assert report["reports"]["broken"] == ["failed", "broken-dist"]
    assert "broken-dist==0.1" in stderr and "cannot import me" in stderr
    assert report["cumsum"] is True
    assert report["builtins"] > 30  # PhysicsNeMo's built-ins are present on CPU too


def test_autoload_off(tmp_path, python_runner):
    report, _ = run_report(python_runner, installed_site(tmp_path), env={"SHARDEXT_AUTOLOAD": "0"})
    assert report["reports"] == {} and report["cumsum"] is False
    assert report["builtins"] > 30


def test_deny_list_from_environment(tmp_path, python_runner):
    report, _ = run_report(python_runner, installed_site(tmp_path), env={"SHARDEXT_DISABLE": "cumsum-dist,broken"})
    assert report["reports"]["cumsum-plugin"][0] == "blocked"
    assert report["reports"]["broken"][0] == "blocked"
    assert report["cumsum"] is False


def test_allow_list_from_environment(tmp_path, python_runner):
    report, _ = run_report(python_runner, installed_site(tmp_path), env={"SHARDEXT_ONLY": "cumsum-plugin"})
    assert report["reports"]["cumsum-plugin"][0] == "loaded"
    assert report["reports"]["pointwise"][0] == "blocked"
    assert report["reports"]["broken"][0] == "blocked"


def test_strict_mode_makes_import_fail_naming_the_plugin(tmp_path, python_runner):
    result = python_runner("import physicsnemo_shardext", env={"SHARDEXT_STRICT": "1"}, path=installed_site(tmp_path))
    assert result.returncode != 0
    assert "PluginLoadError" in result.stderr and "broken-dist==0.1" in result.stderr
