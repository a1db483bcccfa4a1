"""CommCounter / measure_comms: exact counts and bytes of known collectives, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing import CommCounter, ShardSpec, measure_comms


class _AllReduceBothWays(torch.autograd.Function):
    """Identity-like op with an all_reduce in forward and another in backward."""

    @staticmethod
    def forward(ctx, x):
        y = x.detach().clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


@pytest.mark.multirank(2)
def test_counts_c10d_collectives_with_exact_bytes(world_size):
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(256))  # 256 * 4 B
        dist.broadcast(torch.ones(10, dtype=torch.float64), src=0)  # 80 B
        out = [torch.empty(3, dtype=torch.int32) for _ in range(world_size)]
        dist.all_gather(out, torch.ones(3, dtype=torch.int32))  # this rank's 12 B input
    assert counter.stats.counts == {"c10d.allreduce_": 1, "c10d.broadcast_": 1, "c10d.allgather_": 1}
    assert counter.stats.bytes == {"c10d.allreduce_": 1024, "c10d.broadcast_": 80, "c10d.allgather_": 12}
    assert counter.stats.total_bytes == 1116


@pytest.mark.multirank(2)
def test_counts_functional_collectives():
    with CommCounter() as counter:
        y = funcol.all_reduce(torch.ones(8), "sum", dist.group.WORLD)
        y.wait() if hasattr(y, "wait") else None
    assert counter.stats.counts == {"_c10d_functional.all_reduce": 1}
    assert counter.stats.bytes == {"_c10d_functional.all_reduce": 32}
    assert torch.equal(y, torch.full((8,), 2.0))


@pytest.mark.multirank(2)
def test_sees_the_backward_pass_separately(domain_mesh):
    x = torch.randn(64, requires_grad=True)
    with CommCounter() as forward:
        y = _AllReduceBothWays.apply(x)
    with CommCounter() as backward:
        y.sum().backward()
    assert forward.stats.counts == backward.stats.counts == {"c10d.allreduce_": 1}
    assert forward.stats.bytes == backward.stats.bytes == {"c10d.allreduce_": 256}


@pytest.mark.multirank(2)
def test_measure_comms_splits_forward_and_backward(domain_mesh):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.randn(32, dtype=torch.float64))  # plain: params="plain"

        def forward(self, x):
            return _AllReduceBothWays.apply(self.p * 1.0).sum() + x.full_tensor().sum()

    x = torch.randn(4)
    stats = measure_comms(Model(), [x], ShardSpec(domain_mesh, [Shard(0)]), params="plain")
    assert stats.forward.counts.get("c10d.allreduce_") == 1
    assert stats.forward.bytes["c10d.allreduce_"] == 256
    assert stats.backward.counts.get("c10d.allreduce_") == 1
    assert stats.backward.bytes["c10d.allreduce_"] == 256
    # full_tensor() of the 4-element input is an all_gather of this rank's 2 float32 elements.
    gathers = {k: v for k, v in stats.forward.bytes.items() if "gather" in k}
    assert sum(gathers.values()) == 8, stats.forward


@pytest.mark.multirank(2)
def test_sharded_conv_halo_exchange_is_counted(domain_mesh):
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 17, 8)
    stats = measure_comms(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
    # One halo row (1 x 3 x 1 x 8 float32 = 96 B) goes to the neighbour in forward, in one
    # all-to-all (the convolution family's halo strips: c10d's; PhysicsNeMo's built-in: the functional one) ...
    assert list(stats.forward.counts.values()) == [1], stats.forward
    ((name, sent),) = stats.forward.bytes.items()
    assert "all_to_all" in name or "alltoall" in name, stats.forward
    assert sent == 96
    # ... and the backward reduces the weight and bias grads ((4*3*3*3 + 4) * 4 B = 448 B) and
    # returns the halo row's gradient (96 B) to its owner.
    reduced = {k: v for k, v in stats.backward.bytes.items() if "all_reduce" in k or "allreduce" in k}
    returned = {k: v for k, v in stats.backward.bytes.items() if "all_to_all" in k or "alltoall" in k}
    assert sum(reduced.values()) == 448, stats.backward
    assert sum(returned.values()) == 96, stats.backward


def test_no_collectives_outside_distributed():
    with CommCounter() as counter:
        torch.ones(3).sum()
    assert counter.stats.total_calls == 0
    assert str(counter.stats) == "no collectives"


@pytest.mark.multirank(2)
def test_sees_collectives_issued_inside_dtensor_dispatch(domain_mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    x = distribute_tensor(torch.randn(8, 4), domain_mesh, [Shard(0)])
    with CommCounter() as counter:
        x.redistribute(domain_mesh, [Replicate()])
        (x * 2.0).sum()  # a local DTensor op issues no collective
    # The redistribution all-gathers this rank's 4x4 float32 block inside DTensor's dispatch.
    gathers = {k: v for k, v in counter.stats.bytes.items() if "gather" in k}
    assert sum(gathers.values()) >= 4 * 4 * 4, counter.stats
