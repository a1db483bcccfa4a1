"""Tests of physicsnemo_shardext.engine.registry: install, provenance, overrides, conflicts, undo."""

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import (
    InvalidPatchDeclaration,
    PatchConflictError,
    PatchSet,
    ShardextWarning,
    builtin_handler,
    shard_registries,
)
from physicsnemo_shardext.engine.provenance import PluginInfo
from physicsnemo_shardext.engine.registry import PatchRegistry
from physicsnemo_shardext.shard_registries import PatchLevel


def make_handler(tag):
    def handler(func, types, args, kwargs):
        return tag

    handler.__qualname__ = f"handler_{tag}"
    return handler


def declare(name, *targets, priority=0, override=False, handler=None):
    patches = PatchSet(name)
    for target in targets:
        patches.function(target, handler or make_handler(name), priority=priority, override=override)
    return PluginInfo(name, distribution=f"{name}-dist", version="1.0"), list(patches)


def current(target, level=PatchLevel.FUNCTION):
    return shard_registries.current_handler(level, target)


def test_install_records_provenance(fresh_registry):
    info, declarations = declare("alpha", torch.roll, priority=4)
    fresh_registry.add_plugin(info, declarations)
    assert current(torch.roll) is declarations[0].handler  # no wrapper on the hot path
    record = fresh_registry.provenance(torch.roll)
    assert record.plugin == info and record.declaration.priority == 4
    assert record.replaced is None and not record.overrides_builtin


def test_priority_is_independent_of_install_order(pristine_registries):
    plugins = [declare("low", torch.roll, priority=1), declare("high", torch.roll, priority=9)]
    for order in itertools.permutations(plugins):
        registry = PatchRegistry()
        for info, declarations in order:
            registry.add_plugin(info, declarations)
        assert current(torch.roll)(None, None, None, None) == "high"
        assert registry.provenance(torch.roll).shadowed == ("low",)
        registry.remove_all()
        assert shard_registries.snapshot() == pristine_registries


def test_equal_priority_conflict_installs_neither_and_warns(fresh_registry):
    fresh_registry.add_plugin(*declare("one", torch.roll))
    with pytest.warns(ShardextWarning, match="'one' and 'two'"):
        fresh_registry.add_plugin(*declare("two", torch.roll))
    assert current(torch.roll) is None
    assert fresh_registry.conflicts()[0].providers == ("one", "two")


def test_conflict_is_an_error_in_strict_mode_and_changes_nothing(pristine_registries):
    registry = PatchRegistry(strict=True)
    registry.add_plugin(*declare("one", torch.roll, torch.flip))
    before = shard_registries.snapshot()
    with pytest.raises(PatchConflictError, match="'one' and 'two'"):
        registry.add_plugin(*declare("two", torch.roll, torch.cumsum))
    assert shard_registries.snapshot() == before
    assert [p.name for p in registry.plugins()] == ["one"]


def test_conflict_resolved_by_preference(pristine_registries):
    registry = PatchRegistry(prefer=("two-dist",))
    registry.add_plugin(*declare("one", torch.roll))
    registry.add_plugin(*declare("two", torch.roll))
    assert current(torch.roll)(None, None, None, None) == "two"
    assert registry.conflicts()[0].resolved_by == "SHARDEXT_PREFER"


def test_user_resolves_conflict_later_with_set_prefer(fresh_registry):
    fresh_registry.add_plugin(*declare("one", torch.roll))
    with pytest.warns(ShardextWarning):
        fresh_registry.add_plugin(*declare("two", torch.roll))
    assert current(torch.roll) is None
    fresh_registry.set_prefer(["one"])
    assert current(torch.roll)(None, None, None, None) == "one"


def test_replacing_a_builtin_requires_override(fresh_registry, pristine_registries):
    with pytest.raises(InvalidPatchDeclaration, match="override=True") as error:
        fresh_registry.add_plugin(*declare("sneaky", torch.roll, F.interpolate))
    assert "sneaky" in str(error.value) and "interpolate" in str(error.value)
    assert shard_registries.snapshot() == pristine_registries


def test_override_of_builtin_warns_once_and_can_delegate(fresh_registry, pristine_registries):
    builtin = builtin_handler(F.interpolate)
    assert builtin is not None

    def delegating(func, types, args, kwargs):
        return ("delegated", builtin)

    info, declarations = declare("better-interp", F.interpolate, override=True, handler=delegating)
    with pytest.warns(ShardextWarning, match="overrides PhysicsNeMo's built-in"):
        fresh_registry.add_plugin(info, declarations)
    record = fresh_registry.provenance(F.interpolate)
    assert record.overrides_builtin and record.replaced is builtin
    assert current(F.interpolate)(None, None, None, None) == ("delegated", builtin)
    assert fresh_registry.prior_handler(F.interpolate) is builtin
    fresh_registry.remove_plugin("better-interp")
    assert current(F.interpolate) is builtin
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardextWarning)
        fresh_registry.add_plugin(PluginInfo("quiet"), [])  # no further override warning


