"""Discover plugins through entry points and load each one in isolation.

For every entry point in the ``physicsnemo_shardext`` group the loader:

1. applies the user's allow/deny lists (``SHARDEXT_ONLY``, ``SHARDEXT_DISABLE``);
2. imports it and registers it with pluggy;
3. asks its ``shardext_requirements`` hook and skips it if a range is not met;
4. collects its ``shardext_declare_patches`` into a fresh
   :class:`~physicsnemo_shardext.declarations.PatchSet`;
5. hands the whole set to the :class:`~physicsnemo_shardext.registry.PatchRegistry`.

A failure at any step unregisters the plugin, leaves the registries exactly as
they were, warns with the distribution, version and exception (or raises
:class:`~physicsnemo_shardext.errors.PluginLoadError` in strict mode), and the
next plugin loads as usual.

Example:
    >>> import types
    >>> from physicsnemo_shardext.registry import PatchRegistry
    >>> from physicsnemo_shardext.settings import Settings
    >>> plugin = types.ModuleType("empty_plugin")  # a plugin with no hooks declares nothing
    >>> loader = PluginLoader(PatchRegistry(), Settings())
    >>> loader.load_plugin(plugin, PluginInfo("empty")).status.value
    'loaded'
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

import pluggy

from physicsnemo_shardext import hookspecs
from physicsnemo_shardext.compat import incompatibility
from physicsnemo_shardext.declarations import PatchSet
from physicsnemo_shardext.errors import PluginLoadError, ShardextWarning
from physicsnemo_shardext.markers import PROJECT_NAME
from physicsnemo_shardext.provenance import LoadStatus, PluginInfo, PluginReport
from physicsnemo_shardext.registry import PatchRegistry
from physicsnemo_shardext.settings import Settings

__all__ = ["ENTRY_POINT_GROUP", "PluginLoader", "discover_entry_points", "plugin_info_for"]

ENTRY_POINT_GROUP = PROJECT_NAME


def discover_entry_points(group: str = ENTRY_POINT_GROUP) -> list[metadata.EntryPoint]:
    """Entry points of ``group`` from every installed distribution, sorted by name.

    A distribution visible twice on ``sys.path`` contributes its entry points once.
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


class PluginLoader:
    """Loads plugins into a :class:`PatchRegistry`, one at a time, each in isolation."""

    def __init__(self, registry: PatchRegistry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        self.plugin_manager = pluggy.PluginManager(PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)

    def load_entry_points(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> list[PluginReport]:
        """Load the given entry points (default: all discovered ones); returns one report each."""
        if entry_points is None:
            entry_points = discover_entry_points()
        reports = []
        already_loaded = {info.name for info in self.registry.plugins()}
        for entry_point in entry_points:
            info = plugin_info_for(entry_point)
            if info.name in already_loaded:
                continue  # loading twice (e.g. a second load_plugins() call) is a no-op
            blocked = self._blocked_reason(info)
            if blocked is not None:
                reports.append(self._report(PluginReport(info, LoadStatus.BLOCKED, blocked)))
                continue
            try:
                plugin = entry_point.load()
            except Exception as error:  # any import-time failure is the plugin's, not ours
                reports.append(self._fail(info, "import", error))
                continue
            reports.append(self.load_plugin(plugin, info))
        return reports

    def load_plugin(self, plugin: Any, info: PluginInfo) -> PluginReport:
        """Register an already-imported plugin object (module, class or instance)."""
        blocked = self._blocked_reason(info)
        if blocked is not None:
            return self._report(PluginReport(info, LoadStatus.BLOCKED, blocked))
        stage = "register"
        try:
            self.plugin_manager.register(plugin, name=info.name)
        except Exception as error:
            return self._fail(info, stage, error)
        try:
            self.plugin_manager.check_pending()
            stage = "shardext_requirements"
            reason = incompatibility(self._requirements(plugin))
            if reason is not None:
                self.plugin_manager.unregister(plugin)
                warnings.warn(
                    f"skipping plugin {info.label}: it {reason}", ShardextWarning, stacklevel=2
                )
                return self._report(PluginReport(info, LoadStatus.INCOMPATIBLE, reason, stage=stage))
            stage = "shardext_declare_patches"
            patches = PatchSet(plugin=info.name)
            self._hook_for(plugin, "shardext_declare_patches")(patches=patches)
            stage = "install"
            self.registry.add_plugin(info, list(patches))
        except Exception as error:
            self.plugin_manager.unregister(plugin)
            return self._fail(info, stage, error)
        extra = {"not_applicable": list(patches.not_applicable)} if patches.not_applicable else {}
        return self._report(PluginReport(info, LoadStatus.LOADED, patches=len(patches), extra=extra))

    # -- internals -------------------------------------------------------------------------
    def _hook_for(self, plugin: Any, hook_name: str) -> Any:
        """A hook caller that reaches only ``plugin``'s implementation."""
        others = [p for p in self.plugin_manager.get_plugins() if p is not plugin]
        return self.plugin_manager.subset_hook_caller(hook_name, remove_plugins=others)

    def _requirements(self, plugin: Any) -> Mapping[str, str]:
        merged: dict[str, str] = {}
        for result in self._hook_for(plugin, "shardext_requirements")():
            if not isinstance(result, Mapping):
                raise ValueError(f"shardext_requirements must return a mapping, got {type(result).__name__}")
            merged.update(result)
        return merged

    def _blocked_reason(self, info: PluginInfo) -> str | None:
        denied = [s for s in self.settings.deny if info.matches(s)]
        if denied:
            return f"denied by SHARDEXT_DISABLE ({', '.join(denied)})"
        if self.settings.allow is not None and not any(info.matches(s) for s in self.settings.allow):
            return "not in SHARDEXT_ONLY"
        return None

    def _report(self, report: PluginReport) -> PluginReport:
        self.registry.record_report(report)
        return report

    def _fail(self, info: PluginInfo, stage: str, error: BaseException) -> PluginReport:
        failure = PluginLoadError(info.name, info.distribution, info.version, stage, error)
        report = self._report(PluginReport(info, LoadStatus.FAILED, str(failure), stage=stage))
        if self.settings.strict:
            raise failure from error
        warnings.warn(f"{failure}; its patches were not installed", ShardextWarning, stacklevel=3)
        return report
