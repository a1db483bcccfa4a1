"""Tests of the reshard plugin (patches/reshard.py): ShardTensor.redistribute in one collective, or delegated."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext.patches.reshard import chunk_sizes
from physicsnemo_shardext.testing import CommCounter, shard_tensor

# (source placements, sizes of the sharded dim, target placements) on 2 ranks, full shape (2, 6, 5).
MOVES_2 = {
    "S1->S2 uneven": ([Shard(1)], [5, 1], [Shard(2)]),
    "S1->S2 even": ([Shard(1)], [3, 3], [Shard(2)]),
    "S1->S2 empty": ([Shard(1)], [0, 6], [Shard(2)]),
    "S2->S0": ([Shard(2)], [4, 1], [Shard(0)]),
    "S1->R uneven": ([Shard(1)], [5, 1], [Replicate()]),
    "S1->R empty": ([Shard(1)], [6, 0], [Replicate()]),
    "R->S2": ([Replicate()], None, [Shard(2)]),
    "S-1->S-2": ([Shard(2)], [2, 3], [Shard(-2)]),
}


def test_chunk_sizes_match_torch_chunk():
    for total in range(12):
        for parts in range(1, 6):
            pieces = torch.chunk(torch.empty(total), parts) if total else ()
            expected = [p.numel() for p in pieces] + [0] * (parts - len(pieces))
            assert list(chunk_sizes(total, parts)) == expected, (total, parts)


def _run(full: torch.Tensor, mesh: Any, source, sizes, target, weight: torch.Tensor) -> dict[str, Any]:
    """Redistribute, then first- and second-order gradients of a quadratic loss of the result."""
    x = shard_tensor(full, mesh, source, sizes, requires_grad=True)
    y = x.redistribute(mesh, target)
    (grad,) = torch.autograd.grad((y.full_tensor() ** 2 * weight).sum(), x, create_graph=True)
    (grad.full_tensor() * weight).sum().backward()
    return {
        "placements": tuple(y._spec.placements),
        "shapes": y._spec.sharding_shapes(),
        "local": y.to_local().detach(),
        "full": y.full_tensor().detach(),
        "grad": grad.to_local().detach(),
        "grad placements": tuple(grad._spec.placements),
        "second": x.grad.to_local(),
    }


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(MOVES_2))
def test_a_move_equals_physicsnemos_and_single_process_with_second_order_gradients(domain_mesh, name):
    source, sizes, target = MOVES_2[name]
    full = torch.randn(2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weight = torch.rand(2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours = _run(full, domain_mesh, source, sizes, target, weight)
    with physicsnemo_shardext.disabled(plugins=["reshard"]):
        theirs = _run(full, domain_mesh, source, sizes, target, weight)
    assert ours["placements"] == theirs["placements"] and ours["shapes"] == theirs["shapes"], (ours, theirs)
    for key in ("local", "grad", "grad placements", "second"):
        assert torch.equal(ours[key], theirs[key]) if key != "grad placements" else ours[key] == theirs[key], key
    # Single process: y = x, so d/dx sum(w x^2) = 2 w x and d/dx sum(2 w x * w) = 2 w^2.
    torch.testing.assert_close(ours["full"], full, rtol=0, atol=0)
    x = shard_tensor(full, domain_mesh, source, sizes)
    assert torch.equal(ours["grad"], shard_tensor(2 * weight * full, domain_mesh, source, sizes).to_local())
    assert torch.equal(ours["second"], shard_tensor(2 * weight**2, domain_mesh, source, sizes).to_local())
    assert tuple(x._spec.placements) == ours["grad placements"]


def _bytes(full: torch.Tensor, source, sizes, target, mesh) -> tuple[int, dict[str, int]]:
    x = shard_tensor(full, mesh, source, sizes)
    with CommCounter() as counter:
        x.redistribute(mesh, target)
    return counter.stats.total_calls, dict(counter.stats.bytes)


@pytest.mark.multirank(2)
def test_shard_to_shard_sends_only_the_pieces_that_change_owner(domain_mesh, rank):
    full = torch.randn(2, 6, 5)
    calls, sent = _bytes(full, [Shard(1)], [5, 1], [Shard(2)], domain_mesh)
    rows, kept = [5, 1][rank], chunk_sizes(5, 2)[rank]
    assert calls == 1 and sent == {"c10d.alltoall_base_": 2 * rows * (5 - kept) * 4}, sent
    with physicsnemo_shardext.disabled(plugins=["reshard"]):
        their_calls, theirs = _bytes(full, [Shard(1)], [5, 1], [Shard(2)], domain_mesh)
    assert their_calls == 1 and sum(theirs.values()) == 2 * rows * 5 * 4, theirs  # its own piece travels too


@pytest.mark.multirank(2)
def test_shard_to_replicate_is_one_all_gather_and_replicate_to_shard_none(domain_mesh):
    full = torch.randn(2, 6, 5)
    calls, sent = _bytes(full, [Shard(1)], [5, 1], [Replicate()], domain_mesh)
    assert calls == 1 and list(sent) == ["c10d.allgather_"], sent
    calls, sent = _bytes(full, [Replicate()], None, [Shard(2)], domain_mesh)
    assert calls == 0, sent


@pytest.mark.multirank(4)
@pytest.mark.parametrize(
    "source,target",
    [
        ([Shard(1), Shard(2)], [Shard(1), Replicate()]),
        ([Shard(1), Shard(2)], [Shard(3), Shard(2)]),
        ([Shard(1), Replicate()], [Shard(1), Shard(3)]),
    ],
    ids=["S->R inner", "S->S outer", "R->S inner"],
)
def test_one_mesh_dim_of_a_2d_mesh_moves_and_the_other_keeps_its_split(spatial_mesh, source, target):
    full = torch.randn(2, 5, 7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sizes = {m: s for m, s in {0: [4, 1], 1: [2, 5]}.items() if isinstance(source[m], Shard)}
    x = shard_tensor(full, spatial_mesh, source, sizes, requires_grad=True)
    y = x.redistribute(spatial_mesh, target)
    assert tuple(y._spec.placements) == tuple(target)
    torch.testing.assert_close(y.full_tensor(), full, rtol=0, atol=0)
    kept = [(m, p.dim) for m, p in enumerate(target) if p == source[m] and isinstance(p, Shard)]
    for mesh_dim, dim in kept:  # the unchanged mesh dim keeps its uneven split
        assert [s[dim] for s in y._spec.sharding_shapes()[mesh_dim]] == sizes[mesh_dim]
    weight = torch.rand(full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y.full_tensor() * weight).sum().backward()
    assert torch.equal(x.grad.full_tensor(), weight)


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    "source,sizes,target",
    [([Shard(1)], [5, 1], [Shard(1)]), ([Shard(1)], [5, 1], None)],
    ids=["same placements", "no placements"],
)
def test_calls_it_does_not_serve_go_to_physicsnemos_method(domain_mesh, source, sizes, target):
    full = torch.randn(2, 6, 5)
    x = shard_tensor(full, domain_mesh, source, sizes)
    outcomes = []
    for disabled in (False, True):
        with physicsnemo_shardext.disabled(plugins=["reshard"] if disabled else []):
            try:
                y = x.redistribute(domain_mesh, target)
                outcomes.append((tuple(y._spec.placements), y.to_local()))
            except RuntimeError as error:  # PhysicsNeMo's own refusal, raised the same way
                outcomes.append((type(error), str(error)))
    assert outcomes[0][0] == outcomes[1][0] and (
        torch.equal(outcomes[0][1], outcomes[1][1]) if isinstance(outcomes[0][1], torch.Tensor) else True
    )


@pytest.mark.multirank(2)
def test_a_partial_source_goes_to_physicsnemos_method(domain_mesh, rank):
    from physicsnemo_shardext.testing import partial_terms

    full = torch.randn(2, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = []
    for disabled in (False, True):
        with physicsnemo_shardext.disabled(plugins=["reshard"] if disabled else []):
            local, partial = partial_terms(full, domain_mesh, rank)
            with CommCounter() as counter:
                y = partial.redistribute(domain_mesh, [Replicate()])
            results.append((dict(counter.stats.bytes), y.to_local()))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][1], full)


def test_the_plugin_replaces_the_method_and_removing_it_restores_physicsnemos():
    from physicsnemo.domain_parallel import ShardTensor

    registry = physicsnemo_shardext.get_registry()
    assert ShardTensor.redistribute.__wrapped__ is not None
    with registry.disabled(plugins=["reshard"]):
        assert not hasattr(ShardTensor.redistribute, "__wrapped__")
    assert hasattr(ShardTensor.redistribute, "__wrapped__")
