"""Tests of physicsnemo_shardext/primitives/wrapping.py: local_of and wrap_local against to_local and from_local."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from physicsnemo_shardext.primitives import local_of, wrap_local, wrapping
from physicsnemo_shardext.testing import shard_tensor

LAYOUTS = {
    "shard-uneven": ([Shard(2), Replicate()], {0: [6, 3]}),
    "shard-shard": ([Shard(2), Shard(3)], {0: [6, 3], 1: [1, 4]}),
    "partial-shard": ([Partial(), Shard(1)], {1: [2, 1]}),
}


def _grads_of(x: ShardTensor, unwrap) -> torch.Tensor:
    """x.grad (as a full tensor) after a loss computed on the local block, through ``unwrap``."""
    x.grad = None
    local = unwrap(x)
    weight = torch.arange(local.numel(), dtype=local.dtype).reshape(local.shape)
    (local * weight).sum().backward()
    return x.grad.full_tensor()


@pytest.mark.multirank(4)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_local_of_gives_to_local_values_and_gradients(spatial_mesh, layout):
    placements, sizes = LAYOUTS[layout]
    x = shard_tensor(torch.randn(2, 3, 9, 5, dtype=torch.float64), spatial_mesh, placements, sizes, requires_grad=True)
    assert torch.equal(local_of(x), x.to_local())
    torch.testing.assert_close(_grads_of(x, local_of), _grads_of(x, lambda t: t.to_local()), rtol=0, atol=0)
    assert x.grad._spec.sharding_shapes() == x._spec.sharding_shapes()


@pytest.mark.multirank(2)
def test_local_of_hands_back_the_local_block_where_no_gradient_flows(domain_mesh):
    x = shard_tensor(torch.randn(7, 2), domain_mesh, [Shard(0)], [4, 3])
    assert local_of(x) is x._local_tensor  # does not require grad
    y = shard_tensor(torch.randn(7, 2), domain_mesh, [Shard(0)], [4, 3], requires_grad=True)
    with torch.no_grad():
        assert local_of(y) is y._local_tensor
    assert local_of(y) is not y._local_tensor and local_of(y).requires_grad
    replicated = DTensor.from_local(torch.ones(3, requires_grad=True), domain_mesh, [Replicate()])
    assert torch.equal(local_of(replicated), replicated.to_local())  # not a ShardTensor: its own to_local


@pytest.mark.multirank(4)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_wrap_local_builds_what_from_local_builds(spatial_mesh, layout):
    placements, sizes = LAYOUTS[layout]
    x = shard_tensor(torch.randn(2, 3, 9, 5, dtype=torch.float64), spatial_mesh, placements, sizes)
    shapes = x._spec.sharding_shapes()

    def built(wrap):
        local = x._local_tensor.clone().requires_grad_(True)
        y = wrap(local)
        weight = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)
        (y * weight).sum().backward()
        return y, local.grad

    fast, fast_grad = built(lambda t: wrap_local(t, spatial_mesh, x._spec.placements, shapes))
    slow, slow_grad = built(
        lambda t: ShardTensor.from_local(t, spatial_mesh, x._spec.placements, sharding_shapes=shapes)
    )
    assert fast._spec == slow._spec and fast.shape == slow.shape and fast.requires_grad and slow.requires_grad
    assert torch.equal(fast.full_tensor(), slow.full_tensor())
    torch.testing.assert_close(fast_grad, slow_grad, rtol=0, atol=0)


@pytest.mark.multirank(2)
def test_wrap_local_caches_one_spec_per_layout_shape_and_dtype(domain_mesh, rank):
    shapes = {0: ((4, 2), (3, 2))}
    local = torch.zeros((4, 3)[rank], 2)
    a = wrap_local(local, domain_mesh, (Shard(0),), shapes)
    b = wrap_local(local + 1, domain_mesh, (Shard(0),), {0: [[4, 2], [3, 2]]})  # lists: same key
    c = wrap_local(local.double(), domain_mesh, (Shard(0),), shapes)
    assert a._spec is b._spec and c._spec is not a._spec and c.dtype == torch.float64
    assert tuple(a.shape) == (7, 2) and torch.equal(b.full_tensor(), torch.ones(7, 2))
    wrapping._SPEC_CACHE.clear()
    assert wrap_local(local, domain_mesh, (Shard(0),), shapes)._spec == a._spec
