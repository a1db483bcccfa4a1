"""Tests of physicsnemo_shardext/primitives/layout.py: per-dimension layouts of uneven shards, and wrapping."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives import (
    DimLayout,
    build_shard_tensor,
    dim_layout,
    from_local_like,
    sharded_dims,
    sharding_mesh_dims,
    split_rows_by_owner,
)
from physicsnemo_shardext.testing import shard_tensor


# -- DimLayout and split_rows_by_owner: pure arithmetic, one process -----------------------
@pytest.mark.parametrize(
    "sizes,coord,offsets,start,stop",
    [((10, 7), 0, (0, 10), 0, 10), ((10, 7), 1, (0, 10), 10, 17), ((3, 0, 2), 1, (0, 3, 3), 3, 3)],
    ids=["uneven-0", "uneven-1", "empty-middle"],
)
def test_dim_layout_arithmetic(sizes, coord, offsets, start, stop):
    layout = DimLayout(tensor_dim=2, mesh_dim=0, sizes=sizes, coord=coord, mesh=None)
    assert layout.offsets == offsets and (layout.start, layout.stop) == (start, stop)
    assert layout.total == sum(sizes) and layout.local_size == sizes[coord] and layout.parts == len(sizes)


def test_owner_of_skips_empty_shards_and_refuses_rows_outside():
    layout = DimLayout(0, 0, (3, 0, 2), 0, None)
    assert [layout.owner_of(i) for i in range(5)] == [0, 0, 0, 2, 2]
    for outside in (-1, 5):
        with pytest.raises(IndexError, match=f"row {outside} outside a dimension of length 5"):
            layout.owner_of(outside)


def test_a_layout_without_a_mesh_has_no_group():
    with pytest.raises(AssertionError, match="no process group"):
        _ = DimLayout(0, 0, (1, 1), 0, None).group


@pytest.mark.parametrize(
    "sizes,anchors,expected",
    [
        ((3, 0, 2), [0, 2, 2, 4], [(0, 3), (3, 3), (3, 4)]),
        ((6, 5), [], [(0, 0), (0, 0)]),
        ((6, 5), [5, 6, 10], [(0, 1), (1, 3)]),
        ((0, 4), [0, 3], [(0, 0), (0, 2)]),
    ],
    ids=["empty-middle", "no-rows", "uneven", "empty-first"],
)
def test_split_rows_by_owner(sizes, anchors, expected):
    assert split_rows_by_owner(DimLayout(0, 0, sizes, 0, None), anchors) == expected


# -- layouts read from a ShardTensor's spec, on 2 ranks ------------------------------------
@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[6, 5], [11, 0], [0, 11]], ids=["uneven", "empty-last", "empty-first"])
def test_sharded_dims_and_dim_layout_on_uneven_shards(domain_mesh, rank, split):
    x = shard_tensor(torch.randn(2, 11, 4), domain_mesh, [Shard(1)], split)
    layouts = sharded_dims(x)
    assert set(layouts) == {1}
    layout = layouts[1]
    assert (layout.tensor_dim, layout.mesh_dim, layout.sizes, layout.coord) == (1, 0, tuple(split), rank)
    assert layout.mesh is domain_mesh and layout.local_size == x.to_local().shape[1]
    assert (layout.start, layout.stop) == ((0, split[0]), (split[0], 11))[rank]
    assert layout.group_ranks == (0, 1)
    assert dim_layout(x, 1) == layout and dim_layout(x, -2) == layout
    assert dim_layout(x, 0) is None and dim_layout(x, -1) is None


@pytest.mark.multirank(2)
def test_sharded_dims_of_a_replicated_tensor_is_empty(domain_mesh):
    x = shard_tensor(torch.randn(3, 4), domain_mesh, [Replicate()])
    assert sharded_dims(x) == {} and sharding_mesh_dims(x) == []


@pytest.mark.multirank(4)
def test_sharding_mesh_dims_on_2d_meshes(spatial_mesh, ddp_domain_mesh, rank):
    full = torch.randn(2, 5, 6)
    both = shard_tensor(full, spatial_mesh, [Shard(1), Shard(2)], {0: [4, 1], 1: [2, 4]})
    assert sharding_mesh_dims(both) == [0, 1]
    assert {d: layout.sizes for d, layout in sharded_dims(both).items()} == {1: (4, 1), 2: (2, 4)}
    assert {d: layout.mesh_dim for d, layout in sharded_dims(both).items()} == {1: 0, 2: 1}
    domain_only = shard_tensor(full, ddp_domain_mesh, [Replicate(), Shard(1)], {1: [3, 2]})
    assert sharding_mesh_dims(domain_only) == [1]
    (layout,) = sharded_dims(domain_only).values()
    assert (layout.mesh_dim, layout.coord, layout.sizes) == (1, rank % 2, (3, 2))


# -- wrapping a local result, on 2 ranks ---------------------------------------------------
@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[6, 5], [11, 0]], ids=["uneven", "empty-shard"])
def test_build_shard_tensor_records_the_given_sizes(domain_mesh, rank, split):
    full = torch.arange(2 * 11 * 4, dtype=torch.float32).reshape(2, 11, 4)
    local = full[:, sum(split[:rank]) : sum(split[: rank + 1])]
    y = build_shard_tensor(local, domain_mesh, [Shard(1)], sizes_by_tensor_dim={1: split})
    assert [tuple(s) for s in y._spec.sharding_shapes()[0]] == [(2, split[0], 4), (2, split[1], 4)]
    assert y.shape == full.shape
    torch.testing.assert_close(y.full_tensor(), full, rtol=0, atol=0)


@pytest.mark.multirank(2)
def test_build_shard_tensor_refuses_sizes_that_do_not_fit(domain_mesh, rank):
    local = torch.zeros(2, (6, 5)[rank], 4)
    with pytest.raises(ValueError, match="dim 1: 3 sizes for a mesh dim of size 2"):
        build_shard_tensor(local, domain_mesh, [Shard(1)], {1: [6, 3, 2]})
    with pytest.raises(ValueError, match=rf"dim 1: this rank \(coordinate {rank}\) holds {(6, 5)[rank]} rows"):
        build_shard_tensor(local, domain_mesh, [Shard(1)], {1: [5, 6]})


@pytest.mark.multirank(2)
def test_from_local_like_keeps_sizes_or_takes_new_ones(domain_mesh, rank):
    full = torch.randn(2, 11, 4)
    x = shard_tensor(full, domain_mesh, [Shard(1)], [6, 5])
    same = from_local_like(torch.relu(x.to_local()), x)
    assert same._spec.placements == x._spec.placements
    assert same._spec.sharding_shapes() == x._spec.sharding_shapes()
    torch.testing.assert_close(same.full_tensor(), torch.relu(full))
    # A local op that keeps the rows but changes a local dim (channels 4 -> 8).
    wider = from_local_like(x.to_local().repeat(1, 1, 2), x)
    assert wider.shape == (2, 11, 8) and [s[1] for s in wider._spec.sharding_shapes()[0]] == [6, 5]
    # New row counts, keyed by (possibly negative) tensor dim.
    halved = x.to_local()[:, ::2]
    for key in (1, -2):
        y = from_local_like(halved, x, sizes_by_tensor_dim={key: [3, 3]})
        assert [s[1] for s in y._spec.sharding_shapes()[0]] == [3, 3] and y.shape == (2, 6, 4)
    with pytest.raises(ValueError, match="holds"):
        from_local_like(halved, x)  # x's sizes no longer describe the rows


@pytest.mark.multirank(2)
def test_from_local_like_with_other_placements(domain_mesh, rank):
    x = shard_tensor(torch.randn(2, 11, 4), domain_mesh, [Shard(1)], [6, 5])
    moved = x.to_local().transpose(1, 2).contiguous()  # the sharded rows are now dim 2
    y = from_local_like(moved, x, sizes_by_tensor_dim={2: [6, 5]}, placements=[Shard(2)])
    assert y._spec.placements == (Shard(2),) and y.shape == (2, 4, 11)
    assert [s[2] for s in y._spec.sharding_shapes()[0]] == [6, 5]


@pytest.mark.multirank(4)
def test_sharded_dims_refuses_one_dim_sharded_twice(spatial_mesh, rank):
    local = torch.zeros(2, 1, 3)
    nested = build_shard_tensor(local, spatial_mesh, [Replicate(), Shard(1)], {1: [1, 1]})
    assert sharded_dims(nested)[1].sizes == (1, 1)
    with pytest.raises(MissingShardPatch, match="nested sharding"):
        build_shard_tensor(local, spatial_mesh, [Shard(1), Shard(1)], {1: [1, 1]})
