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
when the framework first touched it is remembered (:func:`original_attribute`),
snapshots record only attributes that differ from it, and removing such a slot
puts that original back.

Example:
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
from typing import Any

from physicsnemo.domain_parallel import ShardTensor

__all__ = [
    "AttributeTarget",
    "PatchLevel",
    "RegistrySnapshot",
    "current_handler",
    "iter_handlers",
    "original_attribute",
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
    * ``ATTRIBUTE``: not a handler table but an attribute of a class or module
      (:class:`AttributeTarget`), replaced by a value (for instance a fixed
      ``staticmethod``); used to correct PhysicsNeMo internals.
    """

    FUNCTION = "function"
    NAMED = "named"
    DISPATCH = "dispatch"
    ATTRIBUTE = "attribute"


@dataclass(frozen=True)
class AttributeTarget:
    """The slot ``owner.name`` (owner: a class or module), hashable, compared by identity of ``owner``.

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


def _table(level: PatchLevel | str) -> dict[Any, Callable]:
    level = PatchLevel(level)
    if level is PatchLevel.ATTRIBUTE:
        raise ValueError("attribute slots are not a handler table")
    if level is PatchLevel.FUNCTION:
        return ShardTensor._function_registry
    if level is PatchLevel.NAMED:
        return ShardTensor._named_function_registry
    return ShardTensor._dispatch_registry


@dataclass(frozen=True)
class RegistrySnapshot:
    """An immutable copy of all four registries (plus replaced attributes, as ``"attributes"``), comparable with ``==``."""

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
        for name in (*REGISTRY_ATTRIBUTES, "attributes"):
            a, b = mine.get(name, {}), theirs.get(name, {})
            for key in sorted(set(a) | set(b), key=str):
                if a.get(key) is not b.get(key):
                    lines.append(f"{name}[{key}]: {a.get(key)!r} != {b.get(key)!r}")
        return lines


def snapshot() -> RegistrySnapshot:
    """Copy the four registries and the attributes currently replaced."""
    return RegistrySnapshot(
        tables=tuple(
            (name, tuple(getattr(ShardTensor, name).items())) for name in REGISTRY_ATTRIBUTES
        )
        + (("attributes", _replaced_attributes()),)
    )


def restore(snap: RegistrySnapshot) -> None:
    """Make the four registries and every touched attribute equal to ``snap`` again (in place)."""
    for name, items in snap.tables:
        if name == "attributes":
            continue
        table = getattr(ShardTensor, name)
        table.clear()
        table.update(items)
    # Attributes absent from the snapshot held their original value then.
    replaced = dict(snap.as_dicts().get("attributes", {}))
    for target, original in list(_ORIGINAL_ATTRIBUTES.items()):
        _write_attribute(target, replaced.get(target, original))


def current_handler(level: PatchLevel, target: Any) -> Callable | None:
    """Return the handler ShardTensor would call for ``target`` at ``level``, or ``None``."""
    if PatchLevel(level) is PatchLevel.ATTRIBUTE:
        return target.own_value()
    return _table(level).get(target)


def set_handler(level: PatchLevel, target: Any, handler: Callable) -> None:
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


SlotState = tuple[Callable | None, Callable | None]
"""What a registry slot holds: (main-table handler, by-name handler for dispatch, else None)."""


def capture_slot(level: PatchLevel, target: Any) -> SlotState:
    """Record exactly what the registries hold for ``target`` (both dispatch tables)."""
    if PatchLevel(level) is PatchLevel.ATTRIBUTE:
        _remember_original(target)
        return (target.own_value(), None)
    by_name = ShardTensor._dispatch_registry_by_name.get(str(target)) if PatchLevel(level) is PatchLevel.DISPATCH else None
    return (_table(level).get(target), by_name)


def restore_slot(level: PatchLevel, target: Any, state: SlotState) -> None:
    """Put back what :func:`capture_slot` recorded, entry by entry."""
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


def iter_handlers() -> Iterator[tuple[PatchLevel, Any, Callable]]:
    """Yield ``(level, target, handler)`` for every handler ShardTensor would consult.

    Attribute slots are yielded while they hold a replacement.
    """
    for level in (PatchLevel.FUNCTION, PatchLevel.NAMED, PatchLevel.DISPATCH):
        for target, handler in list(_table(level).items()):
            yield level, target, handler
    for target, value in _replaced_attributes():
        yield PatchLevel.ATTRIBUTE, target, value