def test_remove_plugin_falls_back_to_next_claimant(fresh_registry):
    fresh_registry.add_plugin(*declare("low", torch.roll, priority=1))
    fresh_registry.add_plugin(*declare("high", torch.roll, priority=2))
    fresh_registry.remove_plugin("high")
    assert current(torch.roll)(None, None, None, None) == "low"


def test_remove_all_restores_all_four_registries_exactly(fresh_registry, pristine_registries):
    patches = PatchSet("everything")
    patches.function(torch.roll, make_handler("f"))
    patches.function(F.interpolate, make_handler("o"), override=True)
    patches.dispatch(torch.ops.aten.roll.default, lambda *a, **k: None)
    patches.dispatch(torch.ops.aten.view.default, lambda *a, **k: None, override=True)
    patches.named("aten.flip.default", make_handler("n"))
    with pytest.warns(ShardextWarning):
        fresh_registry.add_plugin(PluginInfo("everything"), list(patches))
    assert shard_registries.snapshot() != pristine_registries
    fresh_registry.remove_all()
    assert shard_registries.snapshot() == pristine_registries


def test_disabled_context_restores_on_exception(fresh_registry):
    info, declarations = declare("alpha", torch.roll, torch.flip)
    fresh_registry.add_plugin(info, declarations)
    installed = shard_registries.snapshot()
    with pytest.raises(RuntimeError, match="boom"):
        with fresh_registry.disabled(plugins=["alpha-dist"]):
            assert current(torch.roll) is None and current(torch.flip) is None
            raise RuntimeError("boom")
    assert shard_registries.snapshot() == installed


def test_disabled_target_removes_builtin_for_dtensor_fallback(fresh_registry):
    builtin = current(F.interpolate)
    with fresh_registry.disabled(targets=[F.interpolate]):
        assert current(F.interpolate) is None
    assert current(F.interpolate) is builtin


def test_sandbox_restores_registry_and_shardtensor(fresh_registry, pristine_registries):
    with fresh_registry.sandbox():
        fresh_registry.add_plugin(*declare("temp", torch.roll))
        assert current(torch.roll) is not None
    assert fresh_registry.plugins() == [] and shard_registries.snapshot() == pristine_registries


def test_trace_mode_wraps_and_logs(fresh_registry, caplog):
    info, declarations = declare("traced", torch.roll)
    fresh_registry.add_plugin(info, declarations)
    fresh_registry.set_trace(True)
    wrapped = current(torch.roll)
    assert wrapped is not declarations[0].handler and wrapped.__wrapped__ is declarations[0].handler
    with caplog.at_level("INFO", logger="physicsnemo_shardext.engine.trace"):
        assert wrapped(None, None, None, None) == "traced"
    assert "torch.roll -> " in caplog.text and "traced (traced-dist==1.0)" in caplog.text
    fresh_registry.set_trace(False)
    assert current(torch.roll) is declarations[0].handler


def test_duplicate_plugin_name_is_refused(fresh_registry):
    fresh_registry.add_plugin(*declare("same", torch.roll))
    with pytest.raises(InvalidPatchDeclaration, match="already loaded, from same-dist"):
        fresh_registry.add_plugin(*declare("same", torch.flip))


def test_reports_are_kept_per_distribution_and_name(fresh_registry):
    from physicsnemo_shardext.engine.provenance import LoadStatus, PluginReport

    mine, theirs = PluginInfo("same", "mine-dist", "1"), PluginInfo("same", "theirs-dist", "1")
    fresh_registry.record_report(PluginReport(theirs, LoadStatus.FAILED, "refused"))
    fresh_registry.record_report(PluginReport(mine, LoadStatus.FAILED, "first try"))
    fresh_registry.record_report(PluginReport(mine, LoadStatus.LOADED))  # same identity: replaces
    assert [(r.plugin.distribution, r.status) for r in fresh_registry.reports()] == [
        ("mine-dist", LoadStatus.LOADED),
        ("theirs-dist", LoadStatus.FAILED),
    ]


class _Owner:
    @staticmethod
    def backward(ctx, grad):
        return grad


def _attribute_fix(name, factor, priority=0):
    patches = PatchSet(name)
    patches.replace_attribute(
        _Owner, "backward", staticmethod(lambda ctx, grad: factor * grad), reason=f"x{factor}", priority=priority
    )
    return PluginInfo(name, distribution=f"{name}-dist", version="1.0"), list(patches)


