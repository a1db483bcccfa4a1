"""Direct, typed access to ShardTensor's four class-level handler registries.

ShardTensor keeps four dictionaries on the class:

* ``_function_registry`` (``__torch_function__`` handlers keyed by callable),
* ``_named_function_registry`` (handlers keyed by a custom op's string name),
* ``_dispatch_registry`` (``__torch_dispatch__`` handlers keyed by OpOverload),
* ``_dispatch_registry_by_name`` (the same dispatch handlers keyed by ``str(op)``).

This module is the only place that writes into them. It mutates the existing
dict objects in place (never rebinding the attribute) because PhysicsNeMo's
own code reads them through the class on every call.

Example:
    >>> from physicsnemo_shardext import shard_registries
    >>> snap = shard_registries.snapshot()
    >>> shard_registries.restore(snap)
    >>> shard_registries.snapshot() == snap
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from physicsnemo.domain_parallel import ShardTensor

__all__ = [
    "PatchLevel",
    "RegistrySnapshot",
    "current_handler",
    "iter_handlers",
    "remove_handler",
    "capture_slot",
    "restore",
    "restore_slot",
    "set_handler",
    "snapshot",
]

REGISTRY_ATTRIBUTES: tuple[str, ...] = (
    "_function_registry",
    "_named_function_registry",
    "_dispatch_registry",
    "_dispatch_registry_by_name",
)


class PatchLevel(str, Enum):
    """Where a handler is consulted by ShardTensor.

    * ``FUNCTION``: ``__torch_function__``, keyed by the Python callable
      (``torch.roll``, ``torch.Tensor.roll``, ``F.conv2d`` ...); the handler is
      called as ``handler(func, types, args, kwargs)``.
    * ``NAMED``: ``__torch_function__``, keyed by ``str(func)`` of a custom op
      (``"mylib.op.default"``); same handler signature as ``FUNCTION``.
    * ``DISPATCH``: ``__torch_dispatch__``, keyed by an aten ``OpOverload``;
      the handler is called with the op's own arguments, ``handler(*args, **kwargs)``.
    """

    FUNCTION = "function"
    NAMED = "named"
    DISPATCH = "dispatch"


def _table(level: PatchLevel | str) -> dict[Any, Callable]:
    level = PatchLevel(level)
    if level is PatchLevel.FUNCTION:
        return ShardTensor._function_registry
    if level is PatchLevel.NAMED:
        return ShardTensor._named_function_registry
    return ShardTensor._dispatch_registry


@dataclass(frozen=True)
class RegistrySnapshot:
    """An immutable copy of all four registries, comparable with ``==``."""

    tables: tuple[tuple[str, tuple[tuple[Any, Callable], ...]], ...]

    def as_dicts(self) -> dict[str, dict[Any, Callable]]:
        """Return the snapshot as ``{attribute: {key: handler}}``."""
        return {name: dict(items) for name, items in self.tables}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegistrySnapshot):
            return NotImplemented
        # Compare as dicts: insertion order is irrelevant to ShardTensor.
        return self.as_dicts() == other.as_dicts()

    def __hash__(self) -> int:  # pragma: no cover - snapshots are not used as keys
        return hash(tuple(name for name, _ in self.tables))

    def difference(self, other: RegistrySnapshot) -> list[str]:
        """Human-readable list of keys whose handler differs between two snapshots."""
        mine, theirs = self.as_dicts(), other.as_dicts()
        lines = []
        for name in REGISTRY_ATTRIBUTES:
            a, b = mine.get(name, {}), theirs.get(name, {})
            for key in sorted(set(a) | set(b), key=str):
                if a.get(key) is not b.get(key):
                    lines.append(f"{name}[{key}]: {a.get(key)!r} != {b.get(key)!r}")
        return lines


def snapshot() -> RegistrySnapshot:
    """Copy the four registries."""
    return RegistrySnapshot(
        tables=tuple(
            (name, tuple(getattr(ShardTensor, name).items())) for name in REGISTRY_ATTRIBUTES
        )
    )


def restore(snap: RegistrySnapshot) -> None:
    """Make the four registries equal to ``snap`` again (in place)."""
    for name, items in snap.tables:
        table = getattr(ShardTensor, name)
        table.clear()
        table.update(items)


def current_handler(level: PatchLevel, target: Any) -> Callable | None:
    """Return the handler ShardTensor would call for ``target`` at ``level``, or ``None``."""
    return _table(level).get(target)


def set_handler(level: PatchLevel, target: Any, handler: Callable) -> None:
    """Install ``handler`` for ``target``; dispatch handlers are also indexed by name."""
    _table(level)[target] = handler
    if PatchLevel(level) is PatchLevel.DISPATCH:
        ShardTensor._dispatch_registry_by_name[str(target)] = handler


def remove_handler(level: PatchLevel, target: Any) -> None:
    """Remove any handler for ``target`` so ShardTensor falls back to DTensor."""
    _table(level).pop(target, None)
    if PatchLevel(level) is PatchLevel.DISPATCH:
        ShardTensor._dispatch_registry_by_name.pop(str(target), None)


SlotState = tuple[Callable | None, Callable | None]
"""What a registry slot holds: (main-table handler, by-name handler for dispatch, else None)."""


def capture_slot(level: PatchLevel, target: Any) -> SlotState:
    """Record exactly what the registries hold for ``target`` (both dispatch tables)."""
    by_name = ShardTensor._dispatch_registry_by_name.get(str(target)) if PatchLevel(level) is PatchLevel.DISPATCH else None
    return (_table(level).get(target), by_name)


def restore_slot(level: PatchLevel, target: Any, state: SlotState) -> None:
    """Put back what :func:`capture_slot` recorded, entry by entry."""
    main, by_name = state
    if main is None:
        _table(level).pop(target, None)
    else:
        _table(level)[target] = main
    if PatchLevel(level) is PatchLevel.DISPATCH:
        if by_name is None:
            ShardTensor._dispatch_registry_by_name.pop(str(target), None)
        else:
            ShardTensor._dispatch_registry_by_name[str(target)] = by_name


def iter_handlers() -> Iterator[tuple[PatchLevel, Any, Callable]]:
    """Yield ``(level, target, handler)`` for every handler ShardTensor would consult."""
    for level in PatchLevel:
        for target, handler in list(_table(level).items()):
            yield level, target, handler
