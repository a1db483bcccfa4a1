"""Tests of physicsnemo_shardext/primitives/spec.py: the spec's mesh, placements and shard shapes through one door."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_shardext.primitives import (
    mesh_of,
    placements_of,
    shard_shapes_of,
    spec_of,
    spec_shard_shapes,
    spec_with_placements,
    tensor_meta_of,
)
from physicsnemo_shardext.testing import shard_tensor


@pytest.mark.multirank(2)
def test_accessors_agree_with_the_public_dtensor_view(domain_mesh):
    x = shard_tensor(torch.arange(34.0).reshape(17, 2), domain_mesh, [Shard(0)], [12, 5])
    assert mesh_of(x) is x.device_mesh
    assert placements_of(x) == tuple(x.placements) == (Shard(0),)
    assert [s[0] for s in shard_shapes_of(x)[0]] == [12, 5]
    meta = tensor_meta_of(x)
    assert tuple(meta.shape) == (17, 2) and meta.dtype == torch.float32


@pytest.mark.multirank(2)
def test_replicated_shapes_are_the_global_shape(domain_mesh):
    x = shard_tensor(torch.ones(3, 4), domain_mesh, [Replicate()])
    assert placements_of(x) == (Replicate(),)
    assert all(tuple(s) == (3, 4) for shapes in shard_shapes_of(x).values() for s in shapes)


@pytest.mark.multirank(2)
def test_spec_of_is_the_spec_the_accessors_read(domain_mesh):
    x = shard_tensor(torch.arange(34.0).reshape(17, 2), domain_mesh, [Shard(0)], [12, 5])
    spec = spec_of(x)
    assert spec.mesh is mesh_of(x) and tuple(spec.placements) == placements_of(x)
    assert spec_shard_shapes(spec) == shard_shapes_of(x)
    assert spec.tensor_meta == tensor_meta_of(x)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("sizes", [[12, 5], [17, 0]], ids=["uneven", "empty"])
def test_spec_with_placements_is_a_plain_spec_without_recorded_shapes(domain_mesh, sizes):
    x = shard_tensor(torch.arange(34.0).reshape(17, 2), domain_mesh, [Shard(0)], sizes)
    assert [s[0] for s in spec_shard_shapes(spec_of(x))[0]] == sizes
    for placements in ([Replicate()], (Shard(1),)):
        new = spec_with_placements(spec_of(x), placements)
        assert tuple(new.placements) == tuple(placements) and new.mesh is domain_mesh
        assert new.tensor_meta == tensor_meta_of(x) and tuple(new.shape) == (17, 2)
        assert spec_shard_shapes(new) is None  # DTensor's own kind of spec: torch.chunk's shards
    # The ShardTensor's own spec is left as it was.
    assert placements_of(x) == (Shard(0),) and [s[0] for s in shard_shapes_of(x)[0]] == sizes
