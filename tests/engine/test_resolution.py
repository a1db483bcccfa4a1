"""Tests of physicsnemo_shardext.engine.resolution."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from physicsnemo_shardext.declarations import PatchDeclaration
from physicsnemo_shardext.engine.provenance import PluginInfo
from physicsnemo_shardext.engine.resolution import resolve_claims
from physicsnemo_shardext.shard_registries import PatchLevel

SLOT = (PatchLevel.FUNCTION, torch.roll)


def claim(name, priority, distribution=None):
    def handler(func, types, args, kwargs):
        return name

    return (
        PluginInfo(name, distribution=distribution or f"{name}-dist"),
        PatchDeclaration(torch.roll, PatchLevel.FUNCTION, handler, priority=priority),
    )


def test_highest_priority_wins_in_every_order():
    claims = [claim("a", 1), claim("b", 7), claim("c", 3)]
    for order in itertools.permutations(claims):
        winners, conflicts = resolve_claims(order, prefer=())
        assert winners[SLOT].winner.name == "b"
        assert winners[SLOT].shadowed == ("c", "a")
        assert conflicts == []


def test_equal_priority_is_an_unresolved_conflict_naming_both():
    winners, conflicts = resolve_claims([claim("b", 2), claim("a", 2)], prefer=())
    assert SLOT not in winners
    assert conflicts[0].providers == ("a", "b") and conflicts[0].winner is None


def test_preference_resolves_a_tie_in_every_order():
    for order in itertools.permutations([claim("a", 2), claim("b", 2), claim("c", 1)]):
        winners, conflicts = resolve_claims(order, prefer=("b-dist",))
        assert winners[SLOT].winner.name == "b"
        assert conflicts[0].winner == "b" and conflicts[0].resolved_by == "SHARDEXT_PREFER"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=6), st.randoms())
def test_outcome_never_depends_on_claim_order(priorities, random):
    claims = [claim(f"p{i}", priority) for i, priority in enumerate(priorities)]
    shuffled = list(claims)
    random.shuffle(shuffled)
    first, first_conflicts = resolve_claims(claims, prefer=())
    second, second_conflicts = resolve_claims(shuffled, prefer=())
    assert {k: v.winner for k, v in first.items()} == {k: v.winner for k, v in second.items()}
    assert first_conflicts == second_conflicts
    top = max(priorities)
    if priorities.count(top) == 1:
        assert first[SLOT].winner.name == f"p{priorities.index(top)}"
    else:
        assert SLOT not in first and first_conflicts[0].priority == top
