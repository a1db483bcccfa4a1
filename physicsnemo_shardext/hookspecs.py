"""Hook specifications: what a physicsnemo-shardext plugin can implement.

A plugin is a module (or object) published under the ``physicsnemo_shardext``
entry-point group, whose functions carry the `hookimpl`
marker and are named after the hooks below. Each hook is optional.

Examples:
    A plugin with both hooks, checked against these specs the way the loader
    checks an installed plugin:

    >>> import pluggy, torch
    >>> from physicsnemo_shardext import hookimpl, hookspecs
    >>> from physicsnemo_shardext.markers import PROJECT_NAME
    >>> from physicsnemo_shardext.primitives import from_local_like
    >>> def clamp_handler(func, types, args, kwargs):
    ...     # clamp on the local block: elementwise, no communication
    ...     x, *rest = args
    ...     return from_local_like(func(x.to_local(), *rest, **kwargs), x)
    >>> class ClampPlugin:
    ...     @hookimpl
    ...     def shardext_requirements(self):
    ...         return {"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}
    ...     @hookimpl
    ...     def shardext_declare_patches(self, patches):
    ...         patches.function(torch.clamp, clamp_handler)
    >>> manager = pluggy.PluginManager(PROJECT_NAME)
    >>> manager.add_hookspecs(hookspecs)
    >>> _ = manager.register(ClampPlugin(), name="clamp")
    >>> manager.check_pending()
    >>> manager.hook.shardext_requirements()
    [{'nvidia-physicsnemo': '>=2.2,<2.3', 'torch': '>=2.6'}]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from physicsnemo_shardext.declarations import PatchSet
from physicsnemo_shardext.markers import hookspec

__all__ = ["shardext_declare_patches", "shardext_import_after", "shardext_requirements"]


@hookspec
def shardext_requirements() -> Mapping[str, str]:  # type: ignore[empty-body]  # a spec: no body
    """Declare the versions of other distributions this plugin works with.

    Return a mapping from distribution name to a PEP 440 specifier, e.g.
    ``{"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}`` (``"physicsnemo"``
    is accepted as an alias of ``"nvidia-physicsnemo"``). If an installed
    version falls outside a range, or the distribution is missing, the plugin
    is skipped with a `ShardextWarning`
    that says which requirement failed, and none of its patches are installed.

    Called once per plugin, before `shardext_declare_patches`.

    Examples:
        >>> from physicsnemo_shardext import hookimpl
        >>> @hookimpl
        ... def shardext_requirements():
        ...     return {"nvidia-physicsnemo": ">=2.2,<2.3"}
        >>> shardext_requirements()
        {'nvidia-physicsnemo': '>=2.2,<2.3'}
    """


@hookspec
def shardext_import_after() -> Sequence[str]:  # type: ignore[empty-body]  # a spec: no body
    """Name the modules this plugin patches, so that it loads only once they are imported.

    Return module names, e.g. ``["physicsnemo.nn.module.afno_layers"]``. While
    one of them is not imported, the plugin's ``shardext_declare_patches`` does
    not run: its status is ``deferred``, with the module it waits for, and it
    loads (and installs) right after that module's import finishes, whoever
    imports it. A plugin for a heavy module then costs nothing to a program
    that never imports it, and must not import that module at its own top level.

    Called once per plugin, after `shardext_requirements`. A plugin whose modules
    are all imported already loads at once.

    Examples:
        >>> from physicsnemo_shardext import hookimpl
        >>> @hookimpl
        ... def shardext_import_after():
        ...     return ["physicsnemo.nn.module.afno_layers"]
        >>> shardext_import_after()
        ['physicsnemo.nn.module.afno_layers']
    """


@hookspec
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the shard patches this plugin provides.

    Call ``patches.function(target, handler)``, ``patches.dispatch(op, handler)``
    or ``patches.named("ns.op.overload", handler)`` for each patch, with
    optional ``priority=`` (higher wins between plugins), ``override=True``
    (required to replace a PhysicsNeMo built-in handler) and ``description=``.
    Do not write into ShardTensor yourself: the framework installs the whole
    set after the hook returns, or none of it if anything is invalid.

    Args:
        patches: the `PatchSet` collecting this plugin's declarations.

    Examples:
        >>> import torch
        >>> from physicsnemo_shardext import PatchSet, hookimpl
        >>> from physicsnemo_shardext.primitives import from_local_like
        >>> def gelu_handler(func, types, args, kwargs):
        ...     return from_local_like(func(args[0].to_local(), *args[1:], **kwargs), args[0])
        >>> @hookimpl
        ... def shardext_declare_patches(patches):
        ...     patches.function(torch.nn.functional.gelu, gelu_handler,
        ...                      description="GELU on the local shard")
        >>> patches = PatchSet("my_gelu")
        >>> shardext_declare_patches(patches)
        >>> [d.description for d in patches]
        ['GELU on the local shard']
    """
