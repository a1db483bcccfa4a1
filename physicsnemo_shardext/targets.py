"""Naming and validating patch targets and handlers.

A *target* is what ShardTensor looks a handler up by: a Python callable
(function level), a custom op's string name (named level) or an aten
``OpOverload`` (dispatch level). This module turns user input into that key,
checks that it exists and that the handler can be called the way its level
calls it, and gives every target a readable name for messages and listings.

**Custom ops.** ``__torch_function__`` sees a custom op (one defined with
``torch.library``, in any namespace but torch's own ``aten`` and ``prims``) as
the object the user called: the ``OpOverloadPacket`` for
``torch.ops.mylib.op(x)``, the ``OpOverload`` for ``torch.ops.mylib.op.default(x)``
and for the ``CustomOpDef`` that ``torch.library.custom_op`` returns. ShardTensor
looks both up by ``str(func)`` in its named table, so a custom op is always a
named-level target, whichever form names it: the packet, the overload, the
``CustomOpDef``, or a string (``"mylib::op"``, ``"mylib.op"``,
``"mylib.op.default"``). `resolve_slot` turns every form into one key, and
`lookup_keys` gives the names a handler is installed under: the overload's
and, when it is the op's only overload (always so for ``custom_op``), the
packet's, so every call form reaches the handler.

Examples:
    >>> import torch
    >>> from physicsnemo_shardext.targets import describe_target
    >>> describe_target(torch.roll), describe_target(torch.ops.aten.roll.default)
    ('torch.roll', 'aten.roll.default')
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from physicsnemo_shardext.shard_registries import AttributeTarget, PatchLevel

__all__ = [
    "describe_handler",
    "describe_target",
    "infer_level",
    "lookup_keys",
    "resolve_slot",
    "resolve_target",
    "validate_handler",
]

# Namespaces searched (in order) to give a callable its public dotted name.
_PUBLIC_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch.nn.functional", torch.nn.functional),
    ("torch", torch),
    ("torch.Tensor", torch.Tensor),
    ("torch.fft", torch.fft),
    ("torch.linalg", torch.linalg),
    ("torch.special", torch.special),
)

#: torch's own operator namespaces: their overloads are dispatch-level targets (aten ops
#: reach ``__torch_dispatch__`` in backward and under compile); every other namespace holds custom ops.
_TORCH_OP_NAMESPACES: frozenset[str] = frozenset({"aten", "prims"})

_Op = torch._ops.OpOverload | torch._ops.OpOverloadPacket


def _custom_op_def_type() -> Any:
    """``torch.library.custom_op``'s ``CustomOpDef`` class (private in torch), if this torch has it."""
    try:
        from torch._library.custom_ops import CustomOpDef
    except ImportError:  # pragma: no cover - torch < 2.4
        return None
    return CustomOpDef


_CUSTOM_OP_DEF: Any = _custom_op_def_type()


def _custom_op_def_overload(target: Any) -> torch._ops.OpOverload | None:
    """The overload behind a ``CustomOpDef`` (what ``torch.library.custom_op`` returns), else ``None``."""
    if _CUSTOM_OP_DEF is not None and isinstance(target, _CUSTOM_OP_DEF):
        overload: torch._ops.OpOverload = target._opoverload
        return overload
    return None


def _overload_names(packet: Any) -> list[str]:
    """Overload names of an op packet (``"default"`` for the unnamed one)."""
    return list(packet.overloads())


def describe_target(target: Any) -> str:
    """Return a stable, readable name for a target (used in messages, listings, config).

    Examples:
        >>> import torch.nn.functional as F
        >>> describe_target(F.max_pool2d), describe_target("mylib.op.default"), describe_target(torch.ops.aten.roll)
        ('torch.nn.functional.max_pool2d', 'mylib.op.default', 'aten.roll')
        >>> describe_target(torch.special.expit), describe_target(torch.fft.rfft2)
        ('torch.special.expit', 'torch.fft.rfft2')
    """
    if isinstance(target, (str, AttributeTarget)):
        return str(target)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    overload = _custom_op_def_overload(target)
    if overload is not None:
        return str(overload)
    name = getattr(target, "__name__", None)
    if isinstance(name, str) and name:
        for namespace_name, namespace in _PUBLIC_NAMESPACES:
            # torch.special.expit's own name is "special_expit" (likewise linalg_, fft_).
            short = name.removeprefix(namespace_name.rpartition(".")[2] + "_")
            for candidate in dict.fromkeys((name, short)):
                if getattr(namespace, candidate, None) is target:
                    return f"{namespace_name}.{candidate}"
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or repr(target)
    return f"{module}.{qualname}" if module else qualname


def describe_handler(handler: Callable[..., Any]) -> str:
    """Return ``module.qualname`` of a handler.

    Examples:
        >>> describe_handler(describe_handler)
        'physicsnemo_shardext.targets.describe_handler'
    """
    module = getattr(handler, "__module__", None) or "?"
    qualname = getattr(handler, "__qualname__", None) or getattr(handler, "__name__", repr(handler))
    return f"{module}.{qualname}"


