"""Which plugins exist: entry points of the ``physicsnemo_shardext`` group, their identities and name clashes.

A plugin is named by its entry point and owned by its distribution. Two plugins
of different distributions may not share a name (the first party's names are
reserved), and the same plugin seen twice (an editable install beside a wheel)
is one plugin. `engine.loader` asks these questions before importing anything.

Examples:
    >>> names = first_party_names()
    >>> {"pointwise", "convolution"} <= names
    True
    >>> plugin_name_key("My_Plugin") == plugin_name_key("my-plugin")
    True
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from importlib import metadata

from physicsnemo_shardext.engine.provenance import PluginInfo
from physicsnemo_shardext.errors import (
    PluginNameClash,
)
from physicsnemo_shardext.markers import DISTRIBUTION_NAME, PROJECT_NAME

__all__ = [
    "ENTRY_POINT_GROUP",
    "discover_entry_points",
    "first_party_names",
    "is_first_party",
    "name_clashes",
    "plugin_identity",
    "plugin_info_for",
    "plugin_name_key",
]

ENTRY_POINT_GROUP = PROJECT_NAME


def discover_entry_points(group: str = ENTRY_POINT_GROUP) -> list[metadata.EntryPoint]:
    """Entry points of ``group`` from every installed distribution, sorted by name.

    A distribution visible twice on ``sys.path`` contributes its entry points once.
    The order is only for stable output: no loading decision depends on it.
    """
    seen: set[tuple[str, str]] = set()
    unique = []
    for entry_point in metadata.entry_points(group=group):
        distribution = entry_point.dist.name if entry_point.dist is not None else ""
        if (distribution, entry_point.name) in seen:
            continue
        seen.add((distribution, entry_point.name))
        unique.append(entry_point)
    return sorted(unique, key=lambda ep: (ep.name, ep.value))


def plugin_info_for(entry_point: metadata.EntryPoint) -> PluginInfo:
    """Provenance of an entry point: its name, distribution and version."""
    distribution = entry_point.dist
    return PluginInfo(
        name=entry_point.name,
        distribution=distribution.name if distribution is not None else "<unknown>",
        version=distribution.version if distribution is not None else "",
        source="entry-point",
    )


def plugin_name_key(name: str) -> str:
    """Names are compared the way user selectors match them: case and ``-``/``_`` ignored."""
    return name.strip().lower().replace("_", "-")


def _distribution_key(name: str) -> str:
    """PEP 503 normal form: ``Physicsnemo_Shardext`` and ``physicsnemo-shardext`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def plugin_identity(info: PluginInfo) -> tuple[str, str]:
    return (_distribution_key(info.distribution), info.name)


def is_first_party(info: PluginInfo) -> bool:
    return _distribution_key(info.distribution) == _distribution_key(DISTRIBUTION_NAME)


def first_party_names(group: str = ENTRY_POINT_GROUP) -> frozenset[str]:
    """Normalised entry-point names that ``physicsnemo-shardext`` declares (reserved for it).

    Examples:
        >>> "pointwise" in first_party_names()
        True
    """
    try:
        distribution = metadata.distribution(DISTRIBUTION_NAME)
    except metadata.PackageNotFoundError:  # a source tree that is not installed declares none
        return frozenset()
    return frozenset(plugin_name_key(ep.name) for ep in distribution.entry_points if ep.group == group)


def name_clashes(
    candidates: Sequence[PluginInfo], loaded: Iterable[PluginInfo], reserved: Collection[str]
) -> dict[PluginInfo, PluginNameClash]:
    """The candidates that may not load because their name belongs to another distribution.

    The answer depends on the set of candidates only, never on their order:

    * a name already held by a loaded plugin refuses every candidate of another distribution;
    * a ``reserved`` (first-party) name refuses every candidate not from ``physicsnemo-shardext``;
    * otherwise a name published by several distributions refuses all of them.

    Examples:
        >>> a, b = PluginInfo("fast", "a-dist", "1"), PluginInfo("fast", "b-dist", "1")
        >>> sorted(info.distribution for info in name_clashes([b, a], [], reserved=()))
        ['a-dist', 'b-dist']
        >>> list(name_clashes([PluginInfo("pointwise", "evil-dist", "1")], [], reserved={"pointwise"}).values())[0].owner
        'physicsnemo-shardext'
    """
    by_name: dict[str, list[PluginInfo]] = defaultdict(list)
    for info in candidates:
        by_name[plugin_name_key(info.name)].append(info)
    holders = {plugin_name_key(info.name): info for info in loaded}
    refused: dict[PluginInfo, PluginNameClash] = {}
    for name, infos in by_name.items():
        if name in holders:
            refused.update(_refuse_taken(infos, holders[name]))
        elif name in reserved:
            refused.update(_refuse_taken(infos, None))
        elif len({_distribution_key(info.distribution) for info in infos}) > 1:
            distributions = sorted({info.distribution for info in infos})
            refused.update({info: PluginNameClash(info.name, distributions) for info in infos})
    return refused


def _refuse_taken(infos: Iterable[PluginInfo], holder: PluginInfo | None) -> dict[PluginInfo, PluginNameClash]:
    """Refuse each of ``infos`` not from the owner of the name (``holder``, or first party when ``None``)."""
    if holder is None or is_first_party(holder):
        owner, kind = DISTRIBUTION_NAME, "a first-party plugin"
    else:
        owner, kind = holder.distribution, "an already loaded plugin"
    return {
        info: PluginNameClash(info.name, [info.distribution], owner=owner, owner_kind=kind)
        for info in infos
        if _distribution_key(info.distribution) != _distribution_key(owner)
    }
