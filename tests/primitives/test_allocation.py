"""Tests of physicsnemo_shardext/primitives/allocation.py: scratch buffers allocated sharded."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard

from physicsnemo_shardext.primitives import sharded_dims
from physicsnemo_shardext.primitives.allocation import sharded_allocations
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor


@pytest.mark.multirank(2)
def test_buffers_matching_a_sharded_tensor_are_sharded_like_it(domain_mesh):
    x = shard_tensor(torch.randn(2, 7, 5), domain_mesh, [Shard(1)], [6, 1])
    with sharded_allocations():
        y = x * 2  # seen inside the scope
        zeros = torch.zeros(2, 7, 5, 3)  # dims 0..2 line up with y: sharded like it, extra dim local
        full = torch.full((4, 7), 1.5)  # dim 1 matches the sharded dim: sharded too
        other = torch.zeros(2, 6, 5)  # sharded dim of another size: left plain
        wants_grad = torch.zeros(2, 7, 5, requires_grad=True)  # a leaf the caller will train: left plain
    assert isinstance(zeros, ShardTensor) and isinstance(full, ShardTensor)
    assert sharded_dims(zeros)[1].sizes == (6, 1) and zeros.to_local().shape[1] == sharded_dims(y)[1].local_size
    torch.testing.assert_close(zeros.full_tensor(), torch.zeros(2, 7, 5, 3), rtol=0, atol=0)
    torch.testing.assert_close(full.full_tensor(), torch.full((4, 7), 1.5), rtol=0, atol=0)
    assert type(other) is torch.Tensor and type(wants_grad) is torch.Tensor
    assert type(torch.zeros(2, 7, 5)) is torch.Tensor  # outside the scope: untouched


@pytest.mark.multirank(2)
def test_nothing_changes_before_a_sharded_tensor_is_seen(domain_mesh):
    with sharded_allocations():
        assert type(torch.zeros(2, 7, 5)) is torch.Tensor


class TextbookBlock(torch.nn.Module):
    """Fill a plain-looking ``torch.zeros`` buffer by slice assignment; inside the scope it stays sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sharded_allocations():
            hidden = torch.einsum("bhc,cd->bhd", x, self.weight)
            out = torch.zeros(hidden.shape)
            out[:, :, :3] = torch.relu(hidden[:, :, :3])
            return out * 2


@pytest.mark.multirank(2)
def test_a_block_filling_zeros_stays_sharded_and_matches_single_process(domain_mesh):
    report = check_conformance(TextbookBlock(), [torch.randn(2, 9, 5)], ShardSpec(domain_mesh, [Shard(1)], [7, 2]))
    assert report.comms.forward.total_calls == 0  # no gather into a replicated buffer