def _import_dotted(path: str) -> Any:
    """Import ``a.b.c`` as attribute ``c`` of the longest importable module prefix."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            break
        return obj
    raise LookupError(f"no importable object named {path!r}")


def _op_by_name(name: str) -> _Op | None:
    """The op ``name`` denotes: ``"ns::op"``/``"ns.op"`` (the packet) or ``"ns::op.overload"``/``"ns.op.overload"``.

    A ``torch.ops.`` prefix is allowed (``"torch.ops.mylib.op"``).
    """
    name = name.removeprefix("torch.ops.")
    parts = name.replace("::", ".", 1).split(".") if name.count("::") <= 1 else []
    if len(parts) not in (2, 3) or not all(part.isidentifier() for part in parts):
        return None
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            return None
        if len(parts) == 2:
            return packet
        if parts[2] not in _overload_names(packet):
            return None
        overload = getattr(packet, parts[2])
    except (AttributeError, RuntimeError):
        return None
    return overload if isinstance(overload, torch._ops.OpOverload) else None


def _as_op(target: Any) -> _Op | None:
    """The ``OpOverload``/``OpOverloadPacket`` behind any form that names an op (``None`` otherwise)."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target
    if isinstance(target, str):
        return _op_by_name(target)
    return _custom_op_def_overload(target)


def _is_custom(op: _Op) -> bool:
    """Whether ``op`` lives outside torch's own namespaces (so ``__torch_function__`` is where it is seen)."""
    return str(op).split(".", 1)[0] not in _TORCH_OP_NAMESPACES


def _custom_op_form(target: Any) -> _Op | None:
    """The custom op named by an op object (packet, overload, ``CustomOpDef``) or a ``"ns::op"`` string.

    Other strings give ``None``: at the function level a dotted string is an
    import path first (see `resolve_slot`).
    """
    if isinstance(target, str) and "::" not in target:
        return None
    op = _as_op(target)
    return op if op is not None and _is_custom(op) else None


