"""Tests of physicsnemo_shardext/primitives/replicated.py: replicated operands next to uneven shards."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives import (
    from_local_like,
    gather_full,
    replicated_local,
    replicated_part,
    sum_grad_over,
)
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor


class AddsReplicated(torch.nn.Module):
    """``x + table`` through ``replicated_part``: what a positional-embedding add needs."""

    def __init__(self, table_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(table_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(x, "_spec") and not isinstance(x, DTensor):  # a ShardTensor: the primitive under test
            return from_local_like(x.to_local() * replicated_part(self.table, x), x)
        return x * self.table


@pytest.mark.multirank(2)
@pytest.mark.parametrize("table_shape", [(1, 17, 4), (17, 1), (4,)], ids=["rows", "broadcast-cols", "trailing"])
@pytest.mark.parametrize("split", [[12, 5], [17, 0]], ids=["uneven", "empty-shard"])
def test_replicated_part_matches_single_process_with_whole_gradients(domain_mesh, table_shape, split):
    # The table's gradient must come back complete (summed over the shards) on every rank.
    check_conformance(AddsReplicated(table_shape), [torch.randn(2, 17, 4)], ShardSpec(domain_mesh, [Shard(1)], split))


@pytest.mark.multirank(4)
def test_replicated_part_on_a_2d_mesh(spatial_mesh):
    spec = ShardSpec(spatial_mesh, [Shard(1), Shard(2)], {0: [5, 2], 1: [1, 3]})
    check_conformance(AddsReplicated((7, 4)), [torch.randn(2, 7, 4)], spec)


@pytest.mark.multirank(2)
def test_replicated_part_refuses_a_mismatched_size_and_sharded_operands(domain_mesh):
    x = shard_tensor(torch.randn(2, 17, 4), domain_mesh, [Shard(1)], [12, 5])
    with pytest.raises(MissingShardPatch, match=r"size 16 on dim 1 does not match the sharded dim 1 of size 17"):
        replicated_part(torch.zeros(1, 16, 4), x, "pos_embed")
    with pytest.raises(MissingShardPatch, match=r"pos_embed: expected a replicated tensor"):
        replicated_local(x, "pos_embed")
    with pytest.raises(MissingShardPatch, match=r"do not broadcast"):
        replicated_part(torch.zeros(1, 2, 17, 4), x, "pos_embed")


@pytest.mark.multirank(2)
def test_replicated_local_unwraps_a_replicate_dtensor_differentiably(domain_mesh):
    weight = DTensor.from_local(torch.ones(3, requires_grad=True), domain_mesh, [Replicate()])
    local = replicated_local(weight, "w")
    assert type(local) is torch.Tensor and local.requires_grad
    assert replicated_local(5, "w") == 5


@pytest.mark.multirank(2)
def test_sum_grad_over_sums_only_in_backward(domain_mesh, rank):
    w = torch.full((3,), float(rank + 1), requires_grad=True)
    y = sum_grad_over(w, domain_mesh, [0])
    torch.testing.assert_close(y, w.detach())  # forward: identity
    (y * (rank + 1)).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 3.0))  # 1 + 2 on both ranks
    assert sum_grad_over(w, domain_mesh, []) is w


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[6, 1, 0, 3], [10, 0, 0, 0]], ids=["uneven", "one-rank"])
def test_gather_full_returns_the_global_tensor_and_keeps_own_rows_in_backward(domain_mesh, split):
    full = torch.randn(2, 10, 3, dtype=torch.float64)
    x = shard_tensor(full, domain_mesh, [Shard(1)], split, requires_grad=True)
    gathered = gather_full(x)
    assert type(gathered) is torch.Tensor
    torch.testing.assert_close(gathered, full, rtol=0, atol=0)
    weights = torch.arange(full.numel(), dtype=torch.float64).reshape(full.shape)
    (gathered * weights).sum().backward()  # the same (replicated) loss on every rank
    torch.testing.assert_close(x.grad.full_tensor(), weights)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[7, 2], [9, 0], [5, 4]], ids=["uneven", "empty-shard", "chunk"])
def test_an_evenly_sharded_dtensor_parameter_meets_an_uneven_activation(domain_mesh, split):
    # FSDP2's spatial parameter (pos_embed as a Shard DTensor, cut like torch.chunk) added to
    # tokens split another way: gathered, cut to the rows; its gradient lands on each chunk.
    from torch.distributed.tensor import distribute_tensor

    from physicsnemo_shardext.primitives import elementwise_with_replicated

    full_pos, full_x, cotangent = torch.randn(1, 9, 4), torch.randn(1, 9, 4), torch.randn(1, 9, 4)
    pos = torch.nn.Parameter(distribute_tensor(full_pos, domain_mesh, [Shard(1)]))
    x = shard_tensor(full_x, domain_mesh, [Shard(1)], split)
    y = elementwise_with_replicated(torch.mul, (x, pos), {})
    assert y is not None and tuple(y.placements) == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), full_x * full_pos)
    y.backward(shard_tensor(cotangent, domain_mesh, [Shard(1)], split))
    assert isinstance(pos.grad, DTensor) and tuple(pos.grad.placements) == (Shard(1),)
    torch.testing.assert_close(pos.grad.full_tensor(), cotangent * full_x)
