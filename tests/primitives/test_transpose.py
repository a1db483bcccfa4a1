"""Tests of physicsnemo_shardext/primitives/transpose.py: moving a shard between dims with one all-to-all."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives.layout import dim_layout
from physicsnemo_shardext.primitives.transpose import balanced_split_sizes, move_shard, transpose_shard
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor


def test_balanced_sizes_differ_by_at_most_one_larger_first():
    assert balanced_split_sizes(7, 3) == (3, 2, 2)
    assert balanced_split_sizes(2, 4) == (1, 1, 0, 0)
    assert balanced_split_sizes(0, 2) == (0, 0)


def _moved(src: int, dst: int, sizes=None):
    """transpose_shard on the sharded run; the identity (same values) on the reference's plain tensor."""
    return lambda t: transpose_shard(t, src, dst, sizes) if isinstance(t, ShardTensor) else t * 1


def _moved_bytes(full: torch.Tensor, src: int, src_sizes, dst: int, dst_sizes, coord: int) -> int:
    """Analytic payload of one rank: its block, minus the piece it keeps (never sent)."""
    local_numel = full.numel() // full.shape[src] * src_sizes[coord]
    kept = local_numel // full.shape[dst] * dst_sizes[coord] if full.shape[dst] else 0
    return (local_numel - kept) * full.element_size()


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    "src_sizes,dst_sizes",
    [([3, 3], None), ([5, 1], [1, 5]), ([6, 0], [0, 6]), ([0, 6], [6, 0])],
    ids=["even", "uneven", "empty-src", "empty-both"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_transpose_matches_and_moves_only_foreign_pieces(domain_mesh, rank, src_sizes, dst_sizes, dtype):
    full = torch.randn(2, 6, 6, dtype=dtype)
    dst = list(dst_sizes) if dst_sizes else list(balanced_split_sizes(6, 2))
    report = check_conformance(
        _moved(1, 2, dst_sizes),
        [full],
        ShardSpec(domain_mesh, [Shard(1)], src_sizes),
        expected_placements=[Shard(2)],
    )
    forward, backward = report.comms.forward, report.comms.backward
    expected = _moved_bytes(full, 1, src_sizes, 2, dst, rank)
    assert forward.bytes == {"c10d.alltoall_base_": expected} or (expected == 0 and forward.total_calls <= 1)
    # The backward is the reverse move: what this rank received forward goes back.
    assert backward.counts == forward.counts
    xs = shard_tensor(full, domain_mesh, [Shard(1)], src_sizes)
    ys = transpose_shard(xs, 1, 2, dst_sizes)
    assert [s[2] for s in ys._spec.sharding_shapes()[0]] == dst
    assert ys.to_local().shape[1] == 6


@pytest.mark.multirank(4)
def test_transpose_on_four_ranks_with_empty_shards(domain_mesh):
    full = torch.randn(3, 7, 5)
    check_conformance(
        _moved(1, 0, [0, 2, 0, 1]),
        [full],
        ShardSpec(domain_mesh, [Shard(1)], [4, 0, 2, 1]),
        expected_placements=[Shard(0)],
    )


@pytest.mark.multirank(4)
def test_transpose_one_mesh_dim_of_a_2d_mesh_keeps_the_other(spatial_mesh):
    full = torch.randn(2, 5, 6, 4)
    check_conformance(
        _moved(2, 3, [3, 1]),
        [full],
        ShardSpec(spatial_mesh, [Shard(1), Shard(2)], {0: [4, 1], 1: [1, 5]}),
        expected_placements=[Shard(1), Shard(3)],
    )


@pytest.mark.multirank(4)
def test_transpose_refuses_a_destination_that_is_already_sharded(spatial_mesh):
    xs = shard_tensor(torch.randn(4, 6, 6), spatial_mesh, [Shard(1), Shard(2)])
    with pytest.raises(MissingShardPatch, match="already sharded"):
        transpose_shard(xs, 1, 2)
    with pytest.raises(MissingShardPatch, match="not sharded"):
        transpose_shard(xs, 0, 1)


@pytest.mark.multirank(2)
def test_move_shard_validates_sizes(domain_mesh):
    xs = shard_tensor(torch.randn(4, 6), domain_mesh, [Shard(0)], [3, 1])
    with pytest.raises(ValueError, match="do not split"):
        move_shard(xs.to_local(), dim_layout(xs, 0), 1, [4, 4])