def _named_key(op: _Op) -> str:
    """The named-table key of an op: its overload's name; a packet's sole overload stands for the packet."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        overloads = _overload_names(op)
        return f"{op}.{overloads[0]}" if len(overloads) == 1 else str(op)
    return str(op)


def infer_level(target: Any) -> PatchLevel:
    """Guess the level a target belongs to.

    An aten ``OpOverload`` is dispatch level; a string and any form of a custom
    op (packet, overload, ``CustomOpDef``) are named level; an `AttributeTarget`
    is attribute level; anything else is function level.

    Examples:
        >>> infer_level(torch.roll).value, infer_level(torch.ops.aten.roll.default).value
        ('function', 'dispatch')
    """
    if isinstance(target, AttributeTarget):
        return PatchLevel.ATTRIBUTE
    if isinstance(target, str) or _custom_op_form(target) is not None:
        return PatchLevel.NAMED
    if isinstance(target, torch._ops.OpOverload):
        return PatchLevel.DISPATCH
    return PatchLevel.FUNCTION


def resolve_slot(target: Any, level: PatchLevel | str | None = None) -> tuple[PatchLevel, Any]:
    """Return the slot ``(level, registry key)`` a declaration of ``target`` claims, or raise ``ValueError``.

    ``level`` defaults to `infer_level`. A custom op given at the function level
    moves to the named level, the table ``__torch_function__`` finds it in
    under every call form; any of its forms gives the same key.

    Examples:
        >>> resolve_slot("torch.roll", "function")[1] is torch.roll
        True
        >>> resolve_slot("aten::roll.default", "named")
        (<PatchLevel.NAMED: 'named'>, 'aten.roll.default')
    """
    level = infer_level(target) if level is None else PatchLevel(level)
    if level is PatchLevel.FUNCTION:
        if isinstance(target, str):
            try:
                target = _import_dotted(target)
            except LookupError as error:
                # Not importable: the name of a custom op ("mylib.op.default") is one as well.
                op = _as_op(target)
                if op is None or not _is_custom(op):
                    raise ValueError(str(error)) from None
                target = op
        if _custom_op_form(target) is not None:
            level = PatchLevel.NAMED
    return level, resolve_target(target, level)


def resolve_target(target: Any, level: PatchLevel) -> Any:
    """Return the registry key for ``target`` at ``level`` or raise ``ValueError`` saying why.

    Function-level targets may be given as dotted strings (``"torch.roll"``);
    attribute-level targets are `AttributeTarget` whose owner has the attribute.
    Named-level targets are any form of an op: its name (``"mylib.op.default"``,
    ``"mylib::op"``), ``torch.ops.mylib.op``, its overload, or a ``CustomOpDef``.
    A custom op is never a function-level key: use `resolve_slot`, which moves
    it to the named level.
    """
    if level is PatchLevel.ATTRIBUTE:
        if not isinstance(target, AttributeTarget):
            raise ValueError(
                f"attribute-level targets must be AttributeTarget(owner, name), got {type(target).__name__}"
            )
        if not isinstance(target.owner, (type, types.ModuleType)):
            raise ValueError(
                f"the owner of {target.name!r} must be a class or a module, got {type(target.owner).__name__}"
            )
        if not hasattr(target.owner, target.name):
            raise ValueError(f"{target} does not exist (no attribute {target.name!r} on its owner)")
        return target
    if level is PatchLevel.DISPATCH:
        overload = _custom_op_def_overload(target)
        if overload is not None:
            target = overload
        if isinstance(target, torch._ops.OpOverloadPacket):
            overloads = _overload_names(target) or ["default"]
            raise ValueError(
                f"{target} is an overload packet; declare a specific overload such as {target}.{overloads[0]}"
            )
        if not isinstance(target, torch._ops.OpOverload):
            raise ValueError(
                f"dispatch-level targets must be torch OpOverloads (e.g. torch.ops.aten.roll.default), "
                f"got {type(target).__name__}"
            )
        return target
    if level is PatchLevel.NAMED:
        op = _as_op(target)
        if op is not None:
            return _named_key(op)
        if isinstance(target, str):
            raise ValueError(f"no op named {target!r} is registered with torch.ops")
        raise ValueError(
            "named-level targets must be op names like 'mylib.op.default' or 'mylib::op', or the op itself "
            f"(torch.ops.mylib.op, torch.ops.mylib.op.default, what torch.library.custom_op returns), "
            f"got {type(target).__name__}"
        )
    if isinstance(target, str):
        try:
            target = _import_dotted(target)
        except LookupError as error:
            raise ValueError(str(error)) from None
    if _custom_op_form(target) is not None:
        raise ValueError(
            f"{describe_target(target)} is a custom op: ShardTensor looks it up by name, so it is a "
            f"named-level target ({resolve_slot(target)[1]!r})"
        )
    if not callable(target):
        raise ValueError(f"function-level targets must be callables, got {type(target).__name__}")
    return target


def lookup_keys(key: Any, level: PatchLevel | str) -> tuple[Any, ...]:
    """Every key ShardTensor looks the op of a resolved slot up by, ``key`` first.

    A named key of an op's only overload also stands for the op's packet
    (``torch.ops.mylib.op(x)`` is looked up as ``"mylib.op"``); a packet key of
    an op with several overloads also covers each overload. Other keys stand
    for themselves.

    Examples:
        >>> lookup_keys("aten.roll", "named")
        ('aten.roll', 'aten.roll.default', 'aten.roll.out')
        >>> lookup_keys("aten.roll.default", "named"), lookup_keys(torch.roll, "function") == (torch.roll,)
        (('aten.roll.default',), True)
    """
    if PatchLevel(level) is not PatchLevel.NAMED or not isinstance(key, str):
        return (key,)
    op = _op_by_name(key)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return (key, *(f"{key}.{overload}" for overload in _overload_names(op)))
    if isinstance(op, torch._ops.OpOverload) and len(_overload_names(op.overloadpacket)) == 1:
        return (key, str(op.overloadpacket))
    return (key,)


def _dispatch_call_shape(op: torch._ops.OpOverload) -> tuple[int, list[str]]:
    """Number of positional arguments and names of keyword-only arguments of an op."""
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    keyword_only = [a.name for a in op._schema.arguments if a.kwarg_only]
    return len(positional), keyword_only


def validate_handler(handler: Any, level: PatchLevel, target: Any) -> None:
    """Raise ``ValueError`` unless ``handler`` can be called the way ``level`` calls it.

    Examples:
        >>> validate_handler(lambda func, types, args, kwargs: None, PatchLevel.FUNCTION, torch.roll)
        >>> validate_handler(lambda x: None, PatchLevel.FUNCTION, torch.roll)
        Traceback (most recent call last):
        ...
        ValueError: function-level handlers are called as handler(func, types, args, kwargs); this one cannot take those arguments: too many positional arguments
    """
    if level is PatchLevel.ATTRIBUTE:
        if handler is None:
            raise ValueError("an attribute cannot be replaced by None")
        return  # any value may replace an attribute; the plugin states why (``reason``)
    if not callable(handler):
        raise ValueError(f"handler must be callable, got {type(handler).__name__}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return  # builtins without introspectable signatures cannot be checked
    try:
        if level is PatchLevel.DISPATCH:
            n_positional, keyword_only = _dispatch_call_shape(target)
            signature.bind(*([None] * n_positional), **{name: None for name in keyword_only})
        else:
            signature.bind(None, None, None, None)
    except TypeError as error:
        if level is PatchLevel.DISPATCH:
            expected = f"handler(*args, **kwargs) with the arguments of {target._schema}"
        else:
            expected = "handler(func, types, args, kwargs)"
        raise ValueError(
            f"{level.value}-level handlers are called as {expected}; this one cannot take those arguments: {error}"
        ) from None
