"""Tests of patches/roll_flip.py: roll and flip keep placements and uneven sizes, move only rows that change rank."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext.patches.roll_flip import FLIP_TARGETS, ROLL_TARGETS, sharded_flip, sharded_roll
from physicsnemo_shardext.testing import CommCounter, ShardSpec, check_conformance, check_delegation, shard_tensor

SHAPE = (2, 3, 17, 5)  # sharded along dim 2
ROW_BYTES = 2 * 3 * 5 * 4  # one float32 row of dim 2


def test_every_target_is_installed_by_the_plugin():
    registry = physicsnemo_shardext.get_registry()
    for target in ROLL_TARGETS:
        assert registry.provenance(target).declaration.handler is sharded_roll
    for target in FLIP_TARGETS:
        assert registry.provenance(target).declaration.handler is sharded_flip


def _offsets(split: list[int]) -> list[int]:
    return [sum(split[:c]) for c in range(len(split))]


def moved_rows(split: list[int], coord: int, source_of) -> int:
    """Analytic count of the rows ``coord`` sends: its rows that land on another coordinate's range."""
    start, stop = _offsets(split)[coord], _offsets(split)[coord] + split[coord]
    n = sum(split)
    targets = [i for i in range(n) if start <= source_of(i) < stop]  # output rows fed by my rows
    return sum(1 for i in targets if not start <= i < stop)


ROLLS = {
    "shift3": (lambda x: torch.roll(x, 3, 2), 3),
    "negative": (lambda x: x.roll(-5, dims=2), -5),
    "larger-than-dim": (lambda x: torch.roll(x, shifts=40, dims=-2), 40),
    "with-unsharded-dims": (lambda x: torch.roll(x, (2, -1, 1), (2, 3, 0)), 2),
    "repeated-dim": (lambda x: torch.roll(x, (1, 3), (2, 2)), 4),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(ROLLS))
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [17, 0]], ids=["uneven", "tiny", "empty"])
def test_roll_matches_and_moves_only_crossing_rows(domain_mesh, rank, name, split):
    fn, shift = ROLLS[name]
    report = check_conformance(fn, [torch.randn(SHAPE)], ShardSpec(domain_mesh, [Shard(2)], split))
    n = sum(split)
    s = shift % n
    bound = min(s, n - s, split[rank]) * ROW_BYTES  # rows moved <= min(shift, n - shift, local rows)
    assert report.comms.forward.total_bytes == moved_rows(split, rank, lambda i: (i - shift) % n) * ROW_BYTES
    assert report.comms.forward.total_bytes <= bound
    assert report.comms.backward.total_bytes <= bound


FLIPS = {
    "flip": lambda x: torch.flip(x, [2]),
    "flip-two-dims": lambda x: torch.flip(x, (3, -2)),
    "method-varargs": lambda x: x.flip(2, 0),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(FLIPS))
@pytest.mark.parametrize("split", [[5, 12], [16, 1], [0, 17]], ids=["uneven", "tiny", "empty"])
def test_flip_matches_and_moves_only_mirrored_rows(domain_mesh, rank, name, split):
    report = check_conformance(FLIPS[name], [torch.randn(SHAPE)], ShardSpec(domain_mesh, [Shard(2)], split))
    moved = moved_rows(split, rank, lambda i: 16 - i)
    assert report.comms.forward.total_bytes == moved * ROW_BYTES
    assert report.comms.forward.total_bytes <= split[rank] * ROW_BYTES
    assert report.comms.backward.total_bytes == moved * ROW_BYTES


@pytest.mark.multirank(2)
def test_fliplr_flipud_of_a_matrix(domain_mesh):
    x = torch.randn(9, 6)
    check_conformance(torch.flipud, [x], ShardSpec(domain_mesh, [Shard(0)], [7, 2]))
    check_conformance(lambda t: t.fliplr(), [x], ShardSpec(domain_mesh, [Shard(1)], [1, 5]))


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[5, 4, 4, 4], [1, 15, 0, 1]], ids=["even", "tiny-and-empty"])
def test_roll_and_flip_on_four_ranks(domain_mesh, split):
    x = torch.randn(SHAPE)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    check_conformance(lambda t: torch.roll(t, -7, 2), [x], spec)
    check_conformance(lambda t: torch.flip(t, [2, 1]), [x], spec)


