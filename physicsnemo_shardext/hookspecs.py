"""Hook specifications: what a physicsnemo-shardext plugin can implement.

A plugin is a module (or object) published under the ``physicsnemo_shardext``
entry-point group, whose functions carry the :data:`~physicsnemo_shardext.hookimpl`
marker and are named after the hooks below. Each hook is optional.

Example plugin module::

    import torch
    from physicsnemo_shardext import hookimpl

    @hookimpl
    def shardext_requirements():
        return {"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}

    @hookimpl
    def shardext_declare_patches(patches):
        patches.function(torch.clamp, clamp_handler)
"""

from __future__ import annotations

from collections.abc import Mapping

from physicsnemo_shardext.declarations import PatchSet
from physicsnemo_shardext.markers import hookspec

__all__ = ["shardext_declare_patches", "shardext_requirements"]


@hookspec
def shardext_requirements() -> Mapping[str, str]:
    """Declare the versions of other distributions this plugin works with.

    Return a mapping from distribution name to a PEP 440 specifier, e.g.
    ``{"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}`` (``"physicsnemo"``
    is accepted as an alias of ``"nvidia-physicsnemo"``). If an installed
    version falls outside a range, or the distribution is missing, the plugin
    is skipped with a :class:`~physicsnemo_shardext.errors.ShardextWarning`
    that says which requirement failed, and none of its patches are installed.

    Called once per plugin, before :func:`shardext_declare_patches`.

    Example::

        @hookimpl
        def shardext_requirements():
            return {"nvidia-physicsnemo": ">=2.2,<2.3"}
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
        patches: the :class:`~physicsnemo_shardext.declarations.PatchSet` collecting this plugin's declarations.

    Example::

        @hookimpl
        def shardext_declare_patches(patches):
            patches.function(torch.nn.functional.gelu, local_pointwise,
                             description="GELU on the local shard")
    """
