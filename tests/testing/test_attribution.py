"""Errors of the code under test as mismatches naming the plugin (testing/attribution.py).

Moved from test_conformance.py, with focused tests of the guard first.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.testing import ConformanceError, ShardSpec, check_conformance
from physicsnemo_shardext.testing.attribution import _backward_target, _first_line, _Guard, _is_code_error


def test_guard_records_errors_of_the_code_under_test_and_lets_the_framework_s_own_through():
    mismatches = []
    with _Guard("output[0]", "gathering it", mismatches, lambda error: "plugin handler(s) that ran: p") as guard:
        raise ValueError("shape mismatch\nsecond line")
    assert guard.failed
    assert [(m.what, m.detail) for m in mismatches] == [
        ("output[0]", "gathering it raised ValueError: shape mismatch; plugin handler(s) that ran: p")
    ]
    assert not _is_code_error(MissingShardPatch("no patch")) and _is_code_error(RuntimeError("x"))
    with pytest.raises(MissingShardPatch), _Guard("output", "the sharded forward", mismatches, lambda e: ""):
        raise MissingShardPatch("no patch")
    assert len(mismatches) == 1
    assert _first_line(RuntimeError("a" * 400), limit=5) == "RuntimeError: aaaaa"


def test_backward_errors_name_the_output_in_the_caller_s_numbering():
    assert (
        _backward_target(RuntimeError("Mismatch in shape: output[1]"), [0, 3]) == "gradients (backward from output[3])"
    )
    assert _backward_target(RuntimeError("Mismatch in shape: output[5]"), [0, 3]) == "gradients (backward)"
    assert _backward_target(RuntimeError("no index"), [0]) == "gradients (backward)"


def _install_plugin(name, target, handler):
    """Install ``handler`` for ``target`` as plugin ``name`` (priority 5 beats the first-party one)."""
    import physicsnemo_shardext
    from physicsnemo_shardext import PatchSet
    from physicsnemo_shardext.engine.provenance import PluginInfo

    patches = PatchSet(name)
    patches.function(target, handler, priority=5)
    physicsnemo_shardext.get_registry().add_plugin(PluginInfo(name, f"{name}-dist", "0.1"), list(patches))


def _from_local_like(local, x, placements=None):
    from physicsnemo.domain_parallel import ShardTensor

    placements = x.placements if placements is None else placements
    dim = x.placements[0].dim
    sizes = [s[dim] for s in x._spec.sharding_shapes()[0]]
    shapes = {0: [tuple(local.shape[:dim]) + (n,) + tuple(local.shape[dim + 1 :]) for n in sizes]}
    return ShardTensor.from_local(local, x.device_mesh, placements, sharding_shapes=shapes)


def _row_short_tanh(func, types, args, kwargs):
    """Wrong shape: drops the first row, so autograd meets a wrong-shaped output in backward."""
    x = args[0]
    return _from_local_like(torch.tanh(x.to_local())[1:], x)


def _float64_tanh(func, types, args, kwargs):
    x = args[0]
    return _from_local_like(torch.tanh(x.to_local()).double(), x)


def _replicate_labelled_tanh(func, types, args, kwargs):
    """Wrong placement: the local shard labelled Replicate."""
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Replicate

    x = args[0]
    return ShardTensor.from_local(torch.tanh(x.to_local()), x.device_mesh, [Replicate()])


def _raising_tanh(func, types, args, kwargs):
    raise RuntimeError("The size of tensor a (9) must match the size of tensor b (4)")


_SPEC_ARGS = ([Shard(1)], [9, 4])


@pytest.mark.multirank(2)
def test_wrong_shaped_handler_names_output_ranks_and_plugin(domain_mesh, registry_sandbox):
    _install_plugin("bad-shape", torch.tanh, _row_short_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    failed = {m.what: m for m in info.value.mismatches}
    assert "shape (3, 13) != reference (4, 13)" in failed["output[0]"].detail
    backward = failed["gradients (backward from output[0])"]  # autograd's error, no longer raised as such
    assert "Mismatch in shape" in backward.detail and backward.ranks == (0, 1)
    assert "bad-shape (bad-shape-dist==0.1) for torch.tanh" in backward.detail, backward.detail  # the plugin that ran
    assert "bad-shape (bad-shape-dist==0.1) for torch.tanh" in info.value.plugins
    assert "rank(s) [0, 1]" in str(info.value)


@pytest.mark.multirank(2)
def test_handler_raising_in_forward_is_named(domain_mesh, registry_sandbox):
    _install_plugin("raiser", torch.tanh, _raising_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    [mismatch] = info.value.mismatches
    assert mismatch.what == "output" and mismatch.ranks == (0, 1)
    assert mismatch.detail.startswith("the sharded forward raised RuntimeError: The size of tensor a (9)")
    assert "raised in the handler of plugin raiser (raiser-dist==0.1) for torch.tanh" in mismatch.detail


@pytest.mark.multirank(2)
def test_wrong_dtype_is_reported(domain_mesh, registry_sandbox):
    _install_plugin("wide", torch.tanh, _float64_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    message = str(info.value)
    assert "output[0]: dtype torch.float64 != reference torch.float32 (rank(s) [0, 1])" in message
    assert "plugin handlers that ran: wide (wide-dist==0.1) for torch.tanh" in message


@pytest.mark.multirank(2)
def test_wrong_placement_is_reported_with_the_plugin(domain_mesh, registry_sandbox):
    _install_plugin("flat", torch.tanh, _replicate_labelled_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    failed = {m.what: m for m in info.value.mismatches}
    placements = failed["placements of output[0]"]
    assert "(Replicate(),) != expected (Shard(dim=1),)" in placements.detail and placements.ranks == (0, 1)
    assert "flat (flat-dist==0.1) for torch.tanh" in placements.detail
    assert "output[0]" in failed  # each rank's "full" tensor is only its shard
