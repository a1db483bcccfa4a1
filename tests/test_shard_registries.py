"""Tests of physicsnemo_shardext.shard_registries."""

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.shard_registries import PatchLevel


def handler(func, types, args, kwargs):
    return None


def dispatch_handler(*args, **kwargs):
    return None


def test_snapshot_restore_roundtrip(pristine_registries):
    shard_registries.set_handler(PatchLevel.FUNCTION, torch.roll, handler)
    assert shard_registries.snapshot() != pristine_registries
    shard_registries.restore(pristine_registries)
    assert shard_registries.snapshot() == pristine_registries
    assert torch.roll not in ShardTensor._function_registry


def test_dispatch_handlers_are_indexed_by_name_too(pristine_registries):
    op = torch.ops.aten.roll.default
    shard_registries.set_handler(PatchLevel.DISPATCH, op, dispatch_handler)
    assert ShardTensor._dispatch_registry[op] is dispatch_handler
    assert ShardTensor._dispatch_registry_by_name["aten.roll.default"] is dispatch_handler
    shard_registries.remove_handler(PatchLevel.DISPATCH, op)
    assert op not in ShardTensor._dispatch_registry
    assert "aten.roll.default" not in ShardTensor._dispatch_registry_by_name


def test_capture_and_restore_slot_are_exact(pristine_registries):
    op = torch.ops.aten.view.default  # a built-in dispatch handler
    state = shard_registries.capture_slot(PatchLevel.DISPATCH, op)
    assert state[0] is not None and state[1] is not None
    shard_registries.set_handler(PatchLevel.DISPATCH, op, dispatch_handler)
    shard_registries.restore_slot(PatchLevel.DISPATCH, op, state)
    assert shard_registries.snapshot() == pristine_registries


def test_registries_are_mutated_in_place(pristine_registries):
    table = ShardTensor._function_registry
    shard_registries.restore(pristine_registries)
    assert ShardTensor._function_registry is table


def test_difference_names_changed_keys(pristine_registries):
    shard_registries.set_handler(PatchLevel.FUNCTION, torch.roll, handler)
    diff = shard_registries.snapshot().difference(pristine_registries)
    assert len(diff) == 1 and "_function_registry" in diff[0]


class _Owner:
    @staticmethod
    def backward(ctx, grad):
        return grad


def test_attribute_slots_snapshot_and_restore_exactly(pristine_registries):
    from physicsnemo_shardext.shard_registries import AttributeTarget, original_attribute

    target = AttributeTarget(_Owner, "backward")
    original = _Owner.__dict__["backward"]
    replacement = staticmethod(lambda ctx, grad: 2 * grad)
    shard_registries.set_handler(PatchLevel.ATTRIBUTE, target, replacement)
    assert _Owner.backward(None, 3) == 6 and original_attribute(target) is original
    assert (PatchLevel.ATTRIBUTE, target, replacement) in list(shard_registries.iter_handlers())
    assert "attributes" in shard_registries.snapshot().difference(pristine_registries)[0]
    shard_registries.restore(pristine_registries)
    assert _Owner.__dict__["backward"] is original and shard_registries.snapshot() == pristine_registries
    shard_registries.set_handler(PatchLevel.ATTRIBUTE, target, replacement)
    shard_registries.remove_handler(PatchLevel.ATTRIBUTE, target)  # an attribute "falls back" to its original
    assert _Owner.__dict__["backward"] is original