@pytest.mark.multirank(4)
def test_roll_and_flip_on_spatial_mesh(spatial_mesh):
    x = torch.randn(1, 2, 9, 7)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [8, 1], 1: [2, 5]})
    report = check_conformance(lambda t: torch.roll(t, (3, -2), (2, 3)), [x], spec)
    assert report.output_placements == [(Shard(2), Shard(3))]
    assert report.comms.forward.counts == {"c10d.alltoall_base_": 2}  # one exchange per sharded dim
    check_conformance(lambda t: torch.flip(t, [3, 2]), [x], spec)


def _splits(total: int, parts: int) -> st.SearchStrategy[list[int]]:
    cuts = st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1).map(sorted)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *c], [*c, total])])


@pytest.mark.multirank(4)
def test_random_splits_and_shifts_roll(domain_mesh, rank):
    seen: list[tuple[list[int], int]] = []

    @settings(derandomize=True, database=None, deadline=None, max_examples=8, suppress_health_check=list(HealthCheck))
    @given(split=_splits(11, 4), shift=st.integers(-25, 25))
    def check(split: list[int], shift: int) -> None:
        seen.append((split, shift))
        report = check_conformance(
            lambda t: torch.roll(t, shift, 1), [torch.randn(3, 11, 2)], ShardSpec(domain_mesh, [Shard(1)], split)
        )
        moved = moved_rows(split, rank, lambda i: (i - shift) % 11)
        assert report.comms.forward.total_bytes == moved * 3 * 2 * 4

    check()
    assert len(seen) >= 4  # hypothesis really drew examples on this rank
    gathered: list[object] = [None] * 4
    torch.distributed.all_gather_object(gathered, seen)
    assert all(g == seen for g in gathered)  # identical examples on every rank


@pytest.mark.multirank(2)
def test_patch_moves_less_than_dtensor_fallback(domain_mesh, rank):
    # A torch.chunk-style split (33/32): the fallback aborts gloo on other uneven splits.
    full = torch.randn(2, 4, 65, 8)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [33, 32])
    row = 2 * 4 * 8 * 4
    for fn, bound in [(lambda t: torch.roll(t, 3, 2), 3 * row), (lambda t: torch.flip(t, [2]), 32 * row)]:
        with torch.no_grad(), CommCounter() as patched:
            fn(x)
        with physicsnemo_shardext.disabled(plugins=["roll_flip"]), torch.no_grad(), CommCounter() as fallback:
            fn(x)
        assert fallback.stats.total_bytes >= [33, 32][rank] * row  # the fallback all-gathers the activation
        assert patched.stats.total_bytes <= bound < fallback.stats.total_bytes


PARTIAL_PERMUTATIONS = {
    "roll": lambda t: torch.roll(t, 1, 0),
    "roll-no-dims": lambda t: torch.roll(t, 2),
    "Tensor.roll": lambda t: t.roll((1, 2), (0, 1)),
    "flip": lambda t: torch.flip(t, [0, 1]),
    "fliplr": lambda t: torch.fliplr(t),
    "Tensor.flipud": lambda t: t.flipud(),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(PARTIAL_PERMUTATIONS))
def test_partial_input_is_delegated_to_the_fallback(domain_mesh, rank, name):
    # A permutation of a pending sum: the DTensor fallback permutes each rank's term.
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    check_delegation(PARTIAL_PERMUTATIONS[name], full, domain_mesh, rank, "roll_flip", (Partial(),), exact=False)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [None, [3, 2]], ids=["even", "uneven"])
def test_roll_without_dims_of_a_sharded_tensor_is_delegated(domain_mesh, split):
    # A roll of the flattened tensor: the DTensor fallback gathers it (forward and grads right).
    x = torch.randn(5, 6)
    check_conformance(
        lambda t: torch.roll(t, 3), [x], ShardSpec(domain_mesh, [Shard(0)], split), expected_placements=[Replicate()]
    )
    out = torch.roll(shard_tensor(x, domain_mesh, [Shard(0)], split), 3)
    with physicsnemo_shardext.disabled(plugins=["roll_flip"]):
        baseline = torch.roll(shard_tensor(x, domain_mesh, [Shard(0)], split), 3)
    assert tuple(out._spec.placements) == tuple(baseline._spec.placements)
    torch.testing.assert_close(out.to_local(), baseline.to_local())
