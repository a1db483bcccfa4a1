"""Tests of physicsnemo_shardext/primitives/checks.py: shared argument checks of shard patches."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives import normalize_dim, require_shard_input
from physicsnemo_shardext.testing import shard_tensor


def test_normalize_dim_wraps_negatives_and_refuses_names_and_out_of_range():
    assert normalize_dim(torch.flip, -2, 3) == 1
    assert normalize_dim(torch.flip, 0, 0) == 0  # a 0-d tensor accepts dim 0 and -1, as torch does
    with pytest.raises(MissingShardPatch, match=r"torch.flip: dim='h'"):
        normalize_dim(torch.flip, "h", 3)
    with pytest.raises(MissingShardPatch, match="dim=True"):
        normalize_dim(torch.flip, True, 3)
    with pytest.raises(IndexError, match="dim 3 out of range"):
        normalize_dim(torch.flip, 3, 3)


def test_plain_tensor_is_refused_naming_the_op():
    with pytest.raises(MissingShardPatch, match="torch.cumsum: the sharded tensor must be the input"):
        require_shard_input(torch.cumsum, torch.ones(2))


@pytest.mark.multirank(2)
def test_partial_input_is_refused_with_the_reason(domain_mesh):
    partial = ShardTensor.from_local(torch.ones(2, 3), domain_mesh, [Partial()], sharding_shapes={})
    with pytest.raises(MissingShardPatch, match=r"Partial placement .*\(a nonlinear op\)"):
        require_shard_input(torch.softmax, partial, "a nonlinear op")
    xs = shard_tensor(torch.ones(4, 2), domain_mesh, [Shard(0)], [3, 1])
    assert require_shard_input(torch.softmax, xs) is xs
