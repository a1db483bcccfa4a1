"""Tests of physicsnemo_shardext/primitives/alignment.py: re-splitting a sharded dim to aligned boundaries."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives import align_shard, aligned_split_sizes, dim_layout, resplit_rows
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor


def test_boundaries_move_to_the_nearest_multiple_ties_down():
    assert aligned_split_sizes((5, 3), 2) == (4, 4)  # 5 -> 4 (tie: 4 or 6)
    assert aligned_split_sizes((7, 1), 4) == (8, 0)  # 7 -> 8 (nearest), rank 1 left empty
    assert aligned_split_sizes((25, 23), 6) == (24, 24)
    assert aligned_split_sizes((28, 20), 6) == (30, 18)  # 28 -> 30 (2 rows) rather than 24 (4 rows)
    assert aligned_split_sizes((3, 0, 5), 4) == (4, 0, 4)  # both boundaries (3, 3) go to 4
    assert aligned_split_sizes((0, 6, 6), 3) == (0, 6, 6)  # aligned already: unchanged
    assert aligned_split_sizes((4, 4), 1) == (4, 4)
    with pytest.raises(ValueError, match="cannot be split into multiples of 4"):
        aligned_split_sizes((5, 2), 4)


def _sent_rows(old, new, coord: int) -> int:
    """Rows ``coord`` holds under ``old`` and no longer under ``new``: what it hands the collective."""
    start_old, start_new = sum(old[:coord]), sum(new[:coord])
    kept = max(0, min(start_old + old[coord], start_new + new[coord]) - max(start_old, start_new))
    return old[coord] - kept


def _aligned(dim: int, multiple: int):
    """align_shard on the sharded run; the identity (same values) on the reference's plain tensor."""
    return lambda t: align_shard(t, dim, multiple) if isinstance(t, ShardTensor) else t * 1


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    "sizes,multiple",
    [([5, 3], 2), ([7, 1], 4), ([4, 4], 2), ([8, 0], 4), ([0, 8], 4), ([3, 5], 8)],
    ids=["straddling", "to-empty", "aligned", "empty-second", "empty-first", "all-to-one"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_align_moves_only_the_straddling_rows(domain_mesh, rank, sizes, multiple, dtype):
    full = torch.randn(2, 8, 3, dtype=dtype)
    target = aligned_split_sizes(sizes, multiple)
    report = check_conformance(
        _aligned(1, multiple), [full], ShardSpec(domain_mesh, [Shard(1)], sizes), expected_placements=[Shard(1)]
    )
    row_bytes = full.numel() // full.shape[1] * full.element_size()
    forward, backward = report.comms.forward, report.comms.backward
    assert sum(forward.bytes.values()) == _sent_rows(sizes, target, rank) * row_bytes
    assert sum(backward.bytes.values()) == _sent_rows(target, sizes, rank) * row_bytes
    if tuple(sizes) == target:
        assert forward.total_calls == 0 and backward.total_calls == 0  # nothing crosses: no collective
    else:
        assert forward.counts == backward.counts == {"c10d.alltoall_base_": 1}
    out = align_shard(shard_tensor(full, domain_mesh, [Shard(1)], sizes), 1, multiple)
    assert tuple(s[1] for s in out._spec.sharding_shapes()[0]) == target


@pytest.mark.multirank(4)
def test_resplit_rows_on_four_ranks_with_empty_shards(domain_mesh, rank):
    full = torch.randn(12, 2)
    xs = shard_tensor(full, domain_mesh, [Shard(0)], [5, 0, 4, 3])
    new = [0, 6, 0, 6]
    local = resplit_rows(xs.to_local(), dim_layout(xs, 0), new)
    start = sum(new[:rank])
    torch.testing.assert_close(local, full[start : start + new[rank]])


@pytest.mark.multirank(4)
def test_align_one_mesh_dim_of_a_2d_mesh_keeps_the_other(spatial_mesh):
    full = torch.randn(1, 8, 6, 2)
    check_conformance(
        _aligned(1, 4),
        [full],
        ShardSpec(spatial_mesh, [Shard(1), Shard(2)], {0: [5, 3], 1: [1, 5]}),
        expected_placements=[Shard(1), Shard(2)],
    )


@pytest.mark.multirank(2)
def test_resplit_checks_its_arguments_and_align_refuses_an_unsharded_dim(domain_mesh):
    xs = shard_tensor(torch.randn(8, 3), domain_mesh, [Shard(0)], [5, 3])
    with pytest.raises(ValueError, match="do not split 8 rows"):
        resplit_rows(xs.to_local(), dim_layout(xs, 0), [4, 5])
    with pytest.raises(MissingShardPatch, match="dim 1 .* is not sharded"):
        align_shard(xs, 1, 3)
