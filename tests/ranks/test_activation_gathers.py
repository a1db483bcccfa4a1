"""Tests of physicsnemo_shardext.ranks.activation_gathers (detecting all-gathered activations)."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard

from physicsnemo_shardext.ranks import activation_gathers
from physicsnemo_shardext.ranks.activation_gathers import ActivationGatherError, halo_bound
from physicsnemo_shardext.testing import (
    GatherRecorder,
    assert_no_activation_gather,
    shard_tensor,
    smallest_activation_numel,
)


def test_docstring_examples_run():
    result = doctest.testmod(activation_gathers, extraglobs={"torch": torch})
    assert result.attempted >= 2 and result.failed == 0


def test_smallest_activation_counts_inner_feature_maps_only():
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3, stride=2, padding=1),  # (1, 3, 8, 6): 144
        torch.nn.AvgPool2d(2),  # (1, 3, 4, 3): 36
        torch.nn.Upsample(scale_factor=4),  # (1, 3, 16, 12): 576
    )
    x = torch.randn(1, 1, 16, 12)
    assert smallest_activation_numel(net, [x]) == 36
    assert not any(m._forward_hooks for m in net.modules())  # hooks removed


def test_halo_bound_is_world_size_rows_of_the_other_extents():
    assert halo_bound((2, 4, 10, 6), dim=-2, halo=1, world_size=4) == 4 * 1 * (2 * 4 * 6)


@pytest.mark.multirank(2)
def test_records_every_all_gather_flavour(rank):
    with GatherRecorder() as gathers:
        out = torch.empty(2, 3)
        dist.all_gather_into_tensor(out, torch.full((1, 3), float(rank)))
        chunks = [torch.empty(5) for _ in range(2)]
        dist.all_gather(chunks, torch.ones(5))
        funcol.all_gather_tensor(torch.ones(4, 2), gather_dim=0, group=dist.group.WORLD).wait()
        objects = [None, None]
        dist.all_gather_object(objects, {"shape": (1, 2, 3)})
        dist.all_reduce(torch.ones(100))  # not a gather
    by_op = {}
    for record in gathers.records:
        if record.is_data:
            by_op.setdefault(record.op, []).append(record)
    assert by_op["c10d._allgather_base_"][0].payload_shapes == ((1, 3),)
    assert by_op["c10d._allgather_base_"][0].gathered_numel == 6
    assert [r.gathered_numel for r in by_op["c10d.allgather_"]] == [10]
    assert by_op["_c10d_functional.all_gather_into_tensor"][0].gathered_numel == 16
    # all_gather_object moves pickles as uint8 and sizes as int64 (through allgather_ up to
    # torch 2.14, _allgather_base_ from 2.15): recorded, never data.
    metadata = [r for r in gathers.records if not r.is_data]
    assert len(metadata) == 2 and {r.dtype for r in metadata} == {torch.uint8, torch.int64}
    assert gathers.activation_gathers(min_numel=1) == [
        by_op["c10d._allgather_base_"][0],
        by_op["c10d.allgather_"][0],
        by_op["_c10d_functional.all_gather_into_tensor"][0],
    ]
    assert [r.gathered_numel for r in gathers.activation_gathers(min_numel=10)] == [10, 16]


@pytest.mark.multirank(2)
def test_full_tensor_of_an_uneven_activation_is_flagged(domain_mesh):
    conv = torch.nn.Conv2d(2, 4, 3, padding=1)
    x = torch.randn(1, 2, 9, 4)
    floor = smallest_activation_numel(conv, [x])  # 72 (the input)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [6, 3])
    with GatherRecorder() as gathers:
        xs.full_tensor()
    flagged = gathers.activation_gathers(floor)
    assert flagged and flagged[0].gathered_numel >= 72, gathers.describe(floor)
    assert "ACTIVATION" in gathers.describe(floor)
    with pytest.raises(ActivationGatherError, match="all-gathered an activation"):
        assert_no_activation_gather(lambda t: t.full_tensor(), [xs], floor)


@pytest.mark.multirank(2)
def test_statistics_and_local_ops_are_not_flagged(domain_mesh, rank):
    x = torch.randn(1, 4, 9, 4)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [6, 3])
    floor = x.numel()

    def per_channel_stats_by_gather(t):
        local_mean = t.to_local().mean(dim=(0, 2, 3))  # 4 elements per rank
        out = torch.empty(2 * 4)
        dist.all_gather_into_tensor(out, local_mean)
        return torch.relu(t)

    y = assert_no_activation_gather(per_channel_stats_by_gather, [xs], floor)
    assert y.to_local().shape == xs.to_local().shape
    with GatherRecorder() as gathers:
        per_channel_stats_by_gather(xs)
    assert len(gathers.records) == 1 and gathers.records[0].gathered_numel == 8
    assert gathers.activation_gathers(floor) == [] and gathers.activation_gathers(8) == gathers.records
