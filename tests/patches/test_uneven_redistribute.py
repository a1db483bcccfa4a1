"""Tests of the first-party uneven_redistribute plugin (patches/uneven_redistribute.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

import physicsnemo_shardext
from physicsnemo_shardext import AttributeTarget, MissingShardPatch, PatchLevel
from physicsnemo_shardext.patches.uneven_redistribute import OWNERS, chunk_mismatches
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

# Ops without a shard patch whose DTensor strategy needs the sharded dim whole.
OPS = {
    "sort": lambda x: torch.sort(x, dim=2).values,
    "topk": lambda x: torch.topk(x, 2, dim=2).values,
    "median": lambda x: x.median(dim=2).values,
    "var": lambda x: x.var(dim=2),
    "std": lambda x: torch.std(x, dim=2),
    "logsumexp": lambda x: torch.logsumexp(x, dim=2),
}


def test_wrappers_are_installed_with_provenance_and_undone_exactly():
    registry = physicsnemo_shardext.get_registry()
    for owner in OWNERS:
        target = AttributeTarget(owner, "redistribute_local_tensor")
        record = registry.provenance(target, PatchLevel.ATTRIBUTE)
        assert record is not None and record.plugin.name == "uneven_redistribute"
        original = physicsnemo_shardext.builtin_handler(target, PatchLevel.ATTRIBUTE)
        assert owner.redistribute_local_tensor.__wrapped__ is original
        with physicsnemo_shardext.disabled(plugins=["uneven_redistribute"]):
            assert owner.redistribute_local_tensor is original


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(OPS))
def test_fallback_ops_on_non_chunk_splits_match_single_process(domain_mesh, name):
    # 7 rows as 5 + 2 (torch.chunk says 4 + 3): PhysicsNeMo 2.2.2's fallback returned wrong values here.
    x = torch.randn(2, 3, 7, 4)
    check_conformance(OPS[name], [x], ShardSpec(domain_mesh, [Shard(2)], [5, 2]), expected_placements=None)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", ["sort", "var"])
def test_without_the_plugin_the_fallback_is_wrong(domain_mesh, name):
    # What the plugin is for: the same call, with it disabled, gives different numbers (no error).
    full = torch.randn(2, 3, 7, 4)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [5, 2])
    # The losses plugin computes var itself; switched off too, to reach the fallback.
    with physicsnemo_shardext.disabled(plugins=["uneven_redistribute", "losses"]):
        try:
            wrong = OPS[name](x).full_tensor()
        except RuntimeError:
            return  # a loud failure is acceptable too
    assert not torch.allclose(wrong, OPS[name](full), atol=1e-4)


@pytest.mark.multirank(4)
@pytest.mark.parametrize(
    ("dim", "split"), [(2, {0: [5, 2], 1: [3, 2]}), (3, {0: [4, 3], 1: [1, 4]})], ids=["gather-H", "gather-W"]
)
def test_on_a_2d_mesh(spatial_mesh, dim, split):
    # The gathered dim is split unevenly and not chunk-sized; the other keeps torch.chunk sizes because
    # PhysicsNeMo labels a fallback output whose placements changed with chunk sizes (it raises a
    # ValueError, loudly, when the untouched dim is split otherwise).
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], split)
    check_conformance(
        lambda x: torch.sort(x, dim=dim).values, [torch.randn(1, 2, 7, 5)], spec, expected_placements=None
    )


@pytest.mark.multirank(2)
def test_chunk_mismatches_and_refusal_without_recorded_sizes(domain_mesh, rank):
    meta = TensorMeta(torch.Size([7]), (1,), torch.float32)
    current = DTensorSpec(domain_mesh, (Shard(0),), tensor_meta=meta)
    target = DTensorSpec(domain_mesh, (Replicate(),), tensor_meta=meta)
    local = torch.zeros(5 if rank == 0 else 2)
    assert chunk_mismatches(local, current, target) == [(0, 0, 4 if rank == 0 else 3)]
    assert chunk_mismatches(torch.zeros(4 if rank == 0 else 3), current, target) == []
    assert chunk_mismatches(local, current, current) == []  # nothing moves
    # A plain DTensor spec records no per-rank sizes: refused, not guessed.
    dt = DTensor.from_local(local, domain_mesh, [Shard(0)], run_check=False, shape=torch.Size([7]), stride=(1,))
    with pytest.raises(MissingShardPatch, match=r"5 local rows where DTensor expects torch.chunk's 4|2 local rows"):
        dt.redistribute(domain_mesh, [Replicate()])


@pytest.mark.multirank(4)
@pytest.mark.parametrize(("rows", "split"), [(10, [3, 3, 2, 2]), (258, [65, 65, 64, 64])], ids=["small", "large"])
def test_every_rank_takes_the_same_path_when_some_blocks_are_chunk_sized(domain_mesh, rows, split):
    # torch.chunk gives 3/3/3/1 and 65/65/65/63: ranks 0 and 1 hold chunk-sized blocks, 2 and 3 do not.
    # Decided per block, the first two ran DTensor's own redistribution and the others the guard's
    # gather or refusal: different collectives, and 4 ranks hung. Decided from the recorded sizes,
    # every rank gathers (right values) or every rank refuses.
    full = torch.randn(1, 3, rows, 5)
    x = shard_tensor(full, domain_mesh, [Shard(2)], split)
    try:
        sorted_values = torch.sort(x, dim=2).values.full_tensor()
    except MissingShardPatch as error:
        assert "torch.chunk" in str(error)
        outcome = "refused"
    else:
        torch.testing.assert_close(sorted_values, torch.sort(full, dim=2).values)
        outcome = "gathered"
    outcomes: list[str | None] = [None] * 4
    dist.all_gather_object(outcomes, outcome)
    assert len(set(outcomes)) == 1, outcomes


def test_chunk_sizes_are_torch_chunks():
    from physicsnemo_shardext.patches.uneven_redistribute import _chunk_sizes

    for total in (0, 1, 7, 10, 258):
        for parts in (1, 2, 3, 4):
            assert _chunk_sizes(total, parts) == [len(c) for c in torch.arange(total).chunk(parts)] + [0] * (
                parts - len(torch.arange(total).chunk(parts))
            ), (total, parts)


def _sort_moved_to_another_dim(mesh, split: list[int]) -> None:
    # At 1x16x256x256 DTensor's strategy for sort moves the shard from H to C (an all-to-all)
    # instead of gathering H. With uneven sizes that move was refused; the guard now gathers H
    # with the true sizes and lets DTensor split C locally: values and gradients as one process.
    x = torch.randn(1, 16, 256, 256)
    check_conformance(
        lambda t: torch.sort(t, dim=2).values, [x], ShardSpec(mesh, [Shard(2)], split), expected_placements=None
    )


@pytest.mark.multirank(2)
def test_a_shard_moved_to_another_dim_is_gathered_then_split(domain_mesh):
    _sort_moved_to_another_dim(domain_mesh, [129, 127])


@pytest.mark.multirank(4)
def test_a_shard_moved_to_another_dim_on_four_ranks(domain_mesh):
    _sort_moved_to_another_dim(domain_mesh, [65, 64, 64, 63])