def test_attribute_replacement_provenance_conflicts_and_undo(fresh_registry, pristine_registries):
    original = _Owner.__dict__["backward"]
    fresh_registry.add_plugin(*_attribute_fix("fix-a", 2))
    assert _Owner.backward(None, 1) == 2
    (record,) = [p for p in fresh_registry.installed() if p.declaration.level is PatchLevel.ATTRIBUTE]
    assert record.plugin.name == "fix-a" and record.replaced is original and record.overrides_builtin is False
    with pytest.warns(ShardextWarning, match="neither handler"):
        fresh_registry.add_plugin(*_attribute_fix("fix-b", 3))  # equal priority: conflict, original back
    assert _Owner.__dict__["backward"] is original
    fresh_registry.remove_plugin("fix-b")
    assert _Owner.backward(None, 1) == 2
    with fresh_registry.disabled(plugins=["fix-a"]):
        assert _Owner.__dict__["backward"] is original
    from physicsnemo_shardext import AttributeTarget

    with fresh_registry.disabled(targets=[AttributeTarget(_Owner, "backward")]):
        assert _Owner.__dict__["backward"] is original  # an attribute target "falls back" to its original
    assert _Owner.backward(None, 1) == 2
    with fresh_registry.sandbox():
        fresh_registry.add_plugin(*_attribute_fix("fix-c", 5, priority=1))
        assert _Owner.backward(None, 1) == 5
    assert _Owner.backward(None, 1) == 2
    fresh_registry.remove_all()
    assert _Owner.__dict__["backward"] is original and shard_registries.snapshot() == pristine_registries


