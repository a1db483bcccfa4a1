"""Tests of physicsnemo_shardext.declarations."""

import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_shardext import InvalidPatchDeclaration, PatchSet
from physicsnemo_shardext.shard_registries import PatchLevel


def handler(func, types, args, kwargs):
    """Roll the local block."""


def test_declarations_are_collected_with_their_options():
    patches = PatchSet("demo")
    patches.function(torch.roll, handler, priority=3)
    patches.dispatch(torch.ops.aten.roll.default, lambda *a, **k: None, override=True)
    patches.declare(F.gelu, handler)
    declared = {(d.target_name, d.level, d.priority, d.override) for d in patches}
    assert declared == {
        ("torch.roll", PatchLevel.FUNCTION, 3, False),
        ("aten.roll.default", PatchLevel.DISPATCH, 0, True),
        ("torch.nn.functional.gelu", PatchLevel.FUNCTION, 0, False),
    }
    assert next(iter(patches)).description == "Roll the local block."


@pytest.mark.parametrize(
    ("declare", "message"),
    [
        (lambda p: p.function(torch.roll, "not callable"), "handler must be callable"),
        (lambda p: p.function(torch.roll, lambda x: None), "cannot take those arguments"),
        (lambda p: p.dispatch(torch.roll, handler), "OpOverload"),
        (lambda p: p.dispatch(torch.ops.aten.roll, handler), "for aten.roll: aten.roll is an overload packet"),
        (lambda p: p.named("nosuch.op.default", handler), "no op named"),
        (lambda p: p.function("torch.no_such_function", handler), "no importable object"),
        (lambda p: p.function(torch.roll, handler, priority="high"), "priority must be an int"),
    ],
)
def test_invalid_declarations_name_plugin_and_target(declare, message):
    patches = PatchSet("bad-plugin")
    with pytest.raises(InvalidPatchDeclaration, match=message) as error:
        declare(patches)
    assert "bad-plugin" in str(error.value)
    assert len(patches) == 0


def test_duplicate_declaration_in_one_plugin_is_refused():
    patches = PatchSet("dup")
    patches.function(torch.roll, handler)
    with pytest.raises(InvalidPatchDeclaration, match="declared twice"):
        patches.function("torch.roll", handler)


class _Owner:
    @staticmethod
    def backward(ctx, grad):
        return grad


def test_replace_attribute_is_validated_and_can_be_not_applicable():
    from physicsnemo_shardext.shard_registries import AttributeTarget, PatchLevel

    patches = PatchSet("fix")
    fixed = staticmethod(lambda ctx, grad: 2 * grad)
    assert patches.replace_attribute(_Owner, "backward", fixed, reason="doubles", applies=lambda: True)
    (declaration,) = list(patches)
    assert declaration.level is PatchLevel.ATTRIBUTE and declaration.target == AttributeTarget(_Owner, "backward")
    assert declaration.description == "doubles" and declaration.target_name.endswith("_Owner.backward")
    skipped = PatchSet("fix")
    assert not skipped.replace_attribute(_Owner, "backward", fixed, reason="doubles", applies=lambda: False)
    assert len(skipped) == 0 and skipped.not_applicable[0][1] == "doubles"
    for bad, message in (
        (lambda p: p.replace_attribute(_Owner, "missing", fixed, reason="x"), "does not exist"),
        (lambda p: p.replace_attribute(_Owner, "backward", fixed, reason=" "), "reason"),
        (lambda p: p.replace_attribute(object(), "backward", fixed, reason="x"), "class or a module"),
        (lambda p: p.replace_attribute(_Owner, "backward", fixed, reason="x", applies=lambda: 1 / 0), "applies"),
    ):
        with pytest.raises(InvalidPatchDeclaration, match=message):
            bad(PatchSet("fix"))


# -- custom ops: one declaration, in any form, covers every call form -----------------------


@torch.library.custom_op("shardext_test::declarations_affine", mutates_args=())
def affine(x: torch.Tensor) -> torch.Tensor:
    """``2 x + 1``: pointwise, so a handler may run it on each rank's local block."""
    return 2 * x + 1


#: The four forms a plugin author may name a custom op by (by key, so multirank params pickle).
OP_FORMS = {
    "custom_op_def": lambda: affine,
    "packet": lambda: torch.ops.shardext_test.declarations_affine,
    "overload": lambda: torch.ops.shardext_test.declarations_affine.default,
    "qualified_name": lambda: "shardext_test::declarations_affine",
}
#: The three ways of calling it.
CALL_FORMS = {
    "custom_op_def": lambda: affine,
    "packet": lambda: torch.ops.shardext_test.declarations_affine,
    "overload": lambda: torch.ops.shardext_test.declarations_affine.default,
}
OVERLOAD, PACKET = "shardext_test.declarations_affine.default", "shardext_test.declarations_affine"


@pytest.mark.parametrize("form", sorted(OP_FORMS))
@pytest.mark.parametrize("method", ["named", "declare", "function"])
def test_every_custom_op_form_declares_one_named_slot(form, method):
    patches = PatchSet("forms")
    getattr(patches, method)(OP_FORMS[form](), handler)
    (declaration,) = list(patches)
    assert declaration.key == (PatchLevel.NAMED, OVERLOAD) and declaration.target_name == OVERLOAD
    assert declaration.slots == ((PatchLevel.NAMED, OVERLOAD), (PatchLevel.NAMED, PACKET))


