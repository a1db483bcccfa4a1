"""Direct, typed access to ShardTensor's four class-level handler registries (and replaced attributes).

ShardTensor keeps four dictionaries on the class:

* ``_function_registry`` (``__torch_function__`` handlers keyed by callable),
* ``_named_function_registry`` (handlers keyed by a custom op's string name),
* ``_dispatch_registry`` (``__torch_dispatch__`` handlers keyed by OpOverload),
* ``_dispatch_registry_by_name`` (the same dispatch handlers keyed by ``str(op)``).

This module is the only place that writes into them. It mutates the existing
dict objects in place (never rebinding the attribute) because PhysicsNeMo's
own code reads them through the class on every call.

It also owns the fifth kind of slot, ``PatchLevel.ATTRIBUTE``: an attribute of
a PhysicsNeMo class or module (``AttributeTarget(owner, name)``) that a plugin
replaces, e.g. an autograd Function's ``backward``. The value the owner held
when the framework first touched it is remembered (`original_attribute`),
snapshots record only attributes that differ from it, and removing such a slot
puts that original back.

Examples:
    >>> from physicsnemo_shardext import shard_registries
    >>> snap = shard_registries.snapshot()
    >>> shard_registries.restore(snap)
    >>> shard_registries.snapshot() == snap
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

from physicsnemo.domain_parallel import ShardTensor

__all__ = [
    "AttributeTarget",
    "PatchLevel",
    "RegistryChange",
    "RegistrySnapshot",
    "SlotKey",
    "SlotState",
    "current_handler",
    "iter_handlers",
    "on_restore",
    "original_attribute",
    "remove_handler",
    "capture_slot",
    "restore",
    "restore_slot",
    "set_handler",
    "snapshot",
    "table_name",
]

REGISTRY_ATTRIBUTES: tuple[str, ...] = (
    "_function_registry",
    "_named_function_registry",
    "_dispatch_registry",
    "_dispatch_registry_by_name",
)

# The dict objects ShardTensor held when this module was imported: PhysicsNeMo reads the
# registries through the class, so a rebound attribute is put back to its original dict.
_ORIGINAL_TABLES: dict[str, dict[Any, Callable[..., Any]]] = {
    name: getattr(ShardTensor, name) for name in REGISTRY_ATTRIBUTES
}


class PatchLevel(str, Enum):
    """Where a handler is consulted by ShardTensor.

    * ``FUNCTION``: ``__torch_function__``, keyed by the Python callable
      (``torch.roll``, ``torch.Tensor.roll``, ``F.conv2d`` ...); the handler is
      called as ``handler(func, types, args, kwargs)``.
    * ``NAMED``: ``__torch_function__``, keyed by ``str(func)`` of a custom op
      (``"mylib.op.default"``); same handler signature as ``FUNCTION``.
    * ``DISPATCH``: ``__torch_dispatch__``, keyed by an aten ``OpOverload``;
      the handler is called with the op's own arguments, ``handler(*args, **kwargs)``.
    * ``ATTRIBUTE``: not a handler table but an attribute of a class or module
      (`AttributeTarget`), replaced by a value (for instance a fixed
      ``staticmethod``); used to correct PhysicsNeMo internals.
    """

    FUNCTION = "function"
    NAMED = "named"
    DISPATCH = "dispatch"
    ATTRIBUTE = "attribute"


@dataclass(frozen=True)
class AttributeTarget:
    """The slot ``owner.name`` (owner: a class or module), hashable, compared by identity of ``owner``.

    Examples:
        >>> import physicsnemo.domain_parallel.shard_tensor as st
        >>> str(AttributeTarget(st._ShardTensorToDTensor, "backward"))
        'physicsnemo.domain_parallel.shard_tensor._ShardTensorToDTensor.backward'
    """

    owner: Any = field(compare=False)
    name: str
    _owner_id: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_owner_id", id(self.owner))

    def __str__(self) -> str:
        owner = self.owner
        if isinstance(owner, type):
            return f"{owner.__module__}.{owner.__qualname__}.{self.name}"
        return f"{getattr(owner, '__name__', repr(owner))}.{self.name}"

    def own_value(self) -> Any:
        """What ``owner.__dict__`` holds for ``name`` (raw: a staticmethod stays one), else ``None``."""
        return vars(self.owner).get(self.name)


# Value each attribute slot held when the framework first touched it (None: not in owner.__dict__).
_ORIGINAL_ATTRIBUTES: dict[AttributeTarget, Any] = {}


def _remember_original(target: AttributeTarget) -> None:
    if target not in _ORIGINAL_ATTRIBUTES:
        _ORIGINAL_ATTRIBUTES[target] = target.own_value()


def original_attribute(target: AttributeTarget) -> Any:
    """The raw value ``target`` held before the framework first replaced it (current value if never touched)."""
    return _ORIGINAL_ATTRIBUTES[target] if target in _ORIGINAL_ATTRIBUTES else target.own_value()


def _write_attribute(target: AttributeTarget, value: Any) -> None:
    _remember_original(target)
    if value is None:
        if target.name in vars(target.owner):
            delattr(target.owner, target.name)
    else:
        setattr(target.owner, target.name, value)


def _replaced_attributes() -> tuple[tuple[AttributeTarget, Any], ...]:
    """Attribute slots whose current value differs from their original."""
    return tuple(
        (target, target.own_value())
        for target, original in _ORIGINAL_ATTRIBUTES.items()
        if target.own_value() is not original
    )


SlotKey = tuple[PatchLevel, Any]
"""One registry slot: ``(level, target)``; the key under which claims are resolved and patches installed."""

_TABLE_NAMES: dict[PatchLevel, str] = {
    PatchLevel.FUNCTION: "_function_registry",
    PatchLevel.NAMED: "_named_function_registry",
    PatchLevel.DISPATCH: "_dispatch_registry",
}


def table_name(level: PatchLevel | str) -> str:
    """The ShardTensor attribute holding ``level``'s handlers (for dispatch, the table keyed by ``OpOverload``).

    Examples:
        >>> table_name("dispatch")
        '_dispatch_registry'
    """
    level = PatchLevel(level)
    if level is PatchLevel.ATTRIBUTE:
        raise ValueError("attribute slots are not a handler table")
    return _TABLE_NAMES[level]


def _table(level: PatchLevel | str) -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = getattr(ShardTensor, table_name(level))
    return table


@dataclass(frozen=True)
class RegistryChange:
    """One entry that differs between two snapshots.

    Attributes:
        table: one of `REGISTRY_ATTRIBUTES`, or ``"attributes"`` for a replaced attribute slot.
        key: the entry's key (a callable, op name, ``OpOverload`` or `AttributeTarget`);
            ``None`` when the whole table attribute was rebound to another dict.
        before: the value in the earlier snapshot (``None``: absent).
        after: the value in the later snapshot (``None``: absent).
    """

    table: str
    key: Any
    before: Any
    after: Any


@dataclass(frozen=True)
class RegistrySnapshot:
    """An immutable copy of all four registries (plus replaced attributes, as ``"attributes"``), comparable with ``==``.

    ``rebound`` names the registry attributes that no longer hold ShardTensor's original dict.
    """

    tables: tuple[tuple[str, tuple[tuple[Any, Callable[..., Any]], ...]], ...]
    rebound: tuple[str, ...] = ()

    def as_dicts(self) -> dict[str, dict[Any, Callable[..., Any]]]:
        """Return the snapshot as ``{attribute: {key: handler}}``."""
        return {name: dict(items) for name, items in self.tables}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegistrySnapshot):
            return NotImplemented
        # Compare as dicts: insertion order is irrelevant to ShardTensor.
        return self.as_dicts() == other.as_dicts() and set(self.rebound) == set(other.rebound)

    def __hash__(self) -> int:  # pragma: no cover - snapshots are not used as keys
        return hash(tuple(name for name, _ in self.tables))

    def changes(self, later: RegistrySnapshot) -> list[RegistryChange]:
        """Every entry whose value (compared by identity) differs in ``later``, table by table.

        Examples:
            >>> before = snapshot()
            >>> ShardTensor._named_function_registry["demo.op.default"] = print
            >>> [(c.table, c.key, c.after) for c in before.changes(snapshot())]
            [('_named_function_registry', 'demo.op.default', <built-in function print>)]
            >>> restore(before)
        """
        mine, theirs = self.as_dicts(), later.as_dicts()
        found = [
            RegistryChange(name, None, _ORIGINAL_TABLES.get(name), None)
            for name in REGISTRY_ATTRIBUTES
            if name in later.rebound and name not in self.rebound
        ]
        for name in (*REGISTRY_ATTRIBUTES, "attributes"):
            a, b = mine.get(name, {}), theirs.get(name, {})
            # Identity, not ==: a handler object with a lenient __eq__ must not hide a swap.
            found.extend(
                RegistryChange(name, key, a.get(key), b.get(key))
                for key in sorted(set(a) | set(b), key=str)
                if a.get(key) is not b.get(key)
            )
        return found

    def difference(self, other: RegistrySnapshot) -> list[str]:
        """Human-readable list of keys whose handler differs between two snapshots."""
        return [f"{c.table}[{c.key}]: {c.before!r} != {c.after!r}" for c in self.changes(other)]


def _rebound_tables() -> tuple[str, ...]:
    return tuple(name for name in REGISTRY_ATTRIBUTES if getattr(ShardTensor, name, None) is not _ORIGINAL_TABLES[name])


def _items(name: str) -> tuple[tuple[Any, Callable[..., Any]], ...]:
    """The entries of one registry; a deleted or non-dict attribute reads as empty (and as rebound)."""
    table = getattr(ShardTensor, name, None)
    return tuple(table.items()) if isinstance(table, dict) else ()


def snapshot() -> RegistrySnapshot:
    """Copy the four registries and the attributes currently replaced."""
    return RegistrySnapshot(
        tables=tuple((name, _items(name)) for name in REGISTRY_ATTRIBUTES) + (("attributes", _replaced_attributes()),),
        rebound=_rebound_tables(),
    )


_restore_hooks: list[Callable[[RegistrySnapshot], None]] = []


def on_restore(hook: Callable[[RegistrySnapshot], None]) -> None:
    """Call ``hook(snap)`` after every `restore` (once per hook, however often it is added).

    The baseline uses it to keep built-ins that arrived after ``snap`` was taken.
    """
    if hook not in _restore_hooks:
        _restore_hooks.append(hook)


def restore(snap: RegistrySnapshot) -> None:
    """Make the four registries and every touched attribute equal to ``snap`` again (in place).

    A registry attribute rebound to another dict since gets ShardTensor's original dict back
    (unless it was already rebound when ``snap`` was taken). Then the `on_restore` hooks run.
    """
    for name, items in snap.tables:
        if name == "attributes":
            continue
        if name not in snap.rebound or not isinstance(getattr(ShardTensor, name, None), dict):
            setattr(ShardTensor, name, _ORIGINAL_TABLES[name])
        table = getattr(ShardTensor, name)
        table.clear()
        table.update(items)
    # Attributes absent from the snapshot held their original value then.
    replaced = dict(snap.as_dicts().get("attributes", {}))
    for target, original in list(_ORIGINAL_ATTRIBUTES.items()):
        _write_attribute(target, replaced.get(target, original))
    for hook in list(_restore_hooks):
        hook(snap)


def current_handler(level: PatchLevel, target: Any) -> Callable[..., Any] | None:
    """Return the handler ShardTensor would call for ``target`` at ``level``, or ``None``."""
    if PatchLevel(level) is PatchLevel.ATTRIBUTE:
        return cast("Callable[..., Any] | None", target.own_value())
    return _table(level).get(target)


def set_handler(level: PatchLevel, target: Any, handler: Callable[..., Any]) -> None:
    """Install ``handler`` for ``target``; dispatch handlers are also indexed by name."""
    if PatchLevel(level) is PatchLevel.ATTRIBUTE:
        _write_attribute(target, handler)
        return
    _table(level)[target] = handler
    if PatchLevel(level) is PatchLevel.DISPATCH:
        ShardTensor._dispatch_registry_by_name[str(target)] = handler


def remove_handler(level: PatchLevel, target: Any) -> None:
    """Remove any handler for ``target`` so ShardTensor falls back to DTensor.

    For an attribute slot this puts back the original value (an attribute cannot "fall back").
    """
    if PatchLevel(level) is PatchLevel.ATTRIBUTE:
        _write_attribute(target, original_attribute(target))
        return
    _table(level).pop(target, None)
    if PatchLevel(level) is PatchLevel.DISPATCH:
        ShardTensor._dispatch_registry_by_name.pop(str(target), None)


SlotState = tuple[Callable[..., Any] | None, Callable[..., Any] | None]
"""What a registry slot holds: (main-table handler, by-name handler for dispatch, else None)."""


def capture_slot(level: PatchLevel, target: Any) -> SlotState:
    """Record exactly what the registries hold for ``target`` (both dispatch tables)."""
    if PatchLevel(level) is PatchLevel.ATTRIBUTE:
        _remember_original(target)
        return (target.own_value(), None)
    by_name = (
        ShardTensor._dispatch_registry_by_name.get(str(target)) if PatchLevel(level) is PatchLevel.DISPATCH else None
    )
    return (_table(level).get(target), by_name)


def restore_slot(level: PatchLevel, target: Any, state: SlotState) -> None:
    """Put back what `capture_slot` recorded, entry by entry."""
    main, by_name = state
    if PatchLevel(level) is PatchLevel.ATTRIBUTE:
        _write_attribute(target, main)
        return
    if main is None:
        _table(level).pop(target, None)
    else:
        _table(level)[target] = main
    if PatchLevel(level) is PatchLevel.DISPATCH:
        if by_name is None:
            ShardTensor._dispatch_registry_by_name.pop(str(target), None)
        else:
            ShardTensor._dispatch_registry_by_name[str(target)] = by_name


def iter_handlers() -> Iterator[tuple[PatchLevel, Any, Callable[..., Any]]]:
    """Yield ``(level, target, handler)`` for every handler ShardTensor would consult.

    Attribute slots are yielded while they hold a replacement.
    """
    for level in (PatchLevel.FUNCTION, PatchLevel.NAMED, PatchLevel.DISPATCH):
        for target, handler in list(_table(level).items()):
            yield level, target, handler
    for target, value in _replaced_attributes():
        yield PatchLevel.ATTRIBUTE, target, value
