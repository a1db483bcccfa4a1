"""physicsnemo-shardext: plugins, first-party patches and multi-rank tests for ShardTensor.

Importing the package

1. makes PhysicsNeMo's built-in shard patches present (PhysicsNeMo itself only
   registers them when CUDA is available), then
2. discovers every plugin published under the ``physicsnemo_shardext``
   entry-point group and installs its patches into ShardTensor's registries,
   with provenance (unless ``SHARDEXT_AUTOLOAD=0``).

Public API (stable names; everything else is internal and may change):

* this package's top level (``__all__`` below): plugin markers and hook types,
  the registry, settings, errors, ``initialize`` / ``shutdown`` / ``exit_rank``;
* ``physicsnemo_shardext.primitives``: the handler vocabulary patches are written in;
* ``physicsnemo_shardext.testing``: multi-rank fixtures, sharding and conformance helpers;
* ``physicsnemo_shardext.training.parallel`` (also ``physicsnemo_shardext.parallel``):
  hybrid ddp x domain training steps (layout, scattering, DDP/FSDP2 wrapping,
  optimizer groups, checkpoints);
* ``physicsnemo_shardext.training.verification`` (also ``physicsnemo_shardext.verification``):
  a hybrid training run checked against single-process training;
* ``physicsnemo_shardext.hookspecs``: the hook specifications (for reading).

The wings (internal; their public classes are re-exported above): ``engine/``
(discovery, registry, resolution, built-ins, provenance), ``tools/`` (what the
``shardext`` command runs), ``training/``, ``ranks/`` (the rank runner) and the
first-party ``patches``. The module map is in ``docs/concepts.md``.

Examples:
    >>> import physicsnemo_shardext as shardext
    >>> registry = shardext.get_registry()
    >>> any(p.plugin.distribution == "physicsnemo-shardext" for p in registry.installed())
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any

from physicsnemo_shardext.declarations import DispatchHandler, FunctionHandler, PatchDeclaration, PatchSet
from physicsnemo_shardext.engine.baseline import builtin_handler, ensure_builtin_patches
from physicsnemo_shardext.engine.loader import PluginLoader, resume_ready
from physicsnemo_shardext.engine.provenance import InstalledPatch, PluginInfo, PluginReport
from physicsnemo_shardext.engine.registry import PatchRegistry
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
from physicsnemo_shardext.markers import hookimpl
from physicsnemo_shardext.settings import Settings
from physicsnemo_shardext.shard_registries import AttributeTarget, PatchLevel, original_attribute
from physicsnemo_shardext.targets import describe_target
from physicsnemo_shardext.training.distributed import distributed_session, exit_rank, initialize, shutdown

__all__ = [
    "AttributeTarget",
    "DispatchHandler",
    "FunctionHandler",
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
    "describe_target",
    "disabled",
    "distributed_session",
    "exit_rank",
    "get_registry",
    "hookimpl",
    "initialize",
    "load_plugin",
    "load_plugins",
    "original_attribute",
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
    check (`PluginNameClash`).
    """
    settings = settings or Settings.from_env()
    ensure_builtin_patches()
    return PluginLoader(_registry, settings).load_entry_points(entry_points)


def load_plugin(plugin: Any, name: str, *, settings: Settings | None = None) -> PluginReport:
    """Install a plugin object directly (no entry point), e.g. from a notebook or a test.

    Examples:
        ```python
        report = physicsnemo_shardext.load_plugin(my_plugin_module, "my-plugin")
        ```
    """
    ensure_builtin_patches()
    loader = PluginLoader(_registry, settings or Settings.from_env())
    return loader.load_plugin(plugin, PluginInfo(name=name))


def disabled(plugins: Iterable[str] = (), targets: Iterable[Any] = ()) -> Any:
    """Context manager: run with plugins/targets switched off (see `PatchRegistry.disabled`)."""
    return _registry.disabled(plugins=plugins, targets=targets)


@contextlib.contextmanager
def sandbox() -> Iterator[Any]:
    """Context manager restoring ShardTensor's registries and the plugin registry on exit.

    A plugin deferred until a module's import, which loaded inside the sandbox, is
    undone with it; it loads again on exit, since that import will not happen twice.
    """
    try:
        with _registry.sandbox() as inner:
            yield inner
    finally:
        resume_ready(_registry)


ensure_builtin_patches()
if _settings.autoload:  # the ``shardext`` console script defers this and loads through its own guard
    load_plugins(_settings)
