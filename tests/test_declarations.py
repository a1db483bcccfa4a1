"""Tests of physicsnemo_shardext.declarations."""

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
