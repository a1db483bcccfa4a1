"""Tests of physicsnemo_shardext.loader: discovery from installed distributions and isolation."""

import pytest
import torch

from physicsnemo_shardext import PluginLoadError, ShardextWarning, shard_registries
from physicsnemo_shardext.loader import PluginLoader, discover_entry_points
from physicsnemo_shardext.provenance import LoadStatus
from physicsnemo_shardext.settings import Settings
from physicsnemo_shardext.testing.plugin_packages import entry_points_in, write_plugin_distribution

GOOD = """
import torch
from physicsnemo_shardext import hookimpl

def roll_handler(func, types, args, kwargs):
    return "{tag}"

@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.roll, roll_handler, priority={priority})
    patches.function(torch.flip, roll_handler, priority={priority})
"""

BROKEN = {
    "import": "raise ImportError('missing optional dependency zzz')",
    "hook": """
from physicsnemo_shardext import hookimpl
import torch
def h(func, types, args, kwargs): ...
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cumsum, h)   # declared first, must be rolled back
    raise RuntimeError('hook exploded')
""",
    "invalid": """
from physicsnemo_shardext import hookimpl
import torch
def h(func, types, args, kwargs): ...
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cumsum, h)
    patches.dispatch(torch.roll, h)     # not an OpOverload
""",
    "incompatible": """
from physicsnemo_shardext import hookimpl
import torch
def h(func, types, args, kwargs): ...
@hookimpl
def shardext_requirements():
    return {"nvidia-physicsnemo": ">=99"}
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cumsum, h)
""",
    "override": """
from physicsnemo_shardext import hookimpl
import torch, torch.nn.functional as F
def h(func, types, args, kwargs): ...
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cumsum, h)
    patches.function(F.interpolate, h)  # a PhysicsNeMo built-in, without override=True
""",
    "badhook": """
from physicsnemo_shardext import hookimpl
@hookimpl
def shardext_declare_patches(patches, unknown_argument):
    pass
""",
}


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A private site folder on sys.path where test distributions get installed."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def install(site, distribution, entry_point, module, source, version="1.0"):
    write_plugin_distribution(site, distribution, version, {entry_point: module}, {module: source})


def load(site, registry, **settings):
    loader = PluginLoader(registry, Settings(**settings))
    return {r.plugin.name: r for r in loader.load_entry_points(entry_points_in(site))}


def test_installed_distribution_is_discovered_with_provenance(site, fresh_registry):
    install(site, "good-dist", "good", "good_plugin_a", GOOD.format(tag="a", priority=0), version="3.1")
    assert "good" in [ep.name for ep in discover_entry_points()]  # the real, global discovery
    reports = load(site, fresh_registry)
    assert reports["good"].status is LoadStatus.LOADED and reports["good"].patches == 2
    record = fresh_registry.provenance(torch.roll)
    assert (record.plugin.distribution, record.plugin.version, record.plugin.source) == ("good-dist", "3.1", "entry-point")
    assert shard_registries.current_handler("function", torch.roll)(None, None, None, None) == "a"


@pytest.mark.parametrize(
    ("case", "stage"),
    [
        ("import", "import"),
        ("hook", "shardext_declare_patches"),
        ("invalid", "shardext_declare_patches"),
        ("badhook", "register"),
        ("override", "install"),
    ],
)
def test_failing_plugin_is_isolated(site, fresh_registry, pristine_registries, case, stage):
    install(site, f"broken-{case}-dist", f"broken-{case}", f"broken_{case}_mod", BROKEN[case], version="0.9")
    install(site, "good-dist", "good", "good_plugin_b", GOOD.format(tag="b", priority=0))
    with pytest.warns(ShardextWarning, match=f"broken-{case}-dist==0.9") as caught:
        reports = load(site, fresh_registry)
    failed = reports[f"broken-{case}"]
    assert failed.status is LoadStatus.FAILED and failed.stage == stage
    assert f"broken-{case}-dist==0.9" in failed.reason
    assert any(f"broken-{case}" in str(w.message) for w in caught)
    # nothing of the broken plugin is installed; the good one is
    assert shard_registries.current_handler("function", torch.cumsum) is None
    assert reports["good"].status is LoadStatus.LOADED
    fresh_registry.remove_plugin("good")
    assert shard_registries.snapshot() == pristine_registries


