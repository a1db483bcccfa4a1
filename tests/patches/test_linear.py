"""Tests of the first-party linear plugin (patches/linear.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.linear import sharded_linear
from physicsnemo_shardext.testing import ConformanceError, ShardSpec, check_conformance, shard_tensor


def test_linear_override_is_installed_with_provenance():
    record = physicsnemo_shardext.get_registry().provenance(F.linear)
    assert record.declaration.handler is sharded_linear
    assert record.overrides_builtin and record.replaced is physicsnemo_shardext.builtin_handler(F.linear)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[9, 8], [16, 1]], ids=["uneven", "tiny-shard"])
@pytest.mark.parametrize("shape, dim", [((1, 17, 8), 1), ((2, 17, 5, 8), 1)], ids=["3d", "4d-trailing"])
def test_linear_matches_single_process_with_replicate_reduced_grads(domain_mesh, split, shape, dim):
    layer = torch.nn.Linear(8, 3)
    report = check_conformance(layer, [torch.randn(*shape)], ShardSpec(domain_mesh, [Shard(dim)], split))
    assert report.comms.forward.total_calls == 0  # rows are independent
    assert set(report.comms.backward.counts) <= {"c10d.allreduce_", "_c10d_functional.all_reduce"}


@pytest.mark.multirank(2)
def test_plain_parameters_get_full_gradients(domain_mesh):
    check_conformance(
        torch.nn.Linear(8, 2, bias=False),
        [torch.randn(1, 11, 8)],
        ShardSpec(domain_mesh, [Shard(1)], [6, 5]),
        params="plain",
    )


@pytest.mark.multirank(4)
def test_linear_on_ddp_domain_mesh_reduces_only_over_the_domain(ddp_domain_mesh):
    x = torch.randn(2, 13, 8)
    check_conformance(torch.nn.Linear(8, 4), [x], ShardSpec(ddp_domain_mesh, [Replicate(), Shard(1)], {1: [10, 3]}))


@pytest.mark.multirank(2)
def test_builtin_leaves_partial_gradients_that_the_override_fixes(domain_mesh):
    x = torch.randn(1, 9, 8)
    spec = ShardSpec(domain_mesh, [Shard(1)], [5, 4])
    with physicsnemo_shardext.disabled(plugins=["linear"]):
        with pytest.raises(ConformanceError, match="expected Replicate"):
            check_conformance(torch.nn.Linear(8, 3), [x], spec, count_comms=False)
    check_conformance(torch.nn.Linear(8, 3), [x], spec, count_comms=False)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_partial_input_is_summed_first_with_a_replicate_weight_gradient(domain_mesh, rank, bias):
    """GALE's attention projection: a Partial(sum) input is summed, then projected; same value as the built-in."""
    torch.manual_seed(0)
    full, weight = torch.randn(3, 8), torch.randn(2, 8)
    b = torch.randn(2) if bias else None
    share = torch.rand(full.shape)
    local = full * share if rank == 0 else full * (1 - share)  # the two ranks' terms sum to full
    partial = ShardTensor.from_local(local, domain_mesh, [Partial()], sharding_shapes={})
    out = F.linear(partial, weight, b)
    torch.testing.assert_close(out.full_tensor(), F.linear(full, weight, b))
    with physicsnemo_shardext.disabled(plugins=["linear"]):
        builtin = F.linear(partial, weight, b)
    torch.testing.assert_close(out.full_tensor(), builtin.full_tensor())
    assert all(p.is_replicate() for p in out._spec.placements)
    layer = torch.nn.Linear(8, 2, bias=bias)
    reference = copy.deepcopy(layer)
    reference(full).pow(2).sum().backward()
    layer(partial).pow(2).sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


@pytest.mark.multirank(2)
def test_refusals_name_the_configuration(domain_mesh, rank):
    xs = shard_tensor(torch.randn(1, 6, 8), domain_mesh, [Shard(1)], [3, 3])
    sharded_weight = shard_tensor(torch.randn(4, 8), domain_mesh, [Shard(0)], [2, 2])
    with pytest.raises(MissingShardPatch, match=r"linear: weight: expected a replicated tensor, got placements"):
        F.linear(xs, sharded_weight)


# -- F.embedding -----------------------------------------------------------------------------------
@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[7, 3], [10, 0]], ids=["uneven", "empty"])
@pytest.mark.parametrize("params", ["plain", "distribute"])
def test_embedding_of_sharded_ids(domain_mesh, split, params):
    # Token ids sharded on the sequence: a local lookup; the table's gradient summed over the ranks.
    ids = torch.randint(0, 6, (2, 10), generator=torch.Generator().manual_seed(0))
    report = check_conformance(
        torch.nn.Embedding(6, 4, padding_idx=0), [ids], ShardSpec(domain_mesh, [Shard(1)], split), params=params
    )
    assert not report.comms.forward.counts  # no forward communication


@pytest.mark.multirank(2)
def test_embedding_options_that_need_global_ids_keep_the_fallback(domain_mesh):
    ids = torch.randint(0, 6, (1, 8), generator=torch.Generator().manual_seed(0))
    table = torch.randn(6, 4)
    sharded = shard_tensor(ids, domain_mesh, [Shard(1)], [4, 4])
    for options in ({"scale_grad_by_freq": True}, {"sparse": True}):
        outs = []
        for disabled in (False, True):
            with physicsnemo_shardext.disabled(plugins=["linear"] if disabled else []):
                outs.append(F.embedding(sharded, table, **options))
        assert outs[0].placements == outs[1].placements
        assert torch.equal(outs[0].to_local(), outs[1].to_local())
        torch.testing.assert_close(outs[0].full_tensor(), F.embedding(ids, table))
