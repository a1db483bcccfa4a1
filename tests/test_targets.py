"""Tests of physicsnemo_shardext.targets."""

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_shardext.shard_registries import PatchLevel
from physicsnemo_shardext.targets import (
    describe_target,
    infer_level,
    lookup_keys,
    resolve_slot,
    resolve_target,
    validate_handler,
)


@pytest.mark.parametrize(
    ("target", "name"),
    [
        (torch.roll, "torch.roll"),
        (torch.Tensor.roll, "torch.Tensor.roll"),
        (F.gelu, "torch.nn.functional.gelu"),
        (F.max_pool2d, "torch.nn.functional.max_pool2d"),
        (torch.ops.aten.roll.default, "aten.roll.default"),
        ("mylib.op.default", "mylib.op.default"),
    ],
)
def test_describe_target(target, name):
    assert describe_target(target) == name


def test_infer_level():
    assert infer_level(torch.roll) is PatchLevel.FUNCTION
    assert infer_level(torch.ops.aten.roll.default) is PatchLevel.DISPATCH
    assert infer_level("x.y.default") is PatchLevel.NAMED


def test_dotted_function_target_resolves():
    assert resolve_target("torch.nn.functional.gelu", PatchLevel.FUNCTION) is F.gelu


def test_missing_function_target_is_refused():
    with pytest.raises(ValueError, match="torch.nn.functional.no_such_op"):
        resolve_target("torch.nn.functional.no_such_op", PatchLevel.FUNCTION)


def test_overload_packet_is_refused_for_dispatch():
    with pytest.raises(ValueError, match="overload packet"):
        resolve_target(torch.ops.aten.roll, PatchLevel.DISPATCH)


def test_level_must_fit_target():
    with pytest.raises(ValueError, match="OpOverload"):
        resolve_target(torch.roll, PatchLevel.DISPATCH)
    with pytest.raises(ValueError, match="op names"):
        resolve_target(torch.roll, PatchLevel.NAMED)


def test_named_target_must_exist():
    with pytest.raises(ValueError, match="no op named"):
        resolve_target("nosuchlib.op.default", PatchLevel.NAMED)
    assert resolve_target("aten.roll.default", PatchLevel.NAMED) == "aten.roll.default"


def test_function_handler_signature_checked():
    validate_handler(lambda func, types, args, kwargs: None, PatchLevel.FUNCTION, torch.roll)
    validate_handler(lambda *a: None, PatchLevel.FUNCTION, torch.roll)
    with pytest.raises(ValueError, match=r"handler\(func, types, args, kwargs\)"):
        validate_handler(lambda x, y: None, PatchLevel.FUNCTION, torch.roll)
    with pytest.raises(ValueError, match="callable"):
        validate_handler(42, PatchLevel.FUNCTION, torch.roll)


def test_dispatch_handler_signature_checked_against_schema():
    op = torch.ops.aten.roll.default  # (self, shifts, dims=[])
    validate_handler(lambda self, shifts, dims=(): None, PatchLevel.DISPATCH, op)
    validate_handler(lambda *args, **kwargs: None, PatchLevel.DISPATCH, op)
    with pytest.raises(ValueError, match="aten::roll"):
        validate_handler(lambda self: None, PatchLevel.DISPATCH, op)


# -- custom ops: every form names one named-level slot ---------------------------------------


@torch.library.custom_op("shardext_test::targets_scale", mutates_args=())
def targets_scale(x: torch.Tensor) -> torch.Tensor:
    return 3 * x


CUSTOM_OP_FORMS = {
    "custom_op_def": targets_scale,
    "packet": torch.ops.shardext_test.targets_scale,
    "overload": torch.ops.shardext_test.targets_scale.default,
    "qualified_name": "shardext_test::targets_scale",
    "dotted_name": "shardext_test.targets_scale.default",
    "torch_ops_path": "torch.ops.shardext_test.targets_scale",
}


@pytest.mark.parametrize("form", sorted(CUSTOM_OP_FORMS))
def test_every_custom_op_form_resolves_to_the_overload_name(form):
    target = CUSTOM_OP_FORMS[form]
    expected = (PatchLevel.NAMED, "shardext_test.targets_scale.default")
    assert infer_level(target) is PatchLevel.NAMED
    assert resolve_slot(target) == expected
    # Declared at the function level (patches.function), a custom op still goes where it fires.
    assert resolve_slot(target, PatchLevel.FUNCTION) == expected
    assert resolve_slot(target, PatchLevel.NAMED) == expected


def test_custom_op_overload_also_covers_its_packet_name():
    # __torch_function__ sees str(func) == "ns.op" for torch.ops.ns.op(x), "ns.op.default" otherwise.
    assert lookup_keys("shardext_test.targets_scale.default", PatchLevel.NAMED) == (
        "shardext_test.targets_scale.default",
        "shardext_test.targets_scale",
    )
    # A packet with several overloads stands for all of them; a single overload of it for itself only.
    assert lookup_keys("aten.roll", "named") == ("aten.roll", "aten.roll.default", "aten.roll.out")
    assert lookup_keys("aten.roll.default", "named") == ("aten.roll.default",)
    assert lookup_keys(torch.roll, "function") == (torch.roll,)


def test_describe_custom_op_forms():
    assert describe_target(targets_scale) == "shardext_test.targets_scale.default"
    assert describe_target(torch.ops.shardext_test.targets_scale) == "shardext_test.targets_scale"


def test_custom_op_at_dispatch_level_is_its_overload():
    assert resolve_slot(targets_scale, "dispatch") == (
        PatchLevel.DISPATCH,
        torch.ops.shardext_test.targets_scale.default,
    )
    with pytest.raises(ValueError, match="overload packet.*shardext_test.targets_scale.default"):
        resolve_slot(torch.ops.shardext_test.targets_scale, "dispatch")


def test_aten_targets_keep_their_levels():
    assert infer_level(torch.ops.aten.roll) is PatchLevel.FUNCTION
    assert resolve_slot(torch.ops.aten.view.default, "function") == (PatchLevel.FUNCTION, torch.ops.aten.view.default)
    assert resolve_slot("torch.nn.functional.gelu", "function") == (PatchLevel.FUNCTION, F.gelu)


def test_custom_op_is_not_a_function_level_key():
    with pytest.raises(ValueError, match="named-level target.*shardext_test.targets_scale.default"):
        resolve_target(targets_scale, PatchLevel.FUNCTION)


@pytest.mark.parametrize("name", ["shardext_test::no_such_op", "shardext_test.targets_scale.out", "a::b::c"])
def test_missing_custom_op_names_are_refused(name):
    with pytest.raises(ValueError, match="no op named"):
        resolve_slot(name)
