"""Is a plugin well-formed: its hooks marked and spelled right, its registry changes declared, its selectors known.

The messages a plugin author reads when a plugin provides nothing as written,
changes ShardTensor's registries behind the plugin system's back, or is named
by a ``SHARDEXT_*`` selector that matches no installed plugin.

Examples:
    >>> class Plugin:
    ...     def shardext_declare_patch(self, patches): ...   # a typo, and no @hookimpl
    >>> "lacks the @hookimpl marker" in hook_problems(Plugin(), implemented=())[0]
    True
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from physicsnemo_shardext import hookspecs
from physicsnemo_shardext.engine.provenance import PluginInfo
from physicsnemo_shardext.errors import (
    UndeclaredPatchError,
)
from physicsnemo_shardext.markers import PROJECT_NAME
from physicsnemo_shardext.shard_registries import RegistryChange
from physicsnemo_shardext.targets import describe_handler, describe_target

__all__ = [
    "DECLARE_HOOK",
    "HOOK_NAMES",
    "describe_change",
    "hook_problems",
    "undeclared_patch_error",
    "unknown_selector_message",
    "unmarked_hooks",
]

#: The hooks a plugin can implement (``physicsnemo_shardext.hookspecs``).
HOOK_NAMES: tuple[str, ...] = tuple(hookspecs.__all__)
_HOOK_PREFIX = "shardext_"
DECLARE_HOOK = "shardext_declare_patches"


def describe_change(change: RegistryChange) -> str:
    """One line naming a registry entry a plugin changed, for messages.

    Examples:
        >>> import torch
        >>> describe_change(RegistryChange("_function_registry", torch.roll, None, print))
        '_function_registry[torch.roll]: added builtins.print'
    """
    if change.key is None:
        return f"ShardTensor.{change.table} rebound to another dict"
    where = f"{change.table}[{describe_target(change.key)}]"
    if change.before is None:
        return f"{where}: added {describe_handler(change.after)}"
    if change.after is None:
        return f"{where}: removed {describe_handler(change.before)}"
    return f"{where}: {describe_handler(change.before)} replaced by {describe_handler(change.after)}"


def _declaration_hint(change: RegistryChange) -> str | None:
    """The ``patches.*`` call that declares what ``change`` wrote (``None`` for removals and rebinding)."""
    if change.key is None or change.after is None:
        return None
    target, handler = describe_target(change.key), describe_handler(change.after)
    if change.table == "_function_registry":
        return f"patches.function({target}, {handler})"
    if change.table == "_named_function_registry":
        return f'patches.named("{target}", {handler})'
    if change.table in ("_dispatch_registry", "_dispatch_registry_by_name"):
        return f"patches.dispatch(torch.ops.{target}, {handler})"
    owner, _, name = target.rpartition(".")
    return f'patches.replace_attribute({owner}, "{name}", {handler}, reason=...)'


def undeclared_patch_error(changes: Sequence[RegistryChange]) -> UndeclaredPatchError:
    """The error reporting registry writes a plugin made itself, with the declarations to use instead."""
    hints = dict.fromkeys(h for h in map(_declaration_hint, changes) if h is not None)
    return UndeclaredPatchError([describe_change(c) for c in changes], list(hints))


def _attribute_names(plugin: Any) -> list[str]:
    """``dir(plugin)``, or nothing when the plugin's own ``__dir__`` raises."""
    try:
        return [name for name in dir(plugin) if isinstance(name, str)]
    except Exception:
        return []


def _is_hookimpl(value: Any) -> bool:
    """Whether ``value`` carries this project's ``hookimpl`` marker (read the way pluggy reads it)."""
    try:
        return isinstance(getattr(value, f"{PROJECT_NAME}_impl", None), dict)
    except Exception:
        return False