def test_incompatible_plugin_is_skipped_with_reason(site, fresh_registry, pristine_registries):
    install(site, "future-dist", "future", "future_mod", BROKEN["incompatible"])
    with pytest.warns(ShardextWarning, match=r"requires nvidia-physicsnemo>=99, but nvidia-physicsnemo 2\.2"):
        reports = load(site, fresh_registry)
    assert reports["future"].status is LoadStatus.INCOMPATIBLE
    assert shard_registries.snapshot() == pristine_registries


def test_strict_mode_raises_and_leaves_registry_unchanged(site, fresh_registry, pristine_registries):
    install(site, "broken-hook-dist", "broken-hook", "broken_hook_strict", BROKEN["hook"])
    with pytest.raises(PluginLoadError, match="hook exploded") as error:
        load(site, fresh_registry, strict=True)
    assert error.value.distribution == "broken-hook-dist"
    assert shard_registries.snapshot() == pristine_registries


def test_deny_list_by_entry_point_or_distribution(site, fresh_registry):
    install(site, "first-dist", "first", "first_mod", GOOD.format(tag="1", priority=1))
    install(site, "second-dist", "second", "second_mod", GOOD.format(tag="2", priority=2))
    reports = load(site, fresh_registry, deny=("second-dist",))
    assert reports["second"].status is LoadStatus.BLOCKED and "SHARDEXT_DISABLE" in reports["second"].reason
    assert shard_registries.current_handler("function", torch.roll)(None, None, None, None) == "1"


def test_allow_list_blocks_everything_else(site, fresh_registry):
    install(site, "first-dist", "first", "first_mod2", GOOD.format(tag="1", priority=1))
    install(site, "second-dist", "second", "second_mod2", GOOD.format(tag="2", priority=2))
    reports = load(site, fresh_registry, allow=("first",))
    assert reports["first"].status is LoadStatus.LOADED
    assert reports["second"].status is LoadStatus.BLOCKED and "SHARDEXT_ONLY" in reports["second"].reason


def test_two_installed_plugins_conflict(site, fresh_registry):
    install(site, "left-dist", "left", "left_mod", GOOD.format(tag="L", priority=5))
    install(site, "right-dist", "right", "right_mod", GOOD.format(tag="R", priority=5))
    with pytest.warns(ShardextWarning, match="'left' and 'right'"):
        load(site, fresh_registry)
    assert shard_registries.current_handler("function", torch.roll) is None
    assert {c.target for c in fresh_registry.conflicts()} == {"torch.roll", "torch.flip"}


def test_priority_independent_of_discovery_order(site, pristine_registries):
    from physicsnemo_shardext.registry import PatchRegistry

    install(site, "aaa-dist", "aaa", "aaa_mod", GOOD.format(tag="high", priority=9))
    install(site, "zzz-dist", "zzz", "zzz_mod", GOOD.format(tag="low", priority=1))
    for order in (entry_points_in(site), list(reversed(entry_points_in(site)))):
        registry = PatchRegistry()
        PluginLoader(registry, Settings()).load_entry_points(order)
        assert shard_registries.current_handler("function", torch.roll)(None, None, None, None) == "high"
        registry.remove_all()
        assert shard_registries.snapshot() == pristine_registries


def test_loading_twice_is_a_no_op(site, fresh_registry):
    install(site, "good-dist", "good", "good_plugin_twice", GOOD.format(tag="t", priority=0))
    load(site, fresh_registry)
    assert load(site, fresh_registry) == {}
    assert [p.name for p in fresh_registry.plugins()] == ["good"]
