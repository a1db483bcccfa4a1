"""Exceptions and warnings raised by physicsnemo-shardext.

Every error names its culprit (plugin, target, configuration) so that a user
reading a traceback knows which package to blame without a debugger.

Examples:
    >>> from physicsnemo_shardext.errors import InvalidPatchDeclaration
    >>> str(InvalidPatchDeclaration("demo", "torch.roll", "handler is not callable"))
    "plugin 'demo' declared an invalid patch for torch.roll: handler is not callable"
"""

from __future__ import annotations

from physicsnemo.domain_parallel.shard_utils.patch_core import MissingShardPatch

__all__ = [
    "IncompatiblePluginError",
    "InvalidPatchDeclaration",
    "MissingShardPatch",
    "PatchConflictError",
    "PluginLoadError",
    "PluginHookError",
    "PluginNameClash",
    "ReentrantLoadError",
    "ShardextError",
    "ShardextWarning",
    "UndeclaredPatchError",
    "describe_exception",
    "is_user_interrupt",
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


def is_user_interrupt(error: BaseException) -> bool:
    """Whether ``error`` is a user's Ctrl-C (exactly ``KeyboardInterrupt``), which must propagate.

    Examples:
        >>> class PluginPanic(KeyboardInterrupt): ...
        >>> is_user_interrupt(KeyboardInterrupt()), is_user_interrupt(PluginPanic()), is_user_interrupt(SystemExit(3))
        (True, False, False)
    """
    # SIGINT's default handler raises this exact type; a subclass can only come from a plugin.
    return type(error) is KeyboardInterrupt


def describe_exception(error: BaseException) -> str:
    """``Type: message`` of any exception, even one whose ``__str__`` itself raises.

    Examples:
        >>> describe_exception(SystemExit(3)), describe_exception(GeneratorExit())
        ('SystemExit: 3', 'GeneratorExit')
        >>> class Rude(Exception):
        ...     def __str__(self):
        ...         raise SystemExit(1)
        >>> describe_exception(Rude())
        'Rude: <unprintable Rude>'
    """
    try:
        message = str(error)
    except BaseException as inner:  # a plugin's exception must not break (or exit) the report about it
        if is_user_interrupt(inner):
            raise
        message = f"<unprintable {type(error).__name__}>"
    name = type(error).__name__
    return f"{name}: {message}" if message else name


class PluginLoadError(ShardextError):
    """A plugin failed to import, raised in a hook, or declared something invalid (strict mode).

    ``detail`` is appended to the message (e.g. that registry writes were rolled back).
    ``cause`` is whatever the plugin raised (any ``BaseException``, ``SystemExit``
    included), or one of `UndeclaredPatchError`, `PluginNameClash`,
    `IncompatiblePluginError` for problems the framework found itself.

    Examples:
        >>> str(PluginLoadError("demo", "demo-dist", "1.0", "import", SystemExit(3)))
        "plugin 'demo' from demo-dist==1.0 failed during import: SystemExit: 3 (a BaseException: contained, loading a plugin never ends the program)"
    """

    def __init__(
        self, plugin: str, distribution: str, version: str, stage: str, cause: BaseException, *, detail: str = ""
    ) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.stage = stage
        self.cause = cause
        # Say why an exit did not exit: the plugin author would otherwise expect it to.
        note = (
            ""
            if isinstance(cause, Exception)
            else " (a BaseException: contained, loading a plugin never ends the program)"
        )
        super().__init__(
            f"plugin {plugin!r} from {distribution}=={version} failed during {stage}: "
            f"{describe_exception(cause)}{note}{'; ' + detail if detail else ''}"
        )


class UndeclaredPatchError(ShardextError):
    """A plugin wrote into ShardTensor's registries itself instead of declaring patches.

    Found by comparing snapshots taken around the plugin's import and hook calls;
    the writes are rolled back before the error is reported.

    Examples:
        >>> str(UndeclaredPatchError(["_function_registry[torch.roll]: added m.h"], ["patches.function(torch.roll, m.h)"]))
        "wrote into ShardTensor's registries outside the hooks (_function_registry[torch.roll]: added m.h); the writes were rolled back. Declare the patch in a shardext_declare_patches hook instead: patches.function(torch.roll, m.h), with override=True where it replaces an existing handler"
    """

    def __init__(self, changes: list[str], hints: list[str]) -> None:
        self.changes = list(changes)
        self.hints = list(hints)
        how = "; ".join(hints) or "patches.function/dispatch/named/replace_attribute"
        super().__init__(
            f"wrote into ShardTensor's registries outside the hooks ({'; '.join(changes)}); the writes were "
            f"rolled back. Declare the patch in a shardext_declare_patches hook instead: {how}, "
            "with override=True where it replaces an existing handler"
        )


class PluginNameClash(ShardextError):
    """Two distributions publish a plugin under the same entry-point name.

    A plugin is identified by (distribution, entry-point name); since users select
    plugins by name (``SHARDEXT_DISABLE``, ``SHARDEXT_PREFER``), a name must belong
    to one distribution.

    Examples:
        >>> str(PluginNameClash("pointwise", ["evil-dist"], owner="physicsnemo-shardext", owner_kind="a first-party plugin"))
        "the name 'pointwise' belongs to a first-party plugin of physicsnemo-shardext and cannot be taken by evil-dist; publish the entry point under another name"
        >>> str(PluginNameClash("fast", ["b-dist", "a-dist"]))
        "distributions a-dist and b-dist both publish a plugin named 'fast', so neither is loaded; keep one with SHARDEXT_DISABLE=a-dist or SHARDEXT_DISABLE=b-dist, or rename one entry point"
    """

    def __init__(
        self, plugin: str, distributions: list[str], *, owner: str | None = None, owner_kind: str = ""
    ) -> None:
        self.plugin = plugin
        self.distributions = sorted(distributions)
        self.owner = owner
        if owner is not None:
            message = (
                f"the name {plugin!r} belongs to {owner_kind or 'a plugin'} of {owner} and cannot be taken by "
                f"{' and '.join(self.distributions)}; publish the entry point under another name"
            )
        else:
            names = " and ".join(self.distributions)
            keep = " or ".join(f"SHARDEXT_DISABLE={d}" for d in self.distributions)
            message = (
                f"distributions {names} both publish a plugin named {plugin!r}, so neither is loaded; "
                f"keep one with {keep}, or rename one entry point"
            )
        super().__init__(message)


class IncompatiblePluginError(ShardextError):
    """A plugin's ``shardext_requirements`` are not met (an error in strict mode only).

    Examples:
        >>> str(IncompatiblePluginError("requires torch<1.0, but torch 2.5 is installed"))
        'it requires torch<1.0, but torch 2.5 is installed, so it was skipped'
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"it {reason}, so it was skipped")


class PluginHookError(ShardextError):
    """A plugin's hooks can provide nothing: a hook-named function lacks ``@hookimpl``, or no hook is implemented.

    pluggy only calls functions that carry the ``hookimpl`` marker, so such a plugin
    would load "successfully" with no patches. The loader warns about it (strict mode:
    raises `PluginLoadError` with this as its cause, at the ``hook check`` stage).

    Examples:
        >>> str(PluginHookError(["shardext_declare_patches() lacks the @hookimpl marker"]))
        'its hooks provide nothing as written: shardext_declare_patches() lacks the @hookimpl marker'
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"its hooks provide nothing as written: {'; '.join(self.problems)}")


