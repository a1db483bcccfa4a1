"""Tests of physicsnemo_shardext/primitives/gathering.py: every rank's rows, in coordinate order, on every rank.

Checked on 2 ranks for even, uneven and empty splits along first, middle and
last dims, on a mesh that lists the ranks in reverse (coordinate order is not
the group's rank order), over each dim of a 2x2 mesh, and for the one
all-gather it issues.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch

from physicsnemo_shardext.primitives import all_gather_rows
from physicsnemo_shardext.testing import CommCounter


def _full(rows: int, dim: int) -> torch.Tensor:
    shape = [3, 2, 4]
    shape[dim] = rows
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) * 1.5


def _block(full: torch.Tensor, dim: int, sizes: list[int], coord: int) -> torch.Tensor:
    return full.narrow(dim, sum(sizes[:coord]), sizes[coord])


@pytest.mark.multirank(2)
@pytest.mark.parametrize("sizes", [[3, 3], [5, 1], [1, 5], [0, 4], [4, 0], [0, 0]], ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_uneven_and_empty_splits_on_two_ranks(domain_mesh, rank, sizes, dim):
    full = _full(sum(sizes), dim)
    local = _block(full, dim, sizes, rank).requires_grad_()
    with CommCounter() as counter:
        out = all_gather_rows(local, domain_mesh, 0, dim, sizes)
    torch.testing.assert_close(out, full, rtol=0, atol=0, msg=f"rank {rank}, sizes {sizes}, dim {dim}")
    assert not out.requires_grad
    torch.testing.assert_close(local.detach(), _block(full, dim, sizes, rank), rtol=0, atol=0)
    assert counter.stats.counts == {"c10d.allgather_": 1}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.bfloat16], ids=str)
def test_dtypes_survive_the_padding(domain_mesh, rank, dtype):
    full = (torch.arange(12).reshape(6, 2) % 3 == 0).to(dtype)
    sizes = [4, 2]
    out = all_gather_rows(_block(full, 0, sizes, rank), domain_mesh, 0, 0, sizes)
    assert out.dtype == dtype and torch.equal(out, full)


@pytest.mark.multirank(2)
def test_without_sizes_every_rank_holds_as_many_rows(domain_mesh, rank):
    # A per-rank total, one row each: the exchange under a cumsum's exclusive prefix.
    out = all_gather_rows(torch.tensor([[rank + 1.0, -rank]]), domain_mesh, 0, 0)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0], [2.0, -1.0]]), rtol=0, atol=0)


@pytest.mark.multirank(2)
def test_rows_come_back_in_coordinate_order_on_a_reversed_mesh(rank):
    from torch.distributed.device_mesh import DeviceMesh

    reversed_mesh = DeviceMesh("cpu", torch.tensor([1, 0]))  # rank 1 is coordinate 0
    coord = reversed_mesh.get_coordinate()[0]
    assert coord == 1 - rank
    sizes = [1, 3]
    full = _full(4, 0)
    out = all_gather_rows(_block(full, 0, sizes, coord), reversed_mesh, 0, 0, sizes)
    torch.testing.assert_close(out, full, rtol=0, atol=0, msg=f"rank {rank}")


@pytest.mark.multirank(4)
@pytest.mark.parametrize("mesh_dim", [0, 1])
def test_coordinate_order_on_a_2x2_mesh(spatial_mesh, rank, mesh_dim):
    coord = spatial_mesh.get_coordinate()
    other = coord[1 - mesh_dim]
    sizes = [2 + other, 1]  # uneven, and different between the two groups
    full = _full(sum(sizes), 1) + 100 * other
    out = all_gather_rows(_block(full, 1, sizes, coord[mesh_dim]), spatial_mesh, mesh_dim, 1, sizes)
    torch.testing.assert_close(out, full, rtol=0, atol=0, msg=f"rank {rank}, mesh dim {mesh_dim}")


@pytest.mark.multirank(2)
def test_wrong_sizes_are_refused_before_any_communication(domain_mesh, rank):
    with CommCounter() as counter:
        with pytest.raises(ValueError, match="sizes"):
            all_gather_rows(torch.zeros(3, 2), domain_mesh, 0, 0, [3, 3, 3])
        with pytest.raises(ValueError, match="holds 3 rows"):
            all_gather_rows(torch.zeros(3, 2), domain_mesh, 0, 0, [2, 2])
        with pytest.raises(ValueError, match="0-d"):
            all_gather_rows(torch.tensor(1.0), domain_mesh, 0, 0)
    assert counter.stats.total_calls == 0


@pytest.mark.multirank(2)
def test_opens_its_profiler_range(domain_mesh):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        all_gather_rows(torch.ones(1, 2), domain_mesh, 0, 0)
    assert "shardext.all_gather_rows" in {event.name for event in profile.events()}


def test_a_single_rank_is_a_copy_without_communication():
    from torch.distributed.device_mesh import DeviceMesh

    class OneRank:  # only mesh.size() is read when the mesh dim has a single rank
        def size(self, mesh_dim: int) -> int:
            return 1

    value = torch.arange(6.0).reshape(3, 2)
    with CommCounter() as counter:
        out = all_gather_rows(value, cast(DeviceMesh, OneRank()), 0, 0, [3])
    assert out is not value and torch.equal(out, value) and counter.stats.total_calls == 0
