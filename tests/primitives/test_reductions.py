"""Tests of physicsnemo_shardext/primitives/reductions.py: the three gradient contracts of a sum over ranks.

Each contract is checked on every rank for its forward value, its backward
gradient and the number of ``c10d.allreduce_`` calls in each direction, on a
1-D mesh of 2 ranks and over one or both dims of a 2x2 mesh.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch

from physicsnemo_shardext.primitives import (
    all_reduce_sum,
    max_over,
    min_over,
    sum_grad_over,
    sum_to_replicated,
    summed_over,
)
from physicsnemo_shardext.testing import CommCounter

#: name -> (primitive, sums in forward, sums in backward)
CONTRACTS = {
    "sum_grad_over": (sum_grad_over, False, True),
    "all_reduce_sum": (all_reduce_sum, True, True),
    "sum_to_replicated": (sum_to_replicated, True, False),
}


def _value(rank: int) -> torch.Tensor:
    return torch.tensor([[rank + 1.0, 10.0 * (rank + 1)], [-(rank**2), 0.5]], dtype=torch.float64)


def _cotangent(rank: int) -> torch.Tensor:
    return torch.tensor([[rank + 2.0, 1.0], [(rank + 1.0) ** 2, -3.0 * rank]], dtype=torch.float64)


def _group(mesh, mesh_dims, rank: int) -> list[int]:
    """Global ranks summed with ``rank``: those that share its coordinates off ``mesh_dims``."""
    grid = mesh.mesh
    mine = [int(c) for c in (grid == rank).nonzero()[0]]
    members = []
    for other in grid.flatten().tolist():
        theirs = [int(c) for c in (grid == other).nonzero()[0]]
        if all(theirs[d] == mine[d] for d in range(grid.ndim) if d not in mesh_dims):
            members.append(other)
    return members


def _check_contract(mesh, rank: int, name: str, mesh_dims: list[int]) -> None:
    primitive, sums_forward, sums_backward = CONTRACTS[name]
    group = _group(mesh, mesh_dims, rank)
    value = _value(rank).requires_grad_()
    forward, backward = CommCounter(), CommCounter()
    with forward:
        out = primitive(value, mesh, mesh_dims)
    expected = sum(_value(r) for r in group) if sums_forward else _value(rank)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"{name} forward on rank {rank}")
    torch.testing.assert_close(value.detach(), _value(rank), rtol=0, atol=0, msg="the input was written in place")
    with backward:
        out.backward(_cotangent(rank))
    expected_grad = sum(_cotangent(r) for r in group) if sums_backward else _cotangent(rank)
    torch.testing.assert_close(value.grad, expected_grad, rtol=0, atol=0, msg=f"{name} backward on rank {rank}")
    calls = {"c10d.allreduce_": len(mesh_dims)}
    assert forward.stats.counts == (calls if sums_forward else {}), f"{name} forward: {forward.stats}"
    assert backward.stats.counts == (calls if sums_backward else {}), f"{name} backward: {backward.stats}"


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_no_mesh_dims_is_the_identity_without_communication(name):
    primitive = CONTRACTS[name][0]
    value = torch.ones(3, requires_grad=True)
    with CommCounter() as counter:
        assert primitive(value, None, []) is value
    assert counter.stats.total_calls == 0


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_contract_on_two_ranks(domain_mesh, rank, name):
    _check_contract(domain_mesh, rank, name, [0])


@pytest.mark.multirank(4)
@pytest.mark.parametrize("mesh_dims", [[0, 1], [0], [1]], ids=["both", "dim0", "dim1"])
@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_contract_on_a_2x2_mesh(spatial_mesh, rank, name, mesh_dims):
    _check_contract(spatial_mesh, rank, name, mesh_dims)


@pytest.mark.multirank(4)
@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_contract_over_the_domain_dim_of_a_ddp_mesh(ddp_domain_mesh, rank, name):
    # The usual case: sum over the ranks that share one sample's domain, not over replicas.
    _check_contract(ddp_domain_mesh, rank, name, [1])


@pytest.mark.multirank(2)
def test_each_primitive_opens_its_profiler_range(domain_mesh):
    value = torch.ones(2, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for primitive, _, _ in CONTRACTS.values():
            primitive(value, domain_mesh, [0]).sum().backward()
    names = {event.name for event in profile.events()}
    assert {f"shardext.{name}" for name in CONTRACTS} <= names, sorted(n for n in names if "shardext" in n)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_backward_is_differentiable_for_double_backward(domain_mesh, rank, name):
    # The gradient of a gradient (create_graph=True: gradient penalties, PINN residuals
    # of derivatives) goes back through the backward's own sum.
    primitive, _, _ = CONTRACTS[name]
    group = _group(domain_mesh, [0], rank)
    value = _value(rank).requires_grad_()
    cotangent = _cotangent(rank).requires_grad_()
    (grad,) = torch.autograd.grad(primitive(value, domain_mesh, [0]), value, cotangent, create_graph=True)
    (grad * _value(rank)).sum().backward()
    # Second order differentiates the backward's collective: all_reduce_sum's is itself; sum_grad_over's
    # summed gradient is a replicated value (a parameter's gradient), so its adjoint is the identity
    # (sum_to_replicated's), and sum_to_replicated's identity backward sums its gradient in turn.
    expected = sum(_value(r) for r in group) if name in ("all_reduce_sum", "sum_to_replicated") else _value(rank)
    torch.testing.assert_close(cotangent.grad, expected, rtol=0, atol=0, msg=f"{name} double backward on rank {rank}")


@pytest.mark.multirank(4)
@pytest.mark.parametrize("mesh_dims", [[0, 1], [1]], ids=["both", "dim1"])
def test_summed_over_is_the_bare_sum(spatial_mesh, rank, mesh_dims):
    # The collective under the contracts, for hand-written backwards: a new tensor, no graph.
    value = _value(rank).requires_grad_()
    with CommCounter() as counter:
        total = summed_over(value.t(), spatial_mesh, mesh_dims)
    expected = sum(_value(r) for r in _group(spatial_mesh, mesh_dims, rank)).t()
    torch.testing.assert_close(total, expected, rtol=0, atol=0)
    assert not total.requires_grad and total.is_contiguous()
    torch.testing.assert_close(value.detach(), _value(rank), rtol=0, atol=0, msg="the input was written in place")
    assert counter.stats.counts == {"c10d.allreduce_": len(mesh_dims)}


def test_summed_over_a_single_rank_is_a_copy_without_communication():
    from torch.distributed.device_mesh import DeviceMesh

    class OneRank:  # only mesh.size() is read when nothing spans more than one rank
        def size(self, mesh_dim: int) -> int:
            return 1

    value = torch.arange(4.0)
    with CommCounter() as counter:
        total = summed_over(value, cast(DeviceMesh, OneRank()), [0])
    assert total is not value and torch.equal(total, value) and counter.stats.total_calls == 0


# -- max_over / min_over: the elementwise extremum over ranks, no gradient ---------------------------------

EXTREMA = {"max_over": (max_over, torch.maximum), "min_over": (min_over, torch.minimum)}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(EXTREMA))
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64], ids=["float64", "int64"])
def test_extremum_on_two_ranks(domain_mesh, rank, name, dtype):
    primitive, pairwise = EXTREMA[name]
    value = _value(rank).to(dtype)
    if dtype.is_floating_point:
        value.requires_grad_()
    with CommCounter() as counter:
        out = primitive(value.t(), domain_mesh, [0])
    expected = pairwise(_value(0), _value(1)).to(dtype).t()
    torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"{name} on rank {rank}")
    assert out.dtype == dtype and out.is_contiguous() and not out.requires_grad
    torch.testing.assert_close(
        value.detach(), _value(rank).to(dtype), rtol=0, atol=0, msg="the input was written in place"
    )
    assert counter.stats.counts == {"c10d.allreduce_": 1}


@pytest.mark.multirank(4)
@pytest.mark.parametrize("mesh_dims", [[0, 1], [0], [1]], ids=["both", "dim0", "dim1"])
@pytest.mark.parametrize("name", sorted(EXTREMA))
def test_extremum_on_a_2x2_mesh(spatial_mesh, rank, name, mesh_dims):
    primitive, pairwise = EXTREMA[name]
    with CommCounter() as counter:
        out = primitive(_value(rank), spatial_mesh, mesh_dims)
    group = _group(spatial_mesh, mesh_dims, rank)
    expected = _value(group[0])
    for other in group[1:]:
        expected = pairwise(expected, _value(other))
    torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"{name} over {mesh_dims} on rank {rank}")
    assert counter.stats.counts == {"c10d.allreduce_": len(mesh_dims)}


@pytest.mark.multirank(2)
def test_a_rank_without_rows_passes_the_identity(domain_mesh, rank):
    # A softmax row max over a dim split 3 + 0: the empty shard contributes -inf (max) or +inf (min).
    rows = [torch.tensor([[1.0, -2.0, 7.0], [-1.0, -5.0, 0.5]]), torch.empty(2, 0)][rank]
    row_max = rows.amax(1, keepdim=True) if rows.shape[1] else torch.full((2, 1), float("-inf"))
    row_min = rows.amin(1, keepdim=True) if rows.shape[1] else torch.full((2, 1), float("inf"))
    assert max_over(row_max, domain_mesh, [0]).flatten().tolist() == [7.0, 0.5]
    assert min_over(row_min, domain_mesh, [0]).flatten().tolist() == [-2.0, -5.0]
    # A row masked everywhere stays -inf, as in torch.
    assert max_over(torch.full((1,), float("-inf")), domain_mesh, [0]).item() == float("-inf")


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(EXTREMA))
def test_extremum_of_empty_tensors(domain_mesh, name):
    # Every rank's share is empty (a pooled output with no rows here): nothing to reduce, no error.
    out = EXTREMA[name][0](torch.empty(0, 3), domain_mesh, [0])
    assert out.shape == (0, 3)


@pytest.mark.multirank(2)
def test_extrema_open_their_profiler_ranges(domain_mesh):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for primitive, _ in EXTREMA.values():
            primitive(torch.ones(2), domain_mesh, [0])
    names = {event.name for event in profile.events()}
    assert {f"shardext.{name}" for name in EXTREMA} <= names, sorted(n for n in names if "shardext" in n)


@pytest.mark.parametrize("name", sorted(EXTREMA))
def test_extremum_over_a_single_rank_is_a_copy_without_communication(name):
    from torch.distributed.device_mesh import DeviceMesh

    class OneRank:  # only mesh.size() is read when nothing spans more than one rank
        def size(self, mesh_dim: int) -> int:
            return 1

    value = torch.arange(4.0)
    with CommCounter() as counter:
        out = EXTREMA[name][0](value, cast(DeviceMesh, OneRank()), [0])
    assert out is not value and torch.equal(out, value) and counter.stats.total_calls == 0
    assert EXTREMA[name][0](value, None, []) is not value
