"""Sharding helpers (1-D and 2-D meshes, even and uneven), and the CPU bootstrap with scatter_tensor."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_shardext.testing import chunk_split_sizes, shard_tensor, sharding_shapes_for
from physicsnemo_shardext.testing.sharding import normalize_split_sizes


@pytest.mark.parametrize("size,parts", [(17, 2), (5, 4), (8, 4), (0, 3), (3, 5), (100, 7)])
def test_even_split_sizes_match_torch_chunk(size, parts):
    chunks = [c.shape[0] for c in torch.arange(size).chunk(parts)] if size else []
    assert chunk_split_sizes(size, parts) == chunks + [0] * (parts - len(chunks))


def test_split_sizes_are_validated():
    with pytest.raises(ValueError, match="do not partition"):
        normalize_split_sizes((4, 17), (2,), [Shard(1)], [10, 6])
    with pytest.raises(ValueError, match="not Shard"):
        normalize_split_sizes((4, 17), (2,), [Replicate()], [10, 7])
    with pytest.raises(ValueError, match="1-D mesh"):
        normalize_split_sizes((4, 17), (2, 2), [Shard(0), Shard(1)], [10, 7])


def test_sharding_shapes_follow_physicsnemo_convention():
    # rank at coordinate (1, 0): mesh dim 0 varies H, W stays this rank's (4).
    shapes = sharding_shapes_for((1, 2, 8, 6), [Shard(2), Shard(3)], {0: [3, 5], 1: [4, 2]}, (1, 0))
    assert shapes == {0: [(1, 2, 3, 4), (1, 2, 5, 4)], 1: [(1, 2, 5, 4), (1, 2, 5, 2)]}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [None, [10, 7], [17, 0]])
def test_shard_1d(domain_mesh, rank, split):
    full = torch.randn(2, 3, 17, 5)
    xs = shard_tensor(full, domain_mesh, [Shard(2)], split, requires_grad=True)
    sizes = split or [9, 8]
    assert xs.to_local().shape == (2, 3, sizes[rank], 5)
    assert torch.equal(xs.to_local(), full.narrow(2, sum(sizes[:rank]), sizes[rank]))
    assert torch.equal(xs.full_tensor(), full)
    assert xs.requires_grad and xs.is_leaf
    (xs * 2).sum().backward()
    assert torch.equal(xs.grad.full_tensor(), torch.full_like(full, 2.0))


@pytest.mark.multirank(4)
def test_shard_2d_uneven_and_meshes(spatial_mesh, ddp_domain_mesh, rank, world_size):
    assert world_size == 4
    assert spatial_mesh.mesh_dim_names == ("h", "w") and tuple(spatial_mesh.shape) == (2, 2)
    assert ddp_domain_mesh.mesh_dim_names == ("ddp", "domain") and tuple(ddp_domain_mesh.shape) == (2, 2)
    full = torch.randn(1, 2, 8, 6)
    hs, ws = [3, 5], [4, 2]
    h, w = spatial_mesh.get_coordinate()
    xs = shard_tensor(full, spatial_mesh, [Shard(2), Shard(3)], {0: hs, 1: ws}, requires_grad=True)
    assert xs.to_local().shape == (1, 2, hs[h], ws[w])
    expected = full.narrow(2, sum(hs[:h]), hs[h]).narrow(3, sum(ws[:w]), ws[w])
    assert torch.equal(xs.to_local(), expected)
    assert torch.equal(xs.full_tensor(), full)
    xs.sum().backward()
    assert torch.equal(xs.grad.full_tensor(), torch.ones_like(full))
    # Even split on one mesh dim, replicated on the other (data-parallel x domain).
    ys = shard_tensor(full, ddp_domain_mesh, [Replicate(), Shard(3)])
    assert ys.to_local().shape == (1, 2, 8, 3)
    assert torch.equal(ys.full_tensor(), full)


@pytest.mark.multirank(2)
def test_cpu_bootstrap_scatter_tensor(domain_mesh, rank):
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import scatter_tensor

    manager = DistributedManager()
    assert DistributedManager.is_initialized() and manager.world_size == 2 and manager.rank == rank
    full = torch.arange(2 * 9 * 3, dtype=torch.float32).reshape(2, 9, 3)  # 9 = 5 + 4
    xs = scatter_tensor(
        full if rank == 0 else None, 0, domain_mesh, (Shard(1),), global_shape=full.shape, dtype=full.dtype
    )
    assert torch.equal(xs.to_local(), full.chunk(2, dim=1)[rank])
    assert torch.equal(xs.full_tensor(), full)
