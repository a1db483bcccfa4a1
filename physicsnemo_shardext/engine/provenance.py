"""Records of who provides what: plugins, installed patches, conflicts, load reports.

These are plain frozen dataclasses so that ``shardext list --json`` and tests
can read them without touching the registry's internals.

Examples:
    >>> info = PluginInfo(name="demo", distribution="demo-dist", version="1.0")
    >>> info.label
    'demo (demo-dist==1.0)'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from physicsnemo_shardext.declarations import PatchDeclaration

__all__ = ["Conflict", "InstalledPatch", "LoadStatus", "PluginInfo", "PluginReport"]


@dataclass(frozen=True)
class PluginInfo:
    """Identity of a plugin.

    Attributes:
        name: entry-point name (or the name given to ``load_plugin``).
        distribution: the installed distribution that ships it.
        version: that distribution's version.
        source: ``"entry-point"`` or ``"programmatic"``.
    """

    name: str
    distribution: str = "<programmatic>"
    version: str = ""
    source: str = "programmatic"

    @property
    def label(self) -> str:
        """``name (distribution==version)`` for messages."""
        return f"{self.name} ({self.distribution}=={self.version or '?'})"

    def matches(self, selector: str) -> bool:
        """Whether a user's selector (plugin or distribution name) designates this plugin."""
        normal = selector.strip().lower().replace("_", "-")
        return normal in {self.name.lower().replace("_", "-"), self.distribution.lower().replace("_", "-")}


@dataclass(frozen=True)
class InstalledPatch:
    """Provenance of a handler the framework wrote into ShardTensor.

    Attributes:
        declaration: what the plugin declared (target, level, handler, priority...).
        plugin: who declared it.
        replaced: the handler ShardTensor held before any plugin touched this slot.
        replaced_provider: ``"physicsnemo"``, another module name, or ``None``.
        shadowed: plugins that also claim the slot at a lower priority (or lost a resolved tie).
    """

    declaration: PatchDeclaration
    plugin: PluginInfo
    replaced: Callable | None = None
    replaced_provider: str | None = None
    shadowed: tuple[str, ...] = ()

    @property
    def overrides_builtin(self) -> bool:
        """Whether this handler replaces one of PhysicsNeMo's own."""
        return self.replaced_provider == "physicsnemo"


@dataclass(frozen=True)
class Conflict:
    """Several plugins claim one slot at the same (highest) priority.

    ``winner`` is ``None`` when nothing resolved it: then no plugin handler is
    installed for the slot and ShardTensor keeps what it had before.
    """

    target: str
    level: str
    priority: int
    providers: tuple[str, ...]
    winner: str | None = None
    resolved_by: str | None = None


class LoadStatus(str, Enum):
    """Outcome of trying to load one plugin.

    ``DEFERRED``: the plugin waits for a module named by its ``shardext_import_after``
    hook; its report is replaced by ``LOADED`` (or ``FAILED``) once that module is imported.
    """

    LOADED = "loaded"
    FAILED = "failed"
    BLOCKED = "blocked"
    INCOMPATIBLE = "incompatible"
    DEFERRED = "deferred"


@dataclass(frozen=True)
class PluginReport:
    """What happened to one plugin at load time (shown by ``shardext list`` / ``doctor``)."""

    plugin: PluginInfo
    status: LoadStatus
    reason: str = ""
    patches: int = 0
    stage: str = ""
    extra: dict = field(default_factory=dict, compare=False)
