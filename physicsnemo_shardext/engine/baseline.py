"""Make PhysicsNeMo's built-in shard patches present on every machine.

PhysicsNeMo registers its own patches at import time only when CUDA is
available. We register them unconditionally, before any plugin, so that the
registry ShardTensor ends up with is the same on a laptop CPU and on a GPU
node, whatever the import order.

The registry state right after the built-ins are present is the *baseline*:
every undo returns to it, and "overrides a built-in" means "replaces a
baseline handler". On a CPU machine a few built-ins arrive later, when the
module holding their targets is imported (`physicsnemo_shardext.engine.lazy_builtins`):
they join the baseline then, are never taken for a plugin's own write, and
survive the restore of an older snapshot (`late_builtins`).

A function-level built-in also fills the torch aliases of its target that
PhysicsNeMo left empty (`physicsnemo_shardext.engine.aliases`): where PhysicsNeMo patches
an op under one name only, the op's other names reach the same built-in, not the
DTensor fallback, and `builtin_handler` returns it for them.

Examples:
    >>> from physicsnemo_shardext.engine.baseline import baseline, ensure_builtin_patches
    >>> ensure_builtin_patches()
    >>> len(baseline().as_dicts()["_function_registry"]) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.engine.aliases import implied_entries
from physicsnemo_shardext.engine.lazy_builtins import LateSlots
from physicsnemo_shardext.shard_registries import PatchLevel, RegistryChange, RegistrySnapshot

__all__ = [
    "baseline",
    "builtin_handler",
    "ensure_builtin_patches",
    "handler_origin",
    "is_late_builtin",
    "late_builtins",
]

_baseline: RegistrySnapshot | None = None
#: Built-ins registered after the baseline was first taken, by (table, key).
_late: dict[tuple[str, Any], Callable[..., Any]] = {}
_FUNCTION_TABLE = shard_registries.table_name(PatchLevel.FUNCTION)
_LEVEL_OF_TABLE = {
    shard_registries.table_name(level): level for level in (PatchLevel.FUNCTION, PatchLevel.NAMED, PatchLevel.DISPATCH)
}


def ensure_builtin_patches() -> None:
    """Register PhysicsNeMo's built-in patches (idempotent) and record the baseline."""
    global _baseline
    if _baseline is not None:
        return
    from physicsnemo_shardext.engine.lazy_builtins import register_builtins

    # Importing the patch modules registers them; Python's module cache makes a second
    # call (e.g. PhysicsNeMo's own, on GPU machines) a no-op. The modules that need
    # physicsnemo.nn are deferred until something can call them (see lazy_builtins).
    register_builtins(_add_to_baseline)
    _fill_aliases(dict(shard_registries.snapshot().as_dicts()[_FUNCTION_TABLE]))
    _baseline = shard_registries.snapshot()
    shard_registries.on_restore(_reapply_late_builtins)


def _fill_aliases(builtins: Mapping[Any, Callable[..., Any]]) -> list[tuple[str, Any]]:
    """Install each function-level built-in under the torch aliases of its target that hold nothing.

    Returns the ``(table, key)`` slots written.

    Examples:
        >>> import torch
        >>> from physicsnemo.domain_parallel import ShardTensor
        >>> snap = shard_registries.snapshot()
        >>> from physicsnemo_shardext.targets import describe_target
        >>> [(table, describe_target(key)) for table, key in _fill_aliases({torch.trapezoid: print})]
        [('_function_registry', 'torch.trapz')]
        >>> ShardTensor._function_registry[torch.trapz] is print
        True
        >>> shard_registries.restore(snap)
    """
    written = []
    for alias, (_, handler) in implied_entries(builtins).items():
        if shard_registries.current_handler(PatchLevel.FUNCTION, alias) is None:
            shard_registries.set_handler(PatchLevel.FUNCTION, alias, handler)
            written.append((_FUNCTION_TABLE, alias))
    return written


def _add_to_baseline(slots: LateSlots) -> None:
    """Built-ins registered late (after their targets' module was imported) join the baseline, with their aliases."""
    global _baseline
    if _baseline is None:
        return  # registered while the built-ins are set up: the baseline snapshot will hold them
    from physicsnemo.domain_parallel import ShardTensor

    functions = {key: ShardTensor._function_registry[key] for table, key in slots if table == _FUNCTION_TABLE}
    slots = [*slots, *_fill_aliases(functions)]
    tables = _baseline.as_dicts()
    for table, key in slots:
        handler = getattr(ShardTensor, table)[key]
        tables[table][key] = _late[(table, key)] = handler
    _baseline = RegistrySnapshot(
        tables=tuple((name, tuple(items.items())) for name, items in tables.items()), rebound=_baseline.rebound
    )


def late_builtins() -> dict[tuple[str, Any], Callable[..., Any]]:
    """``{(table, key): handler}`` of the built-ins registered after the baseline was first taken.

    A plugin being loaded when they arrive did not write them (the loader ignores
    them), and restoring a snapshot older than them keeps them (`shard_registries.restore`).

    Examples:
        >>> import physicsnemo.nn.functional.natten as natten
        >>> late_builtins().get(("_function_registry", natten.na2d)) is builtin_handler(natten.na2d)
        True
    """
    return dict(_late)


def is_late_builtin(change: RegistryChange) -> bool:
    """Whether ``change`` is the arrival of a late built-in (not anyone's own write).

    Examples:
        >>> import torch
        >>> is_late_builtin(RegistryChange("_function_registry", torch.roll, None, print))
        False
    """
    return change.before is None and change.after is not None and _late.get((change.table, change.key)) is change.after


def _reapply_late_builtins(restored: RegistrySnapshot) -> None:
    """A snapshot older than a late built-in lacks it: put it back (it is part of the baseline now).

    A snapshot cannot tell a built-in that did not exist yet from one removed on
    purpose; `PatchRegistry.disabled` removes its targets again when it exits.
    """
    tables = restored.as_dicts()
    for (table, key), handler in _late.items():
        level = _LEVEL_OF_TABLE.get(table)
        if level is not None and key not in tables.get(table, {}):
            shard_registries.set_handler(level, key, handler)


def baseline() -> RegistrySnapshot:
    """The registries as they were with the built-ins and before any plugin."""
    ensure_builtin_patches()
    assert _baseline is not None
    return _baseline


def builtin_handler(target: Any, level: PatchLevel | str = PatchLevel.FUNCTION) -> Callable | None:
    """Return the handler ShardTensor had for ``target`` before any plugin, or ``None``.

    An ``override`` patch uses this to delegate the cases the built-in handles well.

    Examples:
        >>> import torch.nn.functional as F
        >>> builtin_handler(F.interpolate).__name__
        'generic_interpolate_wrapper'
    """
    level = PatchLevel(level)
    if level is PatchLevel.ATTRIBUTE:
        # The value the owner held before any plugin replaced it (a staticmethod stays one).
        return shard_registries.original_attribute(target)
    return baseline().as_dicts()[shard_registries.table_name(level)].get(target)


def handler_origin(handler: Callable) -> str:
    """Name who provides a baseline handler: ``"physicsnemo"`` or its module.

    Examples:
        >>> from physicsnemo_shardext.engine.baseline import handler_origin
        >>> handler_origin(print)
        'builtins'
    """
    module = getattr(handler, "__module__", None) or "unknown"
    if module == "physicsnemo" or module.startswith("physicsnemo."):
        return "physicsnemo"
    return module