class ReentrantLoadError(ShardextError):
    """Plugins were loaded from inside a plugin's own load (its import or one of its hooks).

    A nested load would install plugins in the middle of another plugin's isolated
    load, so the framework refuses it: with a `ShardextWarning` (the nested call loads
    nothing; the load in progress loads every plugin anyway), or with this error in
    strict mode. ``plugin``, ``distribution``, ``version`` and ``stage`` name the plugin
    being loaded when the call was made; ``call`` is what was called.

    Examples:
        >>> print(ReentrantLoadError("greedy", "greedy-dist", "1.0", "import", "load_plugins()"))
        load_plugins() was called while plugin 'greedy' from greedy-dist==1.0 was being loaded (during its import); plugins cannot be loaded from inside a plugin's load, so the call was refused (the load in progress goes on and loads every plugin). Remove the call from the plugin's import and hooks; programs call load_plugins() themselves
    """

    def __init__(self, plugin: str, distribution: str, version: str, stage: str, call: str) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.stage = stage
        self.call = call
        during = "its import" if stage == "import" else stage
        super().__init__(
            f"{call} was called while plugin {plugin!r} from {distribution}=={version or '?'} was being loaded "
            f"(during {during}); plugins cannot be loaded from inside a plugin's load, so the call was refused "
            "(the load in progress goes on and loads every plugin). Remove the call from the plugin's import "
            "and hooks; programs call load_plugins() themselves"
        )
