"""Tests of physicsnemo_shardext.engine.loader: discovery from installed distributions and isolation."""

import importlib
import json
import sys

import pytest
import torch

from physicsnemo_shardext import PluginLoadError, ShardextWarning, shard_registries
from physicsnemo_shardext.engine.loader import PluginLoader, discover_entry_points
from physicsnemo_shardext.engine.provenance import LoadStatus
from physicsnemo_shardext.settings import Settings
from physicsnemo_shardext.testing.plugin_packages import (
    entry_points_in,
    first_party_entry_points,
    write_plugin_distribution,
)

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
    assert (record.plugin.distribution, record.plugin.version, record.plugin.source) == (
        "good-dist",
        "3.1",
        "entry-point",
    )
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
    from physicsnemo_shardext.engine.registry import PatchRegistry

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


# -- plugins that end the program, interrupt it, or exit a generator -------------------------

BASE_EXCEPTIONS = {
    "exit-at-import": ("import sys\nsys.exit(3)\n", "import", "SystemExit: 3"),
    "panic-at-import": (
        "class PluginPanic(KeyboardInterrupt):\n    pass\nraise PluginPanic('plugin gave up')\n",
        "import",
        "PluginPanic: plugin gave up",
    ),
    "exit-in-hook": (
        "import sys\nfrom physicsnemo_shardext import hookimpl\n"
        "@hookimpl\ndef shardext_declare_patches(patches):\n    sys.exit(4)\n",
        "shardext_declare_patches",
        "SystemExit: 4",
    ),
    "generator-exit-in-requirements": (
        "from physicsnemo_shardext import hookimpl\n"
        "@hookimpl\ndef shardext_requirements():\n    raise GeneratorExit('closed')\n",
        "shardext_requirements",
        "GeneratorExit: closed",
    ),
}


def by_identity(reports):
    return {(r.plugin.distribution, r.plugin.name): r for r in reports}


@pytest.mark.parametrize("case", sorted(BASE_EXCEPTIONS))
def test_base_exceptions_are_contained_and_reported(site, fresh_registry, pristine_registries, case):
    source, stage, named = BASE_EXCEPTIONS[case]
    module = case.replace("-", "_") + "_mod"
    install(site, f"{case}-dist", case, module, source, version="0.3")
    install(site, "good-dist", "good", f"good_after_{module}", GOOD.format(tag="g", priority=0))
    with pytest.warns(ShardextWarning, match=f"{case}-dist==0.3 failed during {stage}: {named}"):
        reports = load(site, fresh_registry)
    assert reports[case].status is LoadStatus.FAILED and reports[case].stage == stage
    assert named in reports[case].reason and "contained" in reports[case].reason
    assert reports["good"].status is LoadStatus.LOADED
    fresh_registry.remove_plugin("good")
    assert shard_registries.snapshot() == pristine_registries


def test_exception_that_cannot_be_printed_is_still_reported(site, fresh_registry):
    rude = "class Rude(Exception):\n    def __str__(self):\n        raise SystemExit(1)\nraise Rude()\n"
    install(site, "rude-dist", "rude", "rude_mod", rude)
    with pytest.warns(ShardextWarning, match="failed during import: Rude: <unprintable Rude>"):
        reports = load(site, fresh_registry)
    assert reports["rude"].status is LoadStatus.FAILED


def test_base_exception_is_fatal_in_strict_mode(site, fresh_registry, pristine_registries):
    install(site, "exit-dist", "exit", "exit_strict_mod", BASE_EXCEPTIONS["exit-at-import"][0])
    with pytest.raises(PluginLoadError, match="SystemExit: 3") as error:
        load(site, fresh_registry, strict=True)
    assert (error.value.plugin, error.value.distribution) == ("exit", "exit-dist")
    assert shard_registries.snapshot() == pristine_registries