def unmarked_hooks(plugin: Any) -> list[tuple[str, str]]:
    """``(function name, hook)`` for each function of ``plugin`` named like a hook but without ``@hookimpl``.

    pluggy only calls marked functions, so such a function is never called: it is
    always a mistake. A name counts as a hook's when it is the hook's name, or starts
    with ``shardext_`` and is a close misspelling of one (``shardext_declare_patch``).

    Examples:
        >>> import types
        >>> plugin = types.ModuleType("forgetful")
        >>> def shardext_declare_patches(patches): ...
        >>> plugin.shardext_declare_patches = shardext_declare_patches
        >>> unmarked_hooks(plugin)
        [('shardext_declare_patches', 'shardext_declare_patches')]
    """
    found = []
    for name in _attribute_names(plugin):
        if not name.startswith(_HOOK_PREFIX):
            continue
        hook = (
            name
            if name in HOOK_NAMES
            else next(iter(difflib.get_close_matches(name, HOOK_NAMES, n=1, cutoff=0.8)), None)
        )
        if hook is None:
            continue
        try:
            value = getattr(plugin, name)
        except Exception:
            continue
        if inspect.isroutine(value) and not _is_hookimpl(value):
            found.append((name, hook))
    return found


def _plugin_object_name(plugin: Any) -> str:
    """``module NAME``, ``class NAME`` or ``TYPE object``, for messages."""
    if inspect.ismodule(plugin):
        return f"module {plugin.__name__}"
    if isinstance(plugin, type):
        return f"class {plugin.__name__}"
    return f"{type(plugin).__name__} object"


def hook_problems(plugin: Any, implemented: Collection[str]) -> list[str]:
    """Why ``plugin`` provides nothing as written, given the hooks pluggy registered for it (``[]``: fine).

    * a function named like a hook without ``@hookimpl`` (see `unmarked_hooks`);
    * no hook implemented at all (often an entry point naming the wrong module);
    * hooks, but no ``shardext_declare_patches``, so no patch can ever be declared.

    A ``shardext_declare_patches`` that runs and declares nothing on this setup (its
    declarations gated on versions or features) is not a problem: it is not reported here.

    Examples:
        >>> import types
        >>> hook_problems(types.ModuleType("shell"), implemented=[])
        ['implements no hook: nothing in module shell carries @hookimpl, so it provides nothing (does its entry point name the module that defines the hooks?)']
        >>> hook_problems(types.ModuleType("fine"), implemented=["shardext_declare_patches"])
        []
    """
    problems = []
    unmarked = unmarked_hooks(plugin)
    for name, hook in unmarked:
        meant = "" if name == hook else f" (a misspelling of {hook}?)"
        problems.append(
            f"{name}() is named like the {hook} hook{meant} but lacks the @hookimpl marker, so pluggy never calls "
            "it and it provides nothing; decorate it with @hookimpl (from physicsnemo_shardext import hookimpl)"
            + ("" if name == hook else f" and name it {hook}")
        )
    meant_hooks = {hook for _, hook in unmarked}
    if not implemented and not unmarked:
        problems.append(
            f"implements no hook: nothing in {_plugin_object_name(plugin)} carries @hookimpl, so it provides "
            "nothing (does its entry point name the module that defines the hooks?)"
        )
    elif implemented and DECLARE_HOOK not in implemented and DECLARE_HOOK not in meant_hooks:
        problems.append(f"implements no {DECLARE_HOOK} hook, so it can never declare a patch")
    return problems


def unknown_selector_message(variable: str, selector: str, known: Iterable[PluginInfo]) -> str:
    """The warning for a name in ``variable`` that matches none of the ``known`` plugins.

    Examples:
        >>> print(unknown_selector_message("SHARDEXT_DISABLE", "pointwize", [PluginInfo("pointwise", "physicsnemo-shardext")]))
        SHARDEXT_DISABLE names 'pointwize', which matches no installed plugin or distribution; did you mean 'pointwise'?
        >>> print(unknown_selector_message("SHARDEXT_ONLY", "zzz", [PluginInfo("fft", "physicsnemo-shardext")]))
        SHARDEXT_ONLY names 'zzz', which matches no installed plugin or distribution (no close match; installed plugins: fft)
    """
    known = list(known)
    names = sorted({info.name for info in known} | {info.distribution for info in known if info.distribution})
    by_key = {name.lower().replace("_", "-"): name for name in names}
    key = selector.strip().lower().replace("_", "-")
    close = [by_key[match] for match in difflib.get_close_matches(key, list(by_key), n=3, cutoff=0.6)]
    head = f"{variable} names {selector!r}, which matches no installed plugin or distribution"
    if close:
        return f"{head}; did you mean {' or '.join(repr(name) for name in close)}?"
    plugins = ", ".join(sorted({info.name for info in known})) or "none"
    return f"{head} (no close match; installed plugins: {plugins})"
