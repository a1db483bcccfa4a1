"""The examples shown in docs/testing.md: the page includes these sections, and CI runs them."""

# --8<-- [start:imports]
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.testing import (
    CommCounter,
    ShardSpec,
    check_conformance,
    chunk_split_sizes,
    partial_tensor,
    shard_tensor,
    split_cases,
)

# --8<-- [end:imports]


# --8<-- [start:roundtrip]
@pytest.mark.multirank(2, timeout=60)
def test_roundtrip(domain_mesh, rank):
    full = torch.randn(4, 17)  # identical on every rank (seeded per test)
    xs = shard_tensor(full, domain_mesh, [Shard(1)], sizes_by_mesh_dim=[10, 7])
    assert xs.to_local().shape[1] == (10, 7)[rank]
    assert torch.equal(xs.full_tensor(), full)


# --8<-- [end:roundtrip]


# --8<-- [start:sharding]
@pytest.mark.multirank(4)
def test_sharding_helpers(domain_mesh, spatial_mesh):
    full = torch.randn(1, 2, 8, 6)
    assert chunk_split_sizes(17, 2) == [9, 8]  # torch.chunk semantics, zero-padded
    xs = shard_tensor(full, domain_mesh, [Shard(2)], [3, 2, 2, 1], requires_grad=True)
    ys = shard_tensor(full, spatial_mesh, [Shard(2), Shard(3)], {0: [3, 5], 1: [4, 2]})
    assert torch.equal(xs.full_tensor(), full) and torch.equal(ys.full_tensor(), full)


# --8<-- [end:sharding]


# --8<-- [start:spatial]
@pytest.mark.multirank(2)
def test_2d_sharding_on_two_ranks(spatial_mesh):
    assert tuple(spatial_mesh.shape) == (2, 1)  # (2, N/2): still a 2-D mesh on 2 ranks
    full = torch.randn(1, 2, 8, 6)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [3, 5], 1: [6]})
    check_conformance(torch.nn.Conv2d(2, 3, 3, padding=1), [full], spec)


# --8<-- [end:spatial]


# --8<-- [start:split_cases]
@pytest.mark.multirank(2)
@pytest.mark.parametrize("sizes", split_cases(17, 2))  # ids: balanced-9-8, uneven-6-11, empty-17-0
def test_tanh_on_every_split(domain_mesh, sizes):
    x = torch.randn(3, 17)
    check_conformance(torch.nn.Tanh(), [x], ShardSpec(domain_mesh, [Shard(1)], sizes))


# --8<-- [end:split_cases]


# --8<-- [start:partial]
@pytest.mark.multirank(2)
def test_conv_refuses_a_partial_input_with_a_bias(domain_mesh):
    full = torch.randn(1, 2, 9)
    xp = partial_tensor(full, domain_mesh, [Partial("sum")])  # each rank holds a term; they add up to full
    assert torch.allclose(xp.full_tensor(), full)
    with pytest.raises(MissingShardPatch, match="Partial"):
        F.conv1d(xp, torch.randn(3, 2, 3), torch.randn(3), padding=1)


# --8<-- [end:partial]


# --8<-- [start:conformance]
@pytest.mark.multirank(2)
def test_conv2d_conforms(domain_mesh):
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 17, 8)
    report = check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
    assert report.comms.forward.total_calls > 0  # the halo exchange
    print(report.comms)


# --8<-- [end:conformance]


# --8<-- [start:counting]
@pytest.mark.multirank(2)
def test_counting_collectives(rank):
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(256))
    assert counter.stats.bytes == {"c10d.allreduce_": 1024}


# --8<-- [end:counting]


# --8<-- [start:autocast]
@pytest.mark.multirank(2)
def test_linear_conforms_under_autocast(domain_mesh):
    layer = torch.nn.Linear(6, 4)
    x = torch.randn(2, 17, 6)
    report = check_conformance(layer, [x], ShardSpec(domain_mesh, [Shard(1)], [9, 8]), autocast=torch.bfloat16)
    assert report.autocast == (domain_mesh.device_type, torch.bfloat16)  # "cpu" here, "cuda" on a CUDA mesh
    # atol per tensor = max(atol, 4 * max(e, eps * max|reference|)), e = reference bf16-vs-fp32 error
    print(report.autocast_reference_errors["output[0]"], report.autocast_atols["output[0]"])


# --8<-- [end:autocast]
