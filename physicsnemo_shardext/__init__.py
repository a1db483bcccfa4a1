"""physicsnemo-shardext: plugins, first-party patches and multi-rank tests for ShardTensor.

Importing the package

1. makes PhysicsNeMo's built-in shard patches present (PhysicsNeMo itself only
   registers them when CUDA is available), then
2. discovers every plugin published under the ``physicsnemo_shardext``
   entry-point group and installs its patches into ShardTensor's registries,
   with provenance (unless ``SHARDEXT_AUTOLOAD=0``).

Example:
    >>> import physicsnemo_shardext as shardext
    >>> registry = shardext.get_registry()
    >>> any(p.plugin.distribution == "physicsnemo-shardext" for p in registry.installed())
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata
from typing import Any

from physicsnemo_shardext.builtins import builtin_handler, ensure_builtin_patches
from physicsnemo_shardext.declarations import PatchDeclaration, PatchSet
from physicsnemo_shardext.distributed import distributed_session, initialize, shutdown
from physicsnemo_shardext.errors import (
    IncompatiblePluginError,
    InvalidPatchDeclaration,
    MissingShardPatch,
    PatchConflictError,
    PluginLoadError,
    PluginNameClash,
    ShardextError,
    ShardextWarning,
    UndeclaredPatchError,
)
from physicsnemo_shardext.loader import PluginLoader
from physicsnemo_shardext.markers import hookimpl
from physicsnemo_shardext.provenance import InstalledPatch, PluginInfo, PluginReport
from physicsnemo_shardext.registry import PatchRegistry
from physicsnemo_shardext.settings import Settings
from physicsnemo_shardext.shard_registries import AttributeTarget, PatchLevel

__all__ = [
    "AttributeTarget",
    "IncompatiblePluginError",
    "InstalledPatch",
    "InvalidPatchDeclaration",
    "MissingShardPatch",
    "PatchConflictError",
    "PatchDeclaration",
    "PatchLevel",
    "PatchRegistry",
    "PatchSet",
    "PluginInfo",
    "PluginLoadError",
    "PluginNameClash",
    "PluginReport",
    "Settings",
    "ShardextError",
    "ShardextWarning",
    "UndeclaredPatchError",
    "builtin_handler",
    "disabled",
    "distributed_session",
    "get_registry",
    "hookimpl",
    "initialize",
    "load_plugin",
    "load_plugins",
    "sandbox",
    "shutdown",
]

try:
    __version__ = metadata.version("physicsnemo-shardext")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

_settings = Settings.from_env()
_registry = PatchRegistry(prefer=_settings.prefer, strict=_settings.strict, trace=_settings.trace)


def get_registry() -> PatchRegistry:
    """The process-wide registry that owns plugin patches in ShardTensor."""
    return _registry


def load_plugins(settings: Settings | None = None, entry_points: Iterable[Any] | None = None) -> list[PluginReport]:
    """Discover (or take) entry points and install their plugins; returns one report per plugin.

    Runs automatically on import unless ``SHARDEXT_AUTOLOAD=0``. A plugin already
    loaded under the same (distribution, name) is skipped, so calling it again only
    loads what is new; a name held by another distribution is refused at the name
    check (:class:`PluginNameClash`).
    """
    settings = settings or Settings.from_env()
    ensure_builtin_patches()
    return PluginLoader(_registry, settings).load_entry_points(entry_points)


def load_plugin(plugin: Any, name: str, *, settings: Settings | None = None) -> PluginReport:
    """Install a plugin object directly (no entry point), e.g. from a notebook or a test.

    Example::

        report = physicsnemo_shardext.load_plugin(my_plugin_module, "my-plugin")
    """
    ensure_builtin_patches()
    loader = PluginLoader(_registry, settings or Settings.from_env())
    return loader.load_plugin(plugin, PluginInfo(name=name))


def disabled(plugins: Iterable[str] = (), targets: Iterable[Any] = ()) -> Any:
    """Context manager: run with plugins/targets switched off (see :meth:`PatchRegistry.disabled`)."""
    return _registry.disabled(plugins=plugins, targets=targets)


def sandbox() -> Any:
    """Context manager restoring ShardTensor's registries and the plugin registry on exit."""
    return _registry.sandbox()


ensure_builtin_patches()
if _settings.autoload:
    from physicsnemo_shardext import cli as _cli  # imports only the standard library

    if _cli.started_as_cli():
        # The ``shardext`` command: plugins' prints go to stderr (``--json`` stays valid)
        # and what they raise is reported by the command instead of ending it.
        _cli.autoload_for_cli(lambda: load_plugins(_settings))
    else:
        load_plugins(_settings)
