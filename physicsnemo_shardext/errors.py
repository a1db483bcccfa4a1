"""Exceptions and warnings raised by physicsnemo-shardext.

Every error names its culprit (plugin, target, configuration) so that a user
reading a traceback knows which package to blame without a debugger.

Example:
    >>> from physicsnemo_shardext.errors import InvalidPatchDeclaration
    >>> str(InvalidPatchDeclaration("demo", "torch.roll", "handler is not callable"))
    "plugin 'demo' declared an invalid patch for torch.roll: handler is not callable"
"""

from __future__ import annotations

from physicsnemo.domain_parallel.shard_utils.patch_core import MissingShardPatch

__all__ = [
    "InvalidPatchDeclaration",
    "MissingShardPatch",
    "PatchConflictError",
    "PluginLoadError",
    "ShardextError",
    "ShardextWarning",
]


class ShardextError(RuntimeError):
    """Base class of every error raised by the plugin framework."""


class ShardextWarning(UserWarning):
    """Warning category for skipped, failed or overriding plugins.

    Filter it like any warning, e.g. ``warnings.simplefilter("error", ShardextWarning)``.
    """


class InvalidPatchDeclaration(ShardextError, ValueError):
    """A plugin declared a patch that cannot be installed.

    Raised at declaration time, before anything is written into ShardTensor.
    """

    def __init__(self, plugin: str, target: str, reason: str) -> None:
        self.plugin = plugin
        self.target = target
        self.reason = reason
        super().__init__(f"plugin {plugin!r} declared an invalid patch for {target}: {reason}")


class PatchConflictError(ShardextError):
    """Two plugins claim one target at the same priority and nothing resolves the tie."""

    def __init__(self, target: str, level: str, providers: list[str], priority: int) -> None:
        self.target = target
        self.level = level
        self.providers = providers
        self.priority = priority
        names = " and ".join(repr(p) for p in providers)
        super().__init__(
            f"conflict on {level}-level target {target}: plugins {names} both claim it at priority "
            f"{priority}; resolve it with SHARDEXT_PREFER={providers[0]} (or another order), "
            "a different priority, or by disabling one plugin (SHARDEXT_DISABLE)"
        )


class PluginLoadError(ShardextError):
    """A plugin failed to import, raised in a hook, or declared something invalid (strict mode)."""

    def __init__(self, plugin: str, distribution: str, version: str, stage: str, cause: BaseException) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.stage = stage
        self.cause = cause
        super().__init__(
            f"plugin {plugin!r} from {distribution}=={version} failed during {stage}: "
            f"{type(cause).__name__}: {cause}"
        )
