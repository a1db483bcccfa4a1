"""Tests of physicsnemo_shardext/primitives/index_exchange.py: row exchanges between uneven shards."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_shardext.primitives import (
    DimLayout,
    dim_layout,
    fetch_rows,
    from_local_like,
    gather_global_indices,
    halo_indices,
    plan_exchange,
    return_rows_into,
    start_fetch_rows,
    start_return_rows,
)
from physicsnemo_shardext.ranks.comm_accounting import CommCounter
from physicsnemo_shardext.testing import shard_tensor


def test_plan_keeps_own_rows_local_and_sends_only_what_others_want():
    layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3, 0, 2), coord=2, mesh=None)
    wanted = [[2, 3], [], [0, 4, 3, 4]]
    plan = plan_exchange(layout, wanted)
    assert plan.send_rows == ((0,), (), ())  # coordinate 0 wants global row 3 = our local row 0
    assert plan.recv_positions == ((0,), (), ())  # our position 0 (global row 0) comes from coordinate 0
    assert plan.self_rows == (1, 0, 1) and plan.self_positions == (1, 2, 3)
    assert plan.output_rows == 4 and plan.crosses


def test_plan_without_crossing_rows_needs_no_collective():
    layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3, 2), coord=0, mesh=None)
    assert not plan_exchange(layout, [[2, 1, 0], [4, 3]]).crosses


def test_owner_skips_empty_shards_and_rejects_out_of_range_rows():
    layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(2, 0, 3), coord=0, mesh=None)
    assert [layout.owner_of(i) for i in range(5)] == [0, 0, 2, 2, 2]
    with pytest.raises(IndexError, match="row 5"):
        layout.owner_of(5)


def test_halo_indices_clip_or_wrap_and_may_exceed_a_tiny_neighbour():
    layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(4, 1, 3), coord=0, mesh=None)
    assert list(halo_indices(layout, 2, 2, 2)) == [3, 4, 5, 6, 7]
    assert halo_indices(layout, 2, 2, 2, periodic=True) == [3, 4, 5, 6, 7, 0, 1]
    assert halo_indices(layout, 0, 2, 0, periodic=True) == [6, 7, 0, 1, 2, 3]


def _reference_rows(full: torch.Tensor, dim: int, rows: list[int]) -> torch.Tensor:
    return full.index_select(dim, torch.tensor(rows, dtype=torch.long))


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[5, 4, 4, 4], [1, 8, 0, 8], [15, 1, 0, 1]], ids=["even-ish", "empty-shard", "tiny"])
def test_periodic_halo_wider_than_neighbours_matches_full_tensor_with_gradients(domain_mesh, rank, split):
    full = torch.randn(2, 3, 17, 2, dtype=torch.float64, requires_grad=True)
    x = shard_tensor(full.detach(), domain_mesh, [Shard(2)], split, requires_grad=True)
    layout = dim_layout(x, 2)

    def wanted_by(coord: int) -> list[int]:
        return halo_indices(layout, coord, 3, 2, periodic=True)

    got = gather_global_indices(x.to_local(), layout, wanted_by)
    expected = _reference_rows(full, 2, wanted_by(layout.coord))
    torch.testing.assert_close(got, expected)

    # Gradient: each rank's rows contribute; sum over ranks equals the full-tensor gradient.
    weights = torch.randn(17 + 5 * 4, 2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    offset = sum(len(wanted_by(c)) for c in range(layout.coord))
    local_weight = weights[offset : offset + got.shape[2]].permute(1, 2, 0, 3)
    (got * local_weight).sum().backward()
    all_weights = torch.cat(
        [weights[sum(len(wanted_by(c)) for c in range(k)) :][: len(wanted_by(k))] for k in range(4)]
    ).permute(1, 2, 0, 3)
    all_rows = [r for k in range(4) for r in wanted_by(k)]
    (_reference_rows(full, 2, all_rows) * all_weights).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), full.grad)


@pytest.mark.multirank(2)
def test_flip_moves_rows_across_ranks_in_one_collective_of_exactly_those_rows(domain_mesh):
    full = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(2, 7, 3)
    x = shard_tensor(full, domain_mesh, [Shard(1)], [5, 2])
    layout = dim_layout(x, 1)

    def flipped_rows(coord: int) -> list[int]:
        start = layout.offsets[coord]
        return [layout.total - 1 - i for i in range(start, start + layout.sizes[coord])]

    with CommCounter() as counter:
        local = gather_global_indices(x.to_local(), layout, flipped_rows)
    flipped = from_local_like(local, x)
    torch.testing.assert_close(flipped.full_tensor(), full.flip(1))
    assert counter.stats.counts == {"c10d.alltoall_base_": 1}
    # Rank 0 wants rows 6..2: it owns 4,3,2 and receives 6,5; it sends rank 1 rows 1,0.
    # Rank 1 wants rows 1,0, all from rank 0, and sends rows 6,5. Each sends 2 rows of 2x3 floats.
    assert counter.stats.total_bytes == 2 * 2 * 3 * 4


@pytest.mark.multirank(2)
def test_exchange_inside_one_rank_uses_no_collective(domain_mesh):
    x = shard_tensor(torch.randn(6, 4), domain_mesh, [Shard(0)], [3, 3])
    layout = dim_layout(x, 0)
    with CommCounter() as counter:
        local = gather_global_indices(
            x.to_local(), layout, lambda c: list(range(layout.offsets[c], layout.offsets[c] + 3))[::-1]
        )
    assert counter.stats.total_calls == 0
    torch.testing.assert_close(local, x.to_local().flip(0))


@pytest.mark.multirank(4)
def test_exchange_along_one_dim_of_a_2d_mesh(spatial_mesh):
    full = torch.randn(1, 2, 9, 7, dtype=torch.float64)
    x = shard_tensor(full, spatial_mesh, [Shard(2), Shard(3)], {0: [6, 3], 1: [2, 5]})
    layout = dim_layout(x, 3)
    got = gather_global_indices(x.to_local(), layout, lambda c: halo_indices(layout, c, 1, 1))
    rows = halo_indices(layout, layout.coord, 1, 1)
    h = dim_layout(x, 2)
    expected = full[:, :, h.start : h.stop].index_select(3, torch.tensor(rows))
    torch.testing.assert_close(got, expected)


@pytest.mark.multirank(2)
def test_layout_and_rebuild_keep_uneven_shapes(domain_mesh, rank):
    x = shard_tensor(torch.randn(3, 11, 2), domain_mesh, [Shard(1)], [8, 3])
    layout = dim_layout(x, -2)
    assert (layout.sizes, layout.coord, layout.total) == ((8, 3), rank, 11)
    assert dim_layout(x, 0) is None
    y = from_local_like(x.to_local()[:, :, :1], x)
    assert y.shape == (3, 11, 1) and y._spec.placements == (Shard(1),)
    z = from_local_like(x.to_local()[:, : [4, 1][rank]], x, sizes_by_tensor_dim={1: [4, 1]})
    assert z.shape == (3, 5, 2)
    with pytest.raises(ValueError, match="holds"):
        from_local_like(x.to_local(), x, sizes_by_tensor_dim={1: [4, 1]})
    r = from_local_like(torch.ones(2), x, placements=[Replicate()])
    assert r.shape == (2,)


@pytest.mark.multirank(4)
def test_fetch_rows_and_return_rows_into_are_the_exchange_and_its_adjoint(domain_mesh, rank):
    # Halo rows of an uneven split (a tiny shard included): the autograd-free pair must give
    # what gather_global_indices gives, forward and backward, started early or not.
    full = torch.randn(19, 3, dtype=torch.float64)
    x = shard_tensor(full, domain_mesh, [Shard(0)], [7, 2, 0, 10], requires_grad=True)
    layout = dim_layout(x, 0)
    wanted = [[max(layout.offsets[c] - 2, 0), min(layout.offsets[c] + layout.sizes[c], 18)] for c in range(4)]
    plan = plan_exchange(layout, wanted)
    local = x.to_local().detach().requires_grad_(True)
    reference = gather_global_indices(local, layout, wanted)
    finish = start_fetch_rows(local, layout, plan)
    torch.testing.assert_close(finish(), reference.detach(), rtol=0, atol=0)
    torch.testing.assert_close(fetch_rows(local, layout, plan), reference.detach(), rtol=0, atol=0)
    cotangent = torch.randn_like(reference)
    (expected,) = torch.autograd.grad(reference, local, cotangent)
    accumulated = torch.ones_like(local)
    return_rows_into(accumulated, cotangent, layout, plan)
    torch.testing.assert_close(accumulated, expected + 1, rtol=0, atol=1e-12)
    # Started before the block's gradient exists, finished into it once computed.
    finish_return = start_return_rows(cotangent, layout, plan)
    block_grad = torch.full_like(local, 2.0)
    finish_return(block_grad)
    torch.testing.assert_close(block_grad, expected + 2, rtol=0, atol=1e-12)
