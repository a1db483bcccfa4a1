"""Tests of physicsnemo_shardext.targets."""

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_shardext.shard_registries import PatchLevel
from physicsnemo_shardext.targets import describe_target, infer_level, resolve_target, validate_handler


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