def test_first_party_override_is_not_warned_about_but_recorded(fresh_registry, pristine_registries):
    info, declarations = declare("first-party-interp", F.interpolate, override=True)
    first_party = PluginInfo(info.name, "physicsnemo-shardext", "0.1.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardextWarning)
        fresh_registry.add_plugin(first_party, declarations)
    assert fresh_registry.provenance(F.interpolate).overrides_builtin


def test_disabled_accepts_a_renamed_plugins_old_name():
    import physicsnemo_shardext

    registry = physicsnemo_shardext.get_registry()
    record = registry.provenance(torch.Tensor.permute)
    assert record is not None and record.plugin.name == "layout_ops"
    with physicsnemo_shardext.disabled(plugins=["misc_ops"]):
        inside = registry.provenance(torch.Tensor.permute)
        assert inside is None or inside.plugin.name != "layout_ops"
    assert registry.provenance(torch.Tensor.permute).plugin.name == "layout_ops"


def test_old_name_in_shardext_disable_leaves_the_renamed_plugin_uninstalled(python_runner):
    code = (
        "import physicsnemo_shardext as s\n"
        "print(sorted(r.plugin.name for r in s.get_registry().reports() if r.status.value == 'loaded'))\n"
    )
    result = python_runner(code, env={"SHARDEXT_DISABLE": "spectral"})
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.strip().splitlines()[-1]
    assert "'indexing_einsum'" not in loaded and "'fft'" in loaded, loaded


# -- torch aliases (physicsnemo_shardext.engine.aliases) ---------------------------------------------------------------------
def test_a_declaration_covers_the_torch_aliases_of_its_target(fresh_registry, pristine_registries):
    info, declarations = declare("alpha", torch.cat, torch.Tensor.transpose)
    fresh_registry.add_plugin(info, declarations)
    cat, transpose = (d.handler for d in declarations)
    assert current(torch.concat) is current(torch.concatenate) is cat
    assert current(torch.Tensor.swapaxes) is current(torch.Tensor.swapdims) is transpose
    assert current(torch.swapaxes) is None  # the function form is another op than the method form
    record = fresh_registry.provenance(torch.concatenate)
    assert (record.plugin, record.declaration.alias_of, record.declaration.description) == (
        info,
        torch.cat,
        "alias of torch.cat",
    )
    fresh_registry.remove_all()
    assert shard_registries.snapshot() == pristine_registries


def test_an_explicit_declaration_of_an_alias_beats_an_implied_one(fresh_registry):
    fresh_registry.add_plugin(*declare("cats", torch.cat, priority=9))
    fresh_registry.add_plugin(*declare("concats", torch.concat))
    assert current(torch.concat)(None, None, None, None) == "concats"  # declared, whatever the priority
    assert current(torch.concatenate)(None, None, None, None) == "cats"
    assert fresh_registry.provenance(torch.concat).declaration.alias_of is None
    assert not fresh_registry.conflicts()
    fresh_registry.remove_plugin("concats")
    assert current(torch.concat)(None, None, None, None) == "cats"


def test_one_plugin_declaring_two_names_of_an_op_prefers_the_canonical(fresh_registry):
    patches = PatchSet("both")
    patches.function(torch.concat, make_handler("concat"))
    patches.function(torch.cat, make_handler("cat"))
    fresh_registry.add_plugin(PluginInfo("both"), list(patches))
    assert current(torch.concatenate)(None, None, None, None) == "cat"
    assert not fresh_registry.conflicts()


def test_plugins_meeting_on_an_alias_conflict_there_as_documented(fresh_registry):
    fresh_registry.add_plugin(*declare("cats", torch.cat))
    with pytest.warns(ShardextWarning, match="torch.concatenate"):
        fresh_registry.add_plugin(*declare("concats", torch.concat))
    assert current(torch.concatenate) is None  # an unresolved tie installs neither
    assert [(c.target, c.providers) for c in fresh_registry.conflicts()] == [("torch.concatenate", ("cats", "concats"))]
    fresh_registry.set_prefer(["concats"])
    assert current(torch.concatenate)(None, None, None, None) == "concats"


def test_an_alias_slot_holding_a_handler_needs_override(fresh_registry, pristine_registries):
    existing = make_handler("existing")
    ShardTensor._function_registry[torch.concat] = existing
    fresh_registry.add_plugin(*declare("quiet", torch.cat))
    assert current(torch.concat) is existing and current(torch.concatenate)(None, None, None, None) == "quiet"
    fresh_registry.add_plugin(*declare("loud", torch.cat, priority=1, override=True))
    assert current(torch.concat)(None, None, None, None) == "loud"
    assert fresh_registry.provenance(torch.concat).replaced is existing
    fresh_registry.remove_all()
    assert current(torch.concat) is existing


def test_disabling_a_target_disables_its_aliases(fresh_registry):
    fresh_registry.add_plugin(*declare("alpha", torch.cat))
    with fresh_registry.disabled(targets=[torch.cat]):
        assert current(torch.cat) is current(torch.concat) is current(torch.concatenate) is None
    assert current(torch.concat)(None, None, None, None) == "alpha"


def test_a_one_way_alias_follows_its_canonical_op_only(fresh_registry):
    fresh_registry.add_plugin(*declare("maxes", torch.max))
    fresh_registry.add_plugin(*declare("minimums", torch.minimum))
    assert current(torch.maximum)(None, None, None, None) == "maxes"
    assert current(torch.min) is None  # torch.min(x, dim) is no minimum


def _fake_builtin(func, types, args, kwargs):
    """What a newer PhysicsNeMo would register."""
    return "fake built-in"


def test_first_party_handlers_step_aside_for_a_new_builtin(fresh_registry, pristine_registries):
    from physicsnemo_shardext.patches import roll_flip

    shard_registries.set_handler(PatchLevel.FUNCTION, torch.roll, _fake_builtin)  # upstream drift
    patches = PatchSet("roll_flip")
    roll_flip.shardext_declare_patches(patches)
    first_party = PluginInfo("roll_flip", "physicsnemo-shardext", "0.1.0")
    yielded = dict(fresh_registry.add_plugin(first_party, list(patches)))
    assert set(yielded) == {"torch.roll"} and "stepped aside" in yielded["torch.roll"]
    assert current(torch.roll) is _fake_builtin  # the built-in is used ...
    assert current(torch.flip) is roll_flip.sharded_flip  # ... and the plugin's other slots are installed
    fresh_registry.remove_plugin("roll_flip")
    assert current(torch.roll) is _fake_builtin and current(torch.flip) is None


def test_a_third_party_plugin_meeting_a_new_builtin_still_needs_override(fresh_registry, pristine_registries):
    shard_registries.set_handler(PatchLevel.FUNCTION, torch.roll, _fake_builtin)
    before = shard_registries.snapshot()
    with pytest.raises(InvalidPatchDeclaration, match="override=True"):
        fresh_registry.add_plugin(*declare("third-party-roll", torch.roll, torch.flip))
    assert shard_registries.snapshot() == before


def test_an_override_declared_first_party_handler_keeps_its_slot(fresh_registry, pristine_registries):
    shard_registries.set_handler(PatchLevel.FUNCTION, torch.roll, _fake_builtin)
    info, declarations = declare("first-party-roll", torch.roll, override=True)
    assert fresh_registry.add_plugin(PluginInfo(info.name, "physicsnemo-shardext", "0.1.0"), declarations) == []
    assert current(torch.roll) is not _fake_builtin
    assert fresh_registry.prior_handler(torch.roll) is _fake_builtin
