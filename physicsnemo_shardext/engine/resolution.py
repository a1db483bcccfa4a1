"""Pick one handler per registry slot from competing plugin declarations.

The rule depends only on the set of claims, never on the order in which
plugins were discovered or installed:

1. the highest ``priority`` wins;
2. a tie between plugins at the top is resolved by the user's preference list
   (``SHARDEXT_PREFER``: the earliest listed plugin among the tied ones wins);
3. an unresolved tie installs no plugin handler for that slot and is reported
   as a `Conflict`.

Examples:
    >>> import torch
    >>> from physicsnemo_shardext.declarations import PatchDeclaration
    >>> from physicsnemo_shardext.engine.provenance import PluginInfo
    >>> from physicsnemo_shardext.shard_registries import PatchLevel
    >>> def h(func, types, args, kwargs): ...
    >>> low = (PluginInfo("a"), PatchDeclaration(torch.roll, PatchLevel.FUNCTION, h, priority=1))
    >>> high = (PluginInfo("b"), PatchDeclaration(torch.roll, PatchLevel.FUNCTION, h, priority=9))
    >>> winners, conflicts = resolve_claims([low, high], prefer=())
    >>> winners[(PatchLevel.FUNCTION, torch.roll)].winner.name, conflicts
    ('b', [])
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from physicsnemo_shardext.declarations import PatchDeclaration
from physicsnemo_shardext.engine.provenance import Conflict, PluginInfo
from physicsnemo_shardext.shard_registries import SlotKey

__all__ = ["Claim", "Resolution", "resolve_claims"]

Claim = tuple[PluginInfo, PatchDeclaration]


@dataclass(frozen=True)
class Resolution:
    """The outcome for one slot: the winning claim and the names of the losers."""

    winner: PluginInfo
    declaration: PatchDeclaration
    shadowed: tuple[str, ...]


def _preference_rank(plugin: PluginInfo, prefer: Sequence[str]) -> int | None:
    for index, selector in enumerate(prefer):
        if plugin.matches(selector):
            return index
    return None


def _resolve_slot(claims: list[Claim], prefer: Sequence[str]) -> tuple[Resolution | None, Conflict | None]:
    top_priority = max(declaration.priority for _, declaration in claims)
    top = sorted((claim for claim in claims if claim[1].priority == top_priority), key=lambda c: c[0].name)
    others = sorted(
        (claim for claim in claims if claim[1].priority != top_priority),
        key=lambda c: (-c[1].priority, c[0].name),
    )
    if len(top) == 1:
        plugin, declaration = top[0]
        return Resolution(plugin, declaration, tuple(p.name for p, _ in others)), None
    ranked = [(rank, claim) for claim in top if (rank := _preference_rank(claim[0], prefer)) is not None]
    declaration = top[0][1]
    providers = tuple(p.name for p, _ in top)
    if not ranked:
        return None, Conflict(declaration.target_name, declaration.level.value, top_priority, providers)
    _, (plugin, declaration) = min(ranked, key=lambda item: item[0])
    losers = tuple(p.name for p, _ in top if p is not plugin) + tuple(p.name for p, _ in others)
    conflict = Conflict(
        declaration.target_name,
        declaration.level.value,
        top_priority,
        providers,
        winner=plugin.name,
        resolved_by="SHARDEXT_PREFER",
    )
    return Resolution(plugin, declaration, losers), conflict


def resolve_claims(claims: Iterable[Claim], prefer: Sequence[str]) -> tuple[dict[SlotKey, Resolution], list[Conflict]]:
    """Resolve every slot; returns ``({slot: Resolution}, [Conflict, ...])``.

    Slots with an unresolved conflict are absent from the first result.
    """
    by_slot: dict[SlotKey, list[Claim]] = defaultdict(list)
    for plugin, declaration in claims:
        by_slot[declaration.key].append((plugin, declaration))
    winners: dict[SlotKey, Resolution] = {}
    conflicts: list[Conflict] = []
    for slot, slot_claims in by_slot.items():
        resolution, conflict = _resolve_slot(slot_claims, prefer)
        if resolution is not None:
            winners[slot] = resolution
        if conflict is not None:
            conflicts.append(conflict)
    conflicts.sort(key=lambda c: (c.level, c.target))
    return winners, conflicts