def test_exit_at_import_does_not_end_the_program(site, python_runner):
    install(site, "exit-dist", "exit", "exit_subprocess_mod", "import sys\nsys.exit(3)\n", version="0.3")
    install(site, "panic-dist", "panic", "panic_subprocess_mod", BASE_EXCEPTIONS["panic-at-import"][0])
    code = (
        "import physicsnemo_shardext as s\n"
        "r = {x.plugin.name: x for x in s.get_registry().reports()}\n"
        "print(r['exit'].status.value, r['panic'].status.value, r['pointwise'].status.value)\n"
        "print('still running')\n"
    )
    result = python_runner(code, path=[str(site)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["failed failed loaded", "still running"]
    assert "plugin 'exit' from exit-dist==0.3 failed during import: SystemExit: 3" in result.stderr


INTERRUPTING = """
import torch
from physicsnemo.domain_parallel import ShardTensor
def h(func, types, args, kwargs): ...
ShardTensor.register_function_handler(torch.cumsum, h)   # rolled back before the interrupt propagates
{interrupt}
"""


def test_user_keyboard_interrupt_still_propagates(site, fresh_registry, pristine_registries):
    install(site, "ctrl-c-dist", "ctrl-c", "ctrl_c_mod", INTERRUPTING.format(interrupt="raise KeyboardInterrupt"))
    with pytest.raises(KeyboardInterrupt):
        load(site, fresh_registry)
    assert shard_registries.snapshot() == pristine_registries


def test_real_sigint_during_import_propagates(site, fresh_registry, pristine_registries):
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT does not raise KeyboardInterrupt in this process")
    sigint = "import signal, time\nsignal.raise_signal(signal.SIGINT)\ntime.sleep(30)"
    install(site, "sigint-dist", "sigint", "sigint_mod", INTERRUPTING.format(interrupt=sigint))
    with pytest.raises(KeyboardInterrupt):
        load(site, fresh_registry)
    assert shard_registries.snapshot() == pristine_registries


# -- writes into ShardTensor's registries that bypass the hooks ------------------------------

SNEAKY = """
import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo_shardext import hookimpl
def sneaky_handler(func, types, args, kwargs):
    return "sneaky"
{write}
"""

WRITES = {
    "register-call": (
        "ShardTensor.register_function_handler(torch.cumsum, sneaky_handler)",
        "_function_registry[torch.cumsum]: added {module}.sneaky_handler",
        "patches.function(torch.cumsum, {module}.sneaky_handler)",
    ),
    "dict-write": (
        "ShardTensor._dispatch_registry[torch.ops.aten.cumsum.default] = sneaky_handler",
        "_dispatch_registry[aten.cumsum.default]: added {module}.sneaky_handler",
        "patches.dispatch(torch.ops.aten.cumsum.default, {module}.sneaky_handler)",
    ),
    "builtin-replaced": (
        "import torch.nn.functional as F\nShardTensor._function_registry[F.interpolate] = sneaky_handler",
        "generic_interpolate_wrapper replaced by {module}.sneaky_handler",
        "patches.function(torch.nn.functional.interpolate, {module}.sneaky_handler)",
    ),
    "rebind": (
        "ShardTensor._named_function_registry = {'mylib.op.default': sneaky_handler}",
        "ShardTensor._named_function_registry rebound to another dict",
        'patches.named("mylib.op.default", {module}.sneaky_handler)',
    ),
}


@pytest.mark.parametrize("case", sorted(WRITES))
def test_import_time_registry_write_is_rolled_back_and_attributed(site, fresh_registry, pristine_registries, case):
    write, change, hint = WRITES[case]
    module = f"sneaky_{case.replace('-', '_')}_mod"
    install(site, "sneaky-dist", "sneaky", module, SNEAKY.format(write=write), version="6.6")
    install(site, "good-dist", "good", f"good_beside_{module}", GOOD.format(tag="g", priority=0))
    with pytest.warns(ShardextWarning, match="sneaky-dist==6.6 failed during import: UndeclaredPatchError") as caught:
        reports = load(site, fresh_registry)
    sneaky = reports["sneaky"]
    assert sneaky.status is LoadStatus.FAILED and sneaky.stage == "import"
    assert change.format(module=module) in sneaky.reason
    assert hint.format(module=module) in sneaky.reason and "shardext_declare_patches" in sneaky.reason
    assert reports["good"].status is LoadStatus.LOADED
    assert not any("good-dist" in str(w.message) for w in caught)
    fresh_registry.remove_plugin("good")
    assert shard_registries.snapshot() == pristine_registries  # restored exactly, rebound dict included


def test_registry_write_inside_a_hook_is_caught_too(site, fresh_registry, pristine_registries):
    source = SNEAKY.format(
        write="@hookimpl\ndef shardext_declare_patches(patches):\n"
        "    ShardTensor.register_function_handler(torch.cumsum, sneaky_handler)\n"
    )
    install(site, "hook-writer-dist", "hook-writer", "hook_writer_mod", source)
    with pytest.warns(ShardextWarning, match="failed during shardext_declare_patches: UndeclaredPatchError"):
        reports = load(site, fresh_registry)
    assert reports["hook-writer"].status is LoadStatus.FAILED
    assert shard_registries.snapshot() == pristine_registries


def test_registry_write_is_fatal_in_strict_mode(site, fresh_registry, pristine_registries):
    install(site, "sneaky-dist", "sneaky", "sneaky_strict_mod", SNEAKY.format(write=WRITES["register-call"][0]))
    with pytest.raises(PluginLoadError, match="UndeclaredPatchError") as error:
        load(site, fresh_registry, strict=True)
    assert (error.value.plugin, error.value.distribution) == ("sneaky", "sneaky-dist")
    assert shard_registries.snapshot() == pristine_registries


VICTIM = """
import torch
from physicsnemo_shardext import hookimpl
def victim_handler(func, types, args, kwargs):
    return "victim"
@hookimpl
def shardext_declare_patches(patches):
    patches.function(torch.cumsum, victim_handler)   # no override: the slot is free before any plugin
"""


@pytest.mark.parametrize("sneaky_first", [True, False])
def test_no_victim_is_blamed_for_an_import_time_write(site, fresh_registry, sneaky_first):
    install(
        site,
        "sneaky-dist",
        "sneaky",
        f"sneaky_victim_mod_{sneaky_first}",
        SNEAKY.format(write=WRITES["register-call"][0]),
    )
    install(site, "victim-dist", "victim", f"victim_mod_{sneaky_first}", VICTIM)
    order = entry_points_in(site)  # sneaky sorts first
    order = order if sneaky_first else order[::-1]
    with pytest.warns(ShardextWarning) as caught:
        reports = by_identity(PluginLoader(fresh_registry, Settings()).load_entry_points(order))
    assert reports[("sneaky-dist", "sneaky")].status is LoadStatus.FAILED
    assert reports[("victim-dist", "victim")].status is LoadStatus.LOADED
    assert not any("victim-dist" in str(w.message) for w in caught)
    assert shard_registries.current_handler("function", torch.cumsum)(None, None, None, None) == "victim"


def test_strict_error_names_the_writer_not_the_victim(site, fresh_registry):
    install(site, "sneaky-dist", "sneaky", "sneaky_strict_victim_mod", SNEAKY.format(write=WRITES["register-call"][0]))
    install(site, "victim-dist", "victim", "victim_strict_mod", VICTIM)
    with pytest.raises(PluginLoadError) as error:
        load(site, fresh_registry, strict=True)
    assert error.value.plugin == "sneaky" and "victim-dist" not in str(error.value)


def test_write_then_import_failure_is_rolled_back(site, fresh_registry, pristine_registries):
    source = SNEAKY.format(write=WRITES["register-call"][0] + "\nraise ImportError('missing zzz')")
    install(site, "half-dist", "half", "half_mod", source, version="0.1")
    with pytest.warns(ShardextWarning, match="half-dist==0.1 failed during import: ImportError: missing zzz"):
        reports = load(site, fresh_registry)
    reason = reports["half"].reason
    assert "rolled back" in reason and "_function_registry[torch.cumsum]: added half_mod.sneaky_handler" in reason
    assert shard_registries.snapshot() == pristine_registries


# -- plugin identity: (distribution, entry-point name) ---------------------------------------

IMPOSTOR = """
import torch.nn.functional as F
from physicsnemo_shardext import hookimpl
def impostor_gelu(func, types, args, kwargs):
    return "impostor"
@hookimpl
def shardext_declare_patches(patches):
    patches.function(F.gelu, impostor_gelu, override=True)
"""


@pytest.mark.parametrize("order", ["first-party-first", "impostor-first", "impostor-alone"])
def test_first_party_name_cannot_be_taken(site, fresh_registry, order):
    import torch.nn.functional as F

    install(site, "evil-dist", "pointwise", f"evil_pointwise_{order.replace('-', '_')}", IMPOSTOR, version="6.6")
    real = first_party_entry_points("pointwise")
    entry_points = {
        "first-party-first": real + entry_points_in(site),
        "impostor-first": entry_points_in(site) + real,
        "impostor-alone": entry_points_in(site),
    }[order]
    with pytest.warns(ShardextWarning, match="evil-dist==6.6 failed during name check") as caught:
        reports = by_identity(PluginLoader(fresh_registry, Settings()).load_entry_points(entry_points))
    impostor = reports[("evil-dist", "pointwise")]
    assert impostor.status is LoadStatus.FAILED and impostor.stage == "name check"
    assert "belongs to a first-party plugin of physicsnemo-shardext and cannot be taken by evil-dist" in impostor.reason
    assert not any("physicsnemo-shardext==" in str(w.message) for w in caught)  # the real plugin is never blamed
    if order != "impostor-alone":
        assert reports[("physicsnemo-shardext", "pointwise")].status is LoadStatus.LOADED
        assert fresh_registry.provenance(F.gelu).plugin.distribution == "physicsnemo-shardext"
        assert reports[("physicsnemo-shardext", "pointwise")].patches > 1


CLASH_ORDERS = [pytest.param(False, id="alpha-first"), pytest.param(True, id="beta-first")]


def clashing_entry_points(site, reverse):
    install(site, "alpha-dist", "fast", f"fast_alpha_{reverse}", GOOD.format(tag="alpha", priority=0))
    install(site, "beta-dist", "fast", f"fast_beta_{reverse}", GOOD.format(tag="beta", priority=0))
    entry_points = entry_points_in(site)
    return entry_points[::-1] if reverse else entry_points


@pytest.mark.parametrize("reverse", CLASH_ORDERS)
def test_same_name_from_two_distributions_refuses_both(site, fresh_registry, pristine_registries, reverse):
    entry_points = clashing_entry_points(site, reverse)
    with pytest.warns(
        ShardextWarning, match="distributions alpha-dist and beta-dist both publish a plugin named 'fast'"
    ):
        reports = by_identity(PluginLoader(fresh_registry, Settings()).load_entry_points(entry_points))
    for distribution in ("alpha-dist", "beta-dist"):
        report = reports[(distribution, "fast")]
        assert report.status is LoadStatus.FAILED and report.stage == "name check"
        assert "SHARDEXT_DISABLE=alpha-dist or SHARDEXT_DISABLE=beta-dist" in report.reason
    assert {(r.plugin.distribution, r.status) for r in fresh_registry.reports()} == {
        ("alpha-dist", LoadStatus.FAILED),
        ("beta-dist", LoadStatus.FAILED),
    }
    assert shard_registries.snapshot() == pristine_registries


@pytest.mark.parametrize("reverse", CLASH_ORDERS)
def test_same_name_clash_in_strict_mode_is_independent_of_order(site, fresh_registry, pristine_registries, reverse):
    entry_points = clashing_entry_points(site, reverse)
    with pytest.raises(PluginLoadError, match="alpha-dist and beta-dist") as error:
        PluginLoader(fresh_registry, Settings(strict=True)).load_entry_points(entry_points)
    assert error.value.distribution == "alpha-dist" and error.value.stage == "name check"
    assert shard_registries.snapshot() == pristine_registries


def test_disabling_one_distribution_resolves_a_clash(site, fresh_registry):
    entry_points = clashing_entry_points(site, False)
    loader = PluginLoader(fresh_registry, Settings(deny=("beta-dist",)))
    reports = by_identity(loader.load_entry_points(entry_points))
    assert reports[("alpha-dist", "fast")].status is LoadStatus.LOADED
    assert reports[("beta-dist", "fast")].status is LoadStatus.BLOCKED


def test_name_held_by_an_earlier_load_refuses_the_newcomer(site, fresh_registry):
    entry_points = clashing_entry_points(site, False)
    PluginLoader(fresh_registry, Settings()).load_entry_points(entry_points[:1])
    with pytest.warns(ShardextWarning, match="belongs to an already loaded plugin of alpha-dist"):
        reports = by_identity(PluginLoader(fresh_registry, Settings()).load_entry_points(entry_points))
    assert list(reports) == [("beta-dist", "fast")] and reports[("beta-dist", "fast")].status is LoadStatus.FAILED
    assert shard_registries.current_handler("function", torch.roll)(None, None, None, None) == "alpha"


# -- strict mode: anything but a clean load ---------------------------------------------------


def test_strict_mode_fails_on_an_incompatible_plugin(site, fresh_registry, pristine_registries):
    install(site, "future-dist", "future", "future_strict_mod", BROKEN["incompatible"], version="2.0")
    with pytest.raises(
        PluginLoadError,
        match=r"future-dist==2.0 failed during shardext_requirements: IncompatiblePluginError: it requires nvidia-physicsnemo>=99",
    ):
        load(site, fresh_registry, strict=True)
    assert [r.status for r in fresh_registry.reports()] == [LoadStatus.INCOMPATIBLE]
    assert shard_registries.snapshot() == pristine_registries


def test_strict_mode_accepts_blocked_plugins(site, fresh_registry):
    install(site, "future-dist", "future", "future_blocked_mod", BROKEN["incompatible"])
    install(site, "good-dist", "good", "good_strict_blocked", GOOD.format(tag="s", priority=0))
    reports = load(site, fresh_registry, strict=True, deny=("future",))
    assert (reports["future"].status, reports["good"].status) == (LoadStatus.BLOCKED, LoadStatus.LOADED)


def test_strict_mode_raises_patch_conflict_error_on_an_unresolved_tie(site, pristine_registries):
    # docs/reference/environment.md: "A tie between plugins that nothing resolves raises PatchConflictError".
    from physicsnemo_shardext import PatchConflictError
    from physicsnemo_shardext.engine.registry import PatchRegistry

    install(site, "left-dist", "left", "left_strict_tie", GOOD.format(tag="L", priority=5))
    install(site, "right-dist", "right", "right_strict_tie", GOOD.format(tag="R", priority=5))
    registry = PatchRegistry(strict=True)
    try:
        with pytest.raises(PatchConflictError, match="'left' and 'right' both claim it at priority 5") as error:
            PluginLoader(registry, Settings(strict=True)).load_entry_points(entry_points_in(site))
        assert not isinstance(error.value, PluginLoadError)
        assert error.value.providers == ["left", "right"] and error.value.priority == 5
        statuses = {r.plugin.name: r.status for r in registry.reports()}
        assert statuses == {"left": LoadStatus.LOADED, "right": LoadStatus.FAILED}
        assert shard_registries.current_handler("function", torch.roll)(None, None, None, None) == "L"
    finally:
        registry.remove_all()
    assert shard_registries.snapshot() == pristine_registries


@pytest.mark.parametrize("variable", ["deny", "allow"])
def test_a_name_matching_no_plugin_warns_with_close_matches(site, fresh_registry, variable):
    install(site, "first-dist", "first", "first_typo_mod", GOOD.format(tag="1", priority=1))
    option = "SHARDEXT_DISABLE" if variable == "deny" else "SHARDEXT_ONLY"
    with pytest.warns(
        ShardextWarning,
        match=rf"{option} names 'frist', which matches no installed plugin or distribution; did you mean 'first'",
    ) as record:
        reports = load(
            site, fresh_registry, **{variable: ("frist", "first-dist" if variable == "allow" else "nothing-like-it-zz")}
        )
    messages = [str(w.message) for w in record if issubclass(w.category, ShardextWarning)]
    if variable == "deny":
        assert reports["first"].status is LoadStatus.LOADED  # the typo blocked nothing
        assert any("'nothing-like-it-zz'" in m and "no close match" in m for m in messages)
    else:
        assert reports["first"].status is LoadStatus.LOADED  # matched by its distribution: no warning for it
        assert not any(m.startswith("SHARDEXT_ONLY names 'first-dist'") for m in messages)


def test_names_of_installed_plugins_outside_the_loaded_set_do_not_warn(site, fresh_registry, recwarn):
    install(site, "first-dist", "first", "first_known_mod", GOOD.format(tag="1", priority=1))
    load(site, fresh_registry, deny=("pointwise", "physicsnemo-shardext", "first"))  # real, installed names
    assert not [w for w in recwarn if "matches no installed plugin" in str(w.message)]


# -- deferred plugins: shardext_import_after --------------------------------------------------

DEFERRED = """
import torch
from physicsnemo_shardext import hookimpl

def cummax_handler(func, types, args, kwargs):
    return "deferred"

@hookimpl
def shardext_import_after():
    return {modules!r}

@hookimpl
def shardext_declare_patches(patches):
    import {first}                      # imported by now
    {declare_body}
    patches.function(torch.cummax, cummax_handler)
"""


@pytest.fixture
def awaited(site):
    """Names of fresh modules in the site folder (not imported yet); their callbacks are cancelled after."""
    from physicsnemo_shardext.engine.import_hooks import cancel_all

    made = []

    def make(source="VALUE = 1\n"):
        name = f"awaited_{len(made)}_{id(made):x}"
        (site / f"{name}.py").write_text(source)
        made.append(name)
        return name

    yield make
    for name in made:
        cancel_all(name)
        sys.modules.pop(name, None)


def deferred_source(modules, declare_body="pass"):
    return DEFERRED.format(modules=list(modules), first=modules[0], declare_body=declare_body)


def handler_of_cummax():
    handler = shard_registries.current_handler("function", torch.cummax)
    return None if handler is None else handler(None, None, None, None)


def test_plugin_waits_for_its_module_then_loads(site, fresh_registry, awaited):
    module = awaited()
    install(site, "late-dist", "late", "late_mod_a", deferred_source([module]), version="2.0")
    report = load(site, fresh_registry)["late"]
    assert report.status is LoadStatus.DEFERRED and report.stage == "shardext_import_after"
    assert module in report.reason and handler_of_cummax() is None and fresh_registry.plugins() == []
    importlib.import_module(module)
    [after] = [r for r in fresh_registry.reports() if r.plugin.name == "late"]
    assert after.status is LoadStatus.LOADED and after.patches == 1
    assert after.plugin == report.plugin  # the same PluginInfo: distribution, version, source
    assert handler_of_cummax() == "deferred"
    assert fresh_registry.provenance(torch.cummax).plugin.version == "2.0"


def test_plugin_whose_modules_are_imported_loads_at_once(site, fresh_registry):
    install(site, "late-dist", "late", "late_mod_b", deferred_source(["json", "torch"]))
    assert load(site, fresh_registry)["late"].status is LoadStatus.LOADED
    assert handler_of_cummax() == "deferred"


def test_plugin_waits_for_each_module_in_turn(site, fresh_registry, awaited):
    first, second = awaited(), awaited()
    install(site, "late-dist", "late", "late_mod_c", deferred_source([first, second]))
    load(site, fresh_registry)
    importlib.import_module(second)
    [report] = fresh_registry.reports()
    assert report.status is LoadStatus.DEFERRED and first in report.reason
    importlib.import_module(first)
    [report] = fresh_registry.reports()
    assert report.status is LoadStatus.LOADED


@pytest.mark.parametrize("strict", [False, True])
def test_a_deferred_plugin_that_fails_later_is_isolated_and_warned_about(
    site, fresh_registry, pristine_registries, awaited, strict
):
    module = awaited()
    body = "ShardTensor.register_function_handler(torch.cumsum, cummax_handler)\n    raise RuntimeError('late boom')"
    source = "from physicsnemo.domain_parallel import ShardTensor\n" + deferred_source([module], body)
    install(site, "late-dist", "late", f"late_mod_fail_{strict}", source, version="0.5")
    assert load(site, fresh_registry, strict=strict)["late"].status is LoadStatus.DEFERRED  # strict: not a failure
    with pytest.warns(
        ShardextWarning,
        match=r"late-dist==0.5 failed during shardext_declare_patches: RuntimeError: "
        r"late boom.*deferred until a module's import",
    ):
        importlib.import_module(module)  # never raises, in strict mode either: it would break this import
    [report] = fresh_registry.reports()
    assert report.status is LoadStatus.FAILED and report.stage == "shardext_declare_patches"
    assert shard_registries.snapshot() == pristine_registries  # its own write rolled back, nothing installed


def test_a_blocked_plugin_is_never_deferred(site, fresh_registry, awaited):
    from physicsnemo_shardext.engine.import_hooks import awaited_modules

    module = awaited()
    install(site, "late-dist", "late", "late_mod_blocked", deferred_source([module]))
    assert load(site, fresh_registry, deny=("late",))["late"].status is LoadStatus.BLOCKED
    assert module not in awaited_modules()


@pytest.mark.parametrize("answer", ["'json'", "[1]", "42"])
def test_import_after_must_return_module_names(site, fresh_registry, answer):
    source = (
        f"from physicsnemo_shardext import hookimpl\n@hookimpl\ndef shardext_import_after():\n    return {answer}\n"
    )
    install(site, "odd-dist", "odd", f"odd_mod_{abs(hash(answer))}", source)
    with pytest.warns(ShardextWarning, match="failed during shardext_import_after: ValueError: shardext_import_after"):
        report = load(site, fresh_registry)["odd"]
    assert report.status is LoadStatus.FAILED


def test_waiting_plugin_is_not_loaded_twice(site, fresh_registry, awaited):
    module = awaited()
    install(site, "late-dist", "late", "late_mod_twice", deferred_source([module]))
    loader = PluginLoader(fresh_registry, Settings())
    assert [r.status for r in loader.load_entry_points(entry_points_in(site))] == [LoadStatus.DEFERRED]
    assert loader.load_entry_points(entry_points_in(site)) == []  # still waiting: a no-op
    importlib.import_module(module)
    assert [r.status for r in fresh_registry.reports()] == [LoadStatus.LOADED]


def test_remove_plugin_does_not_know_a_waiting_plugin(site, fresh_registry, awaited):
    install(site, "late-dist", "late", "late_mod_remove", deferred_source([awaited()]))
    load(site, fresh_registry)
    with pytest.raises(KeyError, match="no plugin named 'late' is loaded"):
        fresh_registry.remove_plugin("late")


def test_deferred_inside_a_sandbox_is_forgotten_with_it(site, fresh_registry, pristine_registries, awaited):
    module = awaited()
    install(site, "late-dist", "late", "late_mod_sandbox_a", deferred_source([module]))
    with fresh_registry.sandbox():
        assert load(site, fresh_registry)["late"].status is LoadStatus.DEFERRED
    importlib.import_module(module)  # the sandbox that deferred it is gone: nothing loads
    assert fresh_registry.reports() == [] and shard_registries.snapshot() == pristine_registries


def test_loaded_inside_a_sandbox_is_undone_and_loads_again_on_the_next_load(site, fresh_registry, awaited):
    module = awaited()
    install(site, "late-dist", "late", "late_mod_sandbox_b", deferred_source([module]))
    load(site, fresh_registry)
    with fresh_registry.sandbox():
        importlib.import_module(module)
        assert handler_of_cummax() == "deferred"
    assert handler_of_cummax() is None and [r.status for r in fresh_registry.reports()] == [LoadStatus.DEFERRED]
    assert load(site, fresh_registry)["late"].status is LoadStatus.LOADED  # what load_plugins() does
    assert handler_of_cummax() == "deferred"


def test_resume_ready_loads_what_a_sandbox_rolled_back(site, fresh_registry, awaited):
    from physicsnemo_shardext.engine.loader import resume_ready

    module = awaited()
    install(site, "late-dist", "late", "late_mod_sandbox_c", deferred_source([module]))
    load(site, fresh_registry)
    assert resume_ready(fresh_registry) == []  # its module is not imported: still waiting
    with fresh_registry.sandbox():
        importlib.import_module(module)
    assert [r.status for r in resume_ready(fresh_registry)] == [LoadStatus.LOADED]
    assert handler_of_cummax() == "deferred" and resume_ready(fresh_registry) == []


def test_package_sandbox_reloads_a_deferred_plugin_it_rolled_back(site, fresh_registry, awaited, monkeypatch):
    import physicsnemo_shardext

    module = awaited()
    install(site, "late-dist", "late", "late_mod_sandbox_d", deferred_source([module]))
    load(site, fresh_registry)
    monkeypatch.setattr(physicsnemo_shardext, "_registry", fresh_registry)
    with physicsnemo_shardext.sandbox():
        importlib.import_module(module)
    # the import will not happen again, so leaving the sandbox loads it once more
    assert [r.status for r in fresh_registry.reports()] == [LoadStatus.LOADED]
    assert handler_of_cummax() == "deferred"


def test_deferred_plugin_loading_inside_another_plugins_import_is_not_blamed_on_it(site, fresh_registry, awaited):
    module = awaited()
    install(site, "late-dist", "late", "late_mod_nested", deferred_source([module]))
    load(site, fresh_registry)
    importer = f"import {module}\nraise ImportError('importer gives up')\n"  # fails after the import
    install(site, "importer-dist", "importer", "importer_mod", importer)
    install(site, "clean-dist", "clean", "clean_importer_mod", f"import {module}\n")
    with pytest.warns(ShardextWarning, match="importer-dist==1.0 failed during import: ImportError: importer gives up"):
        reports = load(site, fresh_registry)
    assert "UndeclaredPatchError" not in reports["importer"].reason
    assert reports["clean"].status is LoadStatus.LOADED
    statuses = {r.plugin.name: r.status for r in fresh_registry.reports()}
    assert statuses["late"] is LoadStatus.LOADED
    assert handler_of_cummax() == "deferred"  # the importer's rollback kept it


def test_late_builtins_are_neither_blamed_nor_rolled_back(registry_snapshot, site, fresh_registry, monkeypatch):
    # registry_snapshot (set up first, restored last) puts back the slot this late built-in took
    from physicsnemo_shardext.engine import baseline

    def late_handler(func, types, args, kwargs):
        return "late built-in"

    monkeypatch.setitem(baseline._late, ("_function_registry", torch.cummin), late_handler)
    module = "late_builtin_arrives_mod"
    writer = (
        "import torch\nfrom physicsnemo.domain_parallel import ShardTensor\n"
        "from physicsnemo_shardext.engine.baseline import _late\n"
        "ShardTensor._function_registry[torch.cummin] = _late[('_function_registry', torch.cummin)]\n"
    )
    install(site, "innocent-dist", "innocent", module, writer + "raise ImportError('later failure')\n")
    with pytest.warns(ShardextWarning) as caught:
        reports = load(site, fresh_registry)
    assert reports["innocent"].status is LoadStatus.FAILED
    assert not any("UndeclaredPatchError" in str(w.message) or "rolled back" in str(w.message) for w in caught)
    assert shard_registries.current_handler("function", torch.cummin) is late_handler  # kept by the undo


def test_a_plugin_importing_physicsnemo_nn_loads_cleanly(site, python_runner):
    """The real thing, in a fresh process: natten's built-ins and the afno plugin arrive inside its import."""
    install(site, "nn-dist", "nn-user", "nn_user_mod", "import physicsnemo.nn\n")
    install(site, "nn-fail-dist", "nn-fail", "nn_fail_mod", "import physicsnemo.nn\nraise ImportError('gives up')\n")
    code = (
        "import warnings, json\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import physicsnemo_shardext as s\n"
        "import physicsnemo.nn.functional.natten as natten\n"
        "from physicsnemo.nn.module.afno_layers import AFNO2DLayer\n"
        "r = {x.plugin.name: x.status.value for x in s.get_registry().reports()}\n"
        "print(json.dumps([r['nn-user'], r['nn-fail'], r['afno'], natten.na2d in s.shard_registries.snapshot()"
        ".as_dicts()['_function_registry'], hasattr(AFNO2DLayer.__dict__['forward'], '__wrapped__'),"
        " [str(w.message)[:200] for w in caught if 'Undeclared' in str(w.message)]]))\n"
    )
    result = python_runner(code, env={"CUDA_VISIBLE_DEVICES": ""}, path=[str(site)])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["loaded", "failed", "loaded", True, True, []]


# -- plugins that provide nothing as written: hooks without @hookimpl, no hooks at all ---------

FORGETFUL = """
import torch
from physicsnemo_shardext import hookimpl
def forgotten_handler(func, types, args, kwargs):
    return "forgotten"
{requirements}
def {name}(patches):                     # no @hookimpl: pluggy never calls it
    patches.function(torch.logcumsumexp, forgotten_handler)
"""

HOOKLESS = {
    "no-hook-at-all": ("import torch\n", "implements no hook: nothing in module {module} carries @hookimpl"),
    "requirements-only": (
        "from physicsnemo_shardext import hookimpl\n@hookimpl\ndef shardext_requirements():\n    return {}\n",
        "implements no shardext_declare_patches hook, so it can never declare a patch",
    ),
}


def shardext_warnings(caught, needle):
    return [str(w.message) for w in caught if issubclass(w.category, ShardextWarning) and needle in str(w.message)]


@pytest.mark.parametrize(
    ("name", "meant"),
    [("shardext_declare_patches", ""), ("shardext_declare_patch", " (a misspelling of shardext_declare_patches?)")],
)
def test_a_hook_function_without_hookimpl_warns_naming_plugin_version_and_function(
    site, fresh_registry, pristine_registries, name, meant
):
    from physicsnemo_shardext.tools.inventory import plugin_rows

    module = f"forgetful_{name}_mod"
    install(site, "forgetful-dist", "forgetful", module, FORGETFUL.format(name=name, requirements=""), version="0.4")
    install(site, "good-dist", "good", f"good_beside_{module}", GOOD.format(tag="g", priority=0))
    with pytest.warns(ShardextWarning) as caught:
        reports = load(site, fresh_registry)
    [message] = shardext_warnings(caught, "forgetful")
    assert message.startswith("plugin forgetful (forgetful-dist==0.4) provides nothing as written: ")
    assert f"{name}() is named like the shardext_declare_patches hook{meant} but lacks the @hookimpl marker" in message
    assert [w.filename for w in caught if "forgetful" in str(w.message)] == [__file__]  # points at the caller
    report = reports["forgetful"]
    assert (report.status, report.patches) == (LoadStatus.LOADED, 0)
    assert shard_registries.current_handler("function", torch.logcumsumexp) is None  # the unmarked hook never ran
    [row] = [r for r in plugin_rows(fresh_registry) if r["plugin"] == "forgetful"]
    assert len(row["problems"]) == 1 and "lacks the @hookimpl marker" in row["problems"][0]
    assert not shardext_warnings(caught, "good-dist") and reports["good"].extra.get("problems") is None


def test_an_unmarked_requirements_hook_is_named_beside_working_hooks(site, fresh_registry):
    # Unmarked, shardext_requirements is never asked: the plugin would load on versions it refuses.
    requirements = "def shardext_requirements():\n    return {'nvidia-physicsnemo': '>=99'}\n@hookimpl"
    source = FORGETFUL.format(name="shardext_declare_patches", requirements=requirements)
    install(site, "half-marked-dist", "half-marked", "half_marked_mod", source)
    with pytest.warns(
        ShardextWarning, match=r"half-marked-dist==1.0\) provides nothing as written: shardext_requirements\(\)"
    ):
        report = load(site, fresh_registry)["half-marked"]
    assert (report.status, report.patches) == (LoadStatus.LOADED, 1)  # its marked hook did run
    assert [p.split("()")[0] for p in report.extra["problems"]] == ["shardext_requirements"]


@pytest.mark.parametrize("case", sorted(HOOKLESS))
def test_a_plugin_implementing_no_useful_hook_warns(site, fresh_registry, case):
    source, expected = HOOKLESS[case]
    module = f"hookless_{case.replace('-', '_')}_mod"
    install(site, "hookless-dist", "hookless", module, source, version="2.1")
    with pytest.warns(ShardextWarning, match=r"plugin hookless \(hookless-dist==2.1\) provides nothing as written"):
        report = load(site, fresh_registry)["hookless"]
    assert report.status is LoadStatus.LOADED and report.patches == 0
    assert report.extra["problems"] == [
        next(p for p in report.extra["problems"] if expected.format(module=module) in p)
    ]


@pytest.mark.parametrize("case", ["unmarked", "no-hook-at-all"])
def test_hooks_that_provide_nothing_are_fatal_in_strict_mode(site, fresh_registry, pristine_registries, case):
    from physicsnemo_shardext.errors import PluginHookError

    source = (
        FORGETFUL.format(name="shardext_declare_patches", requirements="") if case == "unmarked" else HOOKLESS[case][0]
    )
    install(site, "inert-dist", "inert", f"inert_{case.replace('-', '_')}_mod", source, version="0.7")
    with pytest.raises(
        PluginLoadError, match=r"'inert' from inert-dist==0.7 failed during hook check: PluginHookError"
    ) as error:
        load(site, fresh_registry, strict=True)
    assert (error.value.plugin, error.value.stage) == ("inert", "hook check")
    assert isinstance(error.value.cause, PluginHookError) and error.value.cause.problems
    assert fresh_registry.plugins() == [] and shard_registries.snapshot() == pristine_registries


GATED = """
import torch
from physicsnemo_shardext import hookimpl
def h(func, types, args, kwargs): ...
@hookimpl
def shardext_declare_patches(patches):
    if not hasattr(torch, "no_such_feature_zz"):   # this torch lacks what the patch is for
        return
    patches.function(torch.logcumsumexp, h)
"""


def test_declaring_nothing_on_this_setup_is_not_a_problem(site, fresh_registry, recwarn):
    from physicsnemo_shardext.tools.cli import plugin_health
    from physicsnemo_shardext.tools.inventory import plugin_rows

    install(site, "gated-dist", "gated", "gated_mod", GATED)
    install(site, "future-dist", "future", "future_gated_mod", BROKEN["incompatible"])
    reports = load(site, fresh_registry, strict=False)
    assert (reports["gated"].status, reports["gated"].patches) == (LoadStatus.LOADED, 0)
    assert reports["future"].status is LoadStatus.INCOMPATIBLE
    assert not [w for w in recwarn if "provides nothing" in str(w.message)]
    rows = {r["plugin"]: r for r in plugin_rows(fresh_registry)}
    assert rows["gated"]["problems"] == [] and rows["future"]["problems"] == []
    assert [note.split(":")[0] for note in plugin_health(rows["gated"])] == ["note"]  # shown, not as a PROBLEM
    gated = [ep for ep in entry_points_in(site) if ep.name == "gated"]
    strict = PluginLoader(fresh_registry.__class__(), Settings(strict=True)).load_entry_points(gated)
    assert [r.status for r in strict] == [LoadStatus.LOADED]  # strict mode: fine too


def test_no_installed_plugin_is_reported_as_providing_nothing():
    import physicsnemo_shardext

    reports = physicsnemo_shardext.get_registry().reports()
    assert reports and all(not r.extra.get("problems") for r in reports), [r.plugin.name for r in reports]


def test_a_plugin_object_with_marked_methods_has_no_problem(fresh_registry):
    from physicsnemo_shardext import hookimpl
    from physicsnemo_shardext.engine.provenance import PluginInfo

    class Plugin:
        @hookimpl
        def shardext_declare_patches(self, patches):
            patches.function(torch.logcumsumexp, lambda func, types, args, kwargs: None)

    report = PluginLoader(fresh_registry, Settings(strict=True)).load_plugin(Plugin(), PluginInfo("object"))
    assert (report.status, report.patches, report.extra.get("problems")) == (LoadStatus.LOADED, 1, None)


# -- load time: slow plugins are named ---------------------------------------------------------

SLOW = "import time\ntime.sleep({seconds})\n" + GOOD


def test_a_slow_plugin_is_named_with_its_load_time(site, fresh_registry):
    install(site, "slow-dist", "slow", "slow_mod", SLOW.format(seconds=0.5, tag="s", priority=0), version="3.0")
    install(site, "quick-dist", "quick", "quick_mod", VICTIM)
    with pytest.warns(
        ShardextWarning,
        match=r"plugin slow \(slow-dist==3.0\) took 0\.\d s to load \(its import and "
        r"hooks; SHARDEXT_SLOW_PLUGIN_SECONDS=0.3\)",
    ) as caught:
        reports = load(site, fresh_registry, slow_plugin_seconds=0.3)
    assert not shardext_warnings(caught, "quick-dist")
    slow, quick = reports["slow"].extra, reports["quick"].extra
    assert slow["load_seconds"] >= 0.5 and slow["slow"] is True
    assert 0 <= quick["load_seconds"] < 0.3 and quick["slow"] is False
    assert reports["slow"].status is LoadStatus.LOADED


def test_a_slow_plugin_is_not_fatal_in_strict_mode_and_the_warning_can_be_switched_off(site, fresh_registry, recwarn):
    install(site, "slow-dist", "slow", "slow_strict_mod", SLOW.format(seconds=0.3, tag="s", priority=0))
    with pytest.warns(ShardextWarning, match="took 0.3 s to load"):
        assert load(site, fresh_registry, strict=True, slow_plugin_seconds=0.1)["slow"].status is LoadStatus.LOADED
    fresh_registry.remove_all()
    install(site, "slow-dist", "slow2", "slow_off_mod", SLOW.format(seconds=0.3, tag="s", priority=0))
    recwarn.clear()
    report = PluginLoader(fresh_registry, Settings(slow_plugin_seconds=None)).load_entry_points(
        [ep for ep in entry_points_in(site) if ep.name == "slow2"]
    )[0]
    assert report.extra["load_seconds"] >= 0.3 and report.extra["slow"] is False
    assert not [w for w in recwarn if "to load" in str(w.message)]


def test_a_failed_plugin_has_its_load_time_too(site, fresh_registry):
    install(
        site, "late-fail-dist", "late-fail", "late_fail_mod", "import time\ntime.sleep(0.2)\nraise ImportError('x')\n"
    )
    with pytest.warns(ShardextWarning, match="failed during import"):
        report = load(site, fresh_registry)["late-fail"]
    assert report.status is LoadStatus.FAILED and report.extra["load_seconds"] >= 0.2


def test_a_deferred_plugin_loading_inside_another_import_is_timed_apart(site, fresh_registry, awaited):
    module = awaited()
    body = "import time\n    time.sleep(0.5)"
    install(site, "late-dist", "late", "late_mod_timed", deferred_source([module], body))
    load(site, fresh_registry, slow_plugin_seconds=0.4)  # the loader that defers it loads it later
    install(site, "importer-dist", "importer", "importer_timed_mod", f"import {module}\n")
    with pytest.warns(ShardextWarning, match=r"plugin late \(late-dist==1.0\) took 0\.\d s"):
        reports = load(site, fresh_registry, slow_plugin_seconds=0.4)
    late = next(r for r in fresh_registry.reports() if r.plugin.name == "late")
    assert late.status is LoadStatus.LOADED and late.extra["load_seconds"] >= 0.5
    assert reports["importer"].extra["load_seconds"] < 0.4  # the nested load is not the importer's time


# -- re-entrancy: a plugin that loads plugins from its own load --------------------------------

GREEDY = """
import types
import torch
import physicsnemo_shardext
from physicsnemo_shardext import hookimpl
def greedy_handler(func, types, args, kwargs):
    return "greedy"
if {at_import}:
    RESULT = {call}
@hookimpl
def shardext_declare_patches(patches):
    if not {at_import}:
        global RESULT
        RESULT = {call}
    patches.function(torch.logcumsumexp, greedy_handler)
"""

NESTED_CALLS = {
    "load_plugins": "physicsnemo_shardext.load_plugins()",
    "load_plugin": "physicsnemo_shardext.load_plugin(types.ModuleType('sub'), 'sub')",
}


def described(snapshot):
    from physicsnemo_shardext.targets import describe_handler, describe_target

    return {
        (c.table, describe_target(c.key) if c.key is not None else None, describe_handler(c.after)) for c in snapshot
    }


@pytest.mark.parametrize("at_import", [True, False], ids=["import", "hook"])
@pytest.mark.parametrize("call", sorted(NESTED_CALLS))
def test_loading_plugins_from_a_plugins_load_is_refused_and_the_outer_load_completes(
    site, fresh_registry, pristine_registries, call, at_import
):
    import physicsnemo_shardext

    module = f"greedy_{call}_{at_import}_mod"
    install(site, "good-dist", "good", f"good_before_{module}", GOOD.format(tag="g", priority=0))
    install(
        site,
        "greedy-dist",
        "greedy",
        module,
        GREEDY.format(at_import=at_import, call=NESTED_CALLS[call]),
        version="0.8",
    )
    install(site, "victim-dist", "victim", f"victim_after_{module}", VICTIM)
    global_registry = physicsnemo_shardext.get_registry()
    global_reports = global_registry.reports()
    with (
        global_registry.sandbox(),
        pytest.warns(
            ShardextWarning,
            match=rf"{call}\(.*\) was called while plugin 'greedy' from greedy-dist==0.8 "
            rf"was being loaded \(during {'its import' if at_import else 'shardext_declare_patches'}\)",
        ) as caught,
    ):
        reports = load(site, fresh_registry)
        nested_reports = [r for r in global_registry.reports() if r not in global_reports]
        after = shard_registries.snapshot()
    assert [w.filename for w in caught if "was called while" in str(w.message)] == [str(site / f"{module}.py")]
    assert {name: (r.status, r.patches) for name, r in reports.items()} == {
        "good": (LoadStatus.LOADED, 2),
        "greedy": (LoadStatus.LOADED, 1),
        "victim": (LoadStatus.LOADED, 1),
    }
    # Exactly what the three plugins declare, every handler live: nothing lost, nothing else added.
    assert described(pristine_registries.changes(after)) == {
        ("_function_registry", "torch.roll", f"good_before_{module}.roll_handler"),
        ("_function_registry", "torch.flip", f"good_before_{module}.roll_handler"),
        ("_function_registry", "torch.logcumsumexp", f"{module}.greedy_handler"),
        ("_function_registry", "torch.cumsum", f"victim_after_{module}.victim_handler"),
    }
    result = sys.modules[module].RESULT
    if call == "load_plugins":
        assert result == [] and nested_reports == []  # the nested call loaded nothing
    else:  # refused, and said so where doctor looks
        assert (result.status, result.stage) == (LoadStatus.FAILED, "nested load") and "'greedy'" in result.reason
        assert nested_reports == [result]


def test_a_nested_load_is_fatal_in_strict_mode(site, fresh_registry, pristine_registries, monkeypatch):
    from physicsnemo_shardext.errors import ReentrantLoadError

    monkeypatch.setenv("SHARDEXT_STRICT", "1")  # what the nested load_plugins() reads
    install(
        site,
        "greedy-dist",
        "greedy",
        "greedy_strict_mod",
        GREEDY.format(at_import=True, call=NESTED_CALLS["load_plugins"]),
        version="0.8",
    )
    with pytest.raises(
        PluginLoadError,
        match=r"'greedy' from greedy-dist==0.8 failed during import: "
        r"ReentrantLoadError: load_plugins\(\) was called while plugin 'greedy'",
    ) as error:
        load(site, fresh_registry, strict=True)
    assert isinstance(error.value.cause, ReentrantLoadError) and error.value.cause.plugin == "greedy"
    assert fresh_registry.plugins() == [] and shard_registries.snapshot() == pristine_registries


REGISTRY_PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import physicsnemo_shardext as s
from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.targets import describe_handler, describe_target
tables = shard_registries.snapshot().as_dicts()
print(json.dumps({
    "tables": {t: sorted(f"{describe_target(k)} -> {describe_handler(v)}" for k, v in items.items())
               for t, items in tables.items() if t != "attributes"},
    "attributes": sorted(describe_target(k) for k in tables.get("attributes", {})),
    "reports": sorted([r.plugin.name, r.status.value, r.patches] for r in s.get_registry().reports()),
    "nested": [str(w.message) for w in caught if "was called while" in str(w.message)],
}))
"""


def test_registries_after_autoload_with_a_greedy_plugin_equal_a_normal_load(tmp_path, python_runner):
    """The real thing, in fresh processes: the same plugin with and without a nested load_plugins() at import."""
    runs = {}
    for greedy in (False, True):
        folder = tmp_path / str(greedy)
        call = NESTED_CALLS["load_plugins"] if greedy else "None"
        write_plugin_distribution(
            folder,
            "greedy-dist",
            "0.8",
            {"greedy": "greedy_probe_mod"},
            {"greedy_probe_mod": GREEDY.format(at_import=True, call=call)},
        )
        result = python_runner(REGISTRY_PROBE, env={"CUDA_VISIBLE_DEVICES": ""}, path=[str(folder)])
        assert result.returncode == 0, result.stderr
        runs[greedy] = json.loads(result.stdout.strip().splitlines()[-1])
    normal, greedy = runs[False], runs[True]
    assert greedy["tables"] == normal["tables"] and greedy["attributes"] == normal["attributes"]
    assert greedy["reports"] == normal["reports"] and ["greedy", "loaded", 1] in greedy["reports"]
    assert "torch.logcumsumexp -> greedy_probe_mod.greedy_handler" in greedy["tables"]["_function_registry"]
    assert (
        normal["nested"] == []
        and len(greedy["nested"]) == 1
        and "'greedy' from greedy-dist==0.8" in greedy["nested"][0]
    )
