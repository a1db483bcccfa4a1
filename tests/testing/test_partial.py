"""partial_tensor / partial_values: Partial inputs whose pending reduction is a known full tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.testing import partial_tensor, partial_values

REDUCE = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_terms_reduce_to_the_full_tensor(op, parts):
    full = torch.randn(4, 5, dtype=torch.float64)
    terms = partial_values(full, op, parts, seed=3)
    assert len(terms) == parts and all(t.shape == full.shape and t.dtype == full.dtype for t in terms)
    torch.testing.assert_close(REDUCE[op](torch.stack(terms)), full)
    if parts > 1:
        assert not any(torch.equal(t, full) for t in terms)
    again = partial_values(full, op, parts, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(terms, again))  # every rank draws the same terms


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_are_exact_for_integers(op):
    full = torch.arange(-6, 6).reshape(3, 4)
    terms = partial_values(full, op, 3)
    assert torch.equal(REDUCE[op](torch.stack(terms)), full)


def test_integer_and_complex_sums():
    ints = partial_values(torch.tensor([3, 4]), "sum", 3)
    assert torch.equal(sum(ints), torch.tensor([3, 4]))
    full = torch.randn(3, dtype=torch.complex64)
    torch.testing.assert_close(sum(partial_values(full, "sum", 2)), full)


def test_unsupported_requests_are_refused():
    with pytest.raises(ValueError, match="product"):
        partial_values(torch.ones(2), "product", 2)
    with pytest.raises(ValueError, match="ordered dtype"):
        partial_values(torch.ones(2, dtype=torch.complex64), "max", 2)
    with pytest.raises(ValueError, match="floating-point"):
        partial_values(torch.ones(2, dtype=torch.int64), "avg", 2)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_partial_shard_tensor_reduces_to_full(domain_mesh, rank, op):
    full = torch.randn(4, 6)
    xp = partial_tensor(full, domain_mesh, [Partial(op)])
    assert tuple(xp.placements) == (Partial(op),) and xp.shape == full.shape
    assert torch.equal(xp.to_local(), partial_values(full, op, 2)[rank])
    assert not torch.equal(xp.to_local(), full)
    torch.testing.assert_close(xp.full_tensor(), full)


@pytest.mark.multirank(2)
def test_partial_avg_terms_average_to_full(domain_mesh):
    full = torch.randn(3, 2)
    xp = partial_tensor(full, domain_mesh, [Partial("avg")])
    total = xp.to_local().clone()
    dist.all_reduce(total)  # gloo has no AVG: sum, then divide
    torch.testing.assert_close(total / 2, full)


@pytest.mark.multirank(2)
def test_default_is_partial_sum_and_dtensor_and_grad(domain_mesh):
    full = torch.randn(5, 3)
    xp = partial_tensor(full, domain_mesh, requires_grad=True)
    assert tuple(xp.placements) == (Partial("sum"),) and xp.requires_grad and xp.is_leaf
    dt = partial_tensor(full, domain_mesh, [Partial("max")], dtensor=True)
    assert type(dt) is DTensor and tuple(dt.placements) == (Partial("max"),)
    assert torch.equal(dt.full_tensor(), full)


@pytest.mark.multirank(2)
def test_a_handler_refusal_can_be_tested(domain_mesh):
    # The first-party convolution refuses a Partial input with a bias (the bias would be added per rank).
    full = torch.randn(1, 2, 9)
    weight, bias = torch.randn(3, 2, 3), torch.randn(3)
    xp = partial_tensor(full, domain_mesh, [Partial("sum")])
    with pytest.raises(MissingShardPatch, match="Partial placement"):
        F.conv1d(xp, weight, bias, padding=1)
    torch.testing.assert_close(F.conv1d(xp, weight, padding=1).full_tensor(), F.conv1d(full, weight, padding=1))


@pytest.mark.multirank(4)
def test_shard_and_partial_on_a_2d_mesh(spatial_mesh, rank):
    full = torch.randn(1, 2, 8, 6)
    xp = partial_tensor(full, spatial_mesh, [Shard(2), Partial("sum")], {0: [3, 5]})
    h, _ = spatial_mesh.get_coordinate()
    assert xp.to_local().shape == (1, 2, [3, 5][h], 6)
    torch.testing.assert_close(xp.full_tensor(), full)
    both = partial_tensor(full, spatial_mesh, [Partial("max"), Partial("max")], seed=5)
    assert torch.equal(both.full_tensor(), full)
    assert not torch.equal(both.to_local(), full)
    replicated = partial_tensor(full, spatial_mesh, [Replicate(), Partial("min")])
    assert torch.equal(replicated.full_tensor(), full)


@pytest.mark.multirank(2)
def test_bad_placements_are_refused(domain_mesh, spatial_mesh):
    with pytest.raises(ValueError, match="at least one Partial"):
        partial_tensor(torch.ones(2), domain_mesh, [Shard(0)])
    with pytest.raises(ValueError, match="reduce alike"):
        partial_tensor(torch.ones(2), spatial_mesh, [Partial("sum"), Partial("max")])
    with pytest.raises(ValueError, match="cannot hold the split"):
        partial_tensor(torch.ones(4, 2), spatial_mesh, [Shard(0), Partial()], {0: [3, 1]}, dtensor=True)