def test_two_forms_of_one_custom_op_are_a_duplicate():
    patches = PatchSet("dup")
    patches.named(affine, handler)
    with pytest.raises(InvalidPatchDeclaration, match=f"for {OVERLOAD}: declared twice"):
        patches.named("shardext_test::declarations_affine", handler)


def test_custom_op_handler_is_installed_under_both_names_and_undone(fresh_registry, pristine_registries):
    from physicsnemo_shardext import shard_registries
    from physicsnemo_shardext.engine.provenance import PluginInfo

    patches = PatchSet("forms")
    patches.named("shardext_test::declarations_affine", handler)
    fresh_registry.add_plugin(PluginInfo("forms"), list(patches))
    for name in (OVERLOAD, PACKET):
        assert shard_registries.current_handler(PatchLevel.NAMED, name) is handler
    assert fresh_registry.provenance(affine).plugin.name == "forms"
    with fresh_registry.disabled(targets=[torch.ops.shardext_test.declarations_affine]):
        assert shard_registries.current_handler(PatchLevel.NAMED, PACKET) is None
        assert shard_registries.current_handler(PatchLevel.NAMED, OVERLOAD) is None
    fresh_registry.remove_all()
    assert shard_registries.snapshot() == pristine_registries


def test_tie_on_a_custom_op_is_reported_once(fresh_registry):
    from physicsnemo_shardext import ShardextWarning
    from physicsnemo_shardext.engine.provenance import PluginInfo

    for name, form in (("one", affine), ("two", torch.ops.shardext_test.declarations_affine)):
        patches = PatchSet(name)
        patches.named(form, handler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardextWarning)
            fresh_registry.add_plugin(PluginInfo(name), list(patches))
    assert [(c.target, c.providers) for c in fresh_registry.conflicts()] == [(OVERLOAD, ("one", "two"))]


@pytest.mark.multirank(2)
@pytest.mark.parametrize("form", sorted(OP_FORMS))
def test_handler_runs_for_every_call_form(domain_mesh, rank, registry_sandbox, form):
    from torch.distributed.tensor import Shard

    from physicsnemo_shardext.engine.provenance import PluginInfo
    from physicsnemo_shardext.primitives import from_local_like
    from physicsnemo_shardext.testing import shard_tensor

    calls = []

    def local_affine(func, types, args, kwargs):
        calls.append(str(func))
        (x,) = args
        return from_local_like(func(x.to_local()), x)

    patches = PatchSet("forms")
    patches.named(OP_FORMS[form](), local_affine)
    registry_sandbox.add_plugin(PluginInfo("forms"), list(patches))
    full = torch.randn(2, 9, 3)
    for call in sorted(CALL_FORMS):
        xs = shard_tensor(full, domain_mesh, [Shard(1)], [6, 3])
        out = CALL_FORMS[call]()(xs)
        assert out.placements == xs.placements and out.to_local().shape[1] == (6, 3)[rank]
        assert torch.equal(out.full_tensor(), affine(full))
    assert calls == [OVERLOAD, OVERLOAD, PACKET]  # custom_op_def, overload, packet (sorted call forms)


# -- the worked example in docs/custom-ops.md -----------------------------------------------
# Its blocks are picked by their ``<!-- tested-as: NAME -->`` comment (as in tests/test_tutorials.py)
# and run on 2 ranks: the op and the plugin as the modules the page names, then its test.

CUSTOM_OPS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "custom-ops.md"
BLOCK = re.compile(r"<!-- tested-as: (?P<name>[\w.]+) -->\n```python\n(?P<code>.*?)```", re.DOTALL)


def page_blocks() -> dict[str, str]:
    return {m["name"]: m["code"] for m in BLOCK.finditer(CUSTOM_OPS_PAGE.read_text())}


def page_module(name: str) -> types.ModuleType:
    """The block ``name`` as an imported module: executed once per process (it registers ``mylib::laplacian5``)."""
    module_name = name.removesuffix(".py")
    if module_name not in sys.modules:
        module = types.ModuleType(module_name)
        exec(compile(page_blocks()[name], f"{CUSTOM_OPS_PAGE}:{name}", "exec"), module.__dict__)
        sys.modules[module_name] = module
    return sys.modules[module_name]


def test_custom_ops_page_blocks_are_found():
    assert set(page_blocks()) == {"my_stencil.py", "my_stencil_shard.py", "test_my_stencil.py"}


@pytest.mark.multirank(2)
def test_custom_ops_page_runs_on_two_ranks(domain_mesh):
    page_module("my_stencil.py")
    page_module("my_stencil_shard.py")
    test_module = types.ModuleType("test_my_stencil")
    exec(
        compile(page_blocks()["test_my_stencil.py"], f"{CUSTOM_OPS_PAGE}:test_my_stencil.py", "exec"),
        test_module.__dict__,
    )
    test_module.test_laplacian5_on_uneven_shards(domain_mesh)


def test_a_patch_steps_aside_outside_the_torch_range_it_is_needed_for():
    release = torch.__version__.split("+")[0]
    patches = PatchSet("demo")
    patches.function(torch.roll, handler, needed_on_torch=f"<={release}")  # needed here: declared
    patches.function(torch.flip, handler, needed_on_torch=f"<{release}")  # a newer torch made it unnecessary
    assert [d.target_name for d in patches] == ["torch.roll"]
    ((target, why),) = patches.not_applicable
    assert (
        target == "torch.flip"
        and why == f"needed on torch<{release} only; torch {torch.__version__} handles it without"
    )
    with pytest.raises(InvalidPatchDeclaration, match="not a version range"):
        patches.function(torch.cumsum, handler, needed_on_torch="before 2.15")
