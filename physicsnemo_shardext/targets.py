"""Naming and validating patch targets and handlers.

A *target* is what ShardTensor looks a handler up by: a Python callable
(function level), a custom op's string name (named level) or an aten
``OpOverload`` (dispatch level). This module turns user input into that key,
checks that it exists and that the handler can be called the way its level
calls it, and gives every target a readable name for messages and listings.

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

__all__ = ["describe_handler", "describe_target", "infer_level", "resolve_target", "validate_handler"]

# Namespaces searched (in order) to give a callable its public dotted name.
_PUBLIC_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch.nn.functional", torch.nn.functional),
    ("torch", torch),
    ("torch.Tensor", torch.Tensor),
    ("torch.fft", torch.fft),
    ("torch.linalg", torch.linalg),
    ("torch.special", torch.special),
)


def describe_target(target: Any) -> str:
    """Return a stable, readable name for a target (used in messages, listings, config).

    Examples:
        >>> import torch.nn.functional as F
        >>> describe_target(F.max_pool2d), describe_target("mylib.op.default"), describe_target(torch.ops.aten.roll)
        ('torch.nn.functional.max_pool2d', 'mylib.op.default', 'aten.roll')
    """
    if isinstance(target, (str, AttributeTarget)):
        return str(target)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    name = getattr(target, "__name__", None)
    if name:
        for namespace_name, namespace in _PUBLIC_NAMESPACES:
            if getattr(namespace, name, None) is target:
                return f"{namespace_name}.{name}"
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or repr(target)
    return f"{module}.{qualname}" if module else qualname


def describe_handler(handler: Callable) -> str:
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


def _custom_op_exists(name: str) -> bool:
    """Whether ``"namespace.op.overload"`` names an op registered with torch."""
    parts = name.split(".")
    if len(parts) != 3:
        return False
    namespace, op_name, overload = parts
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return overload in packet.overloads()
    except (AttributeError, RuntimeError):
        return False


def infer_level(target: Any) -> PatchLevel:
    """Guess the level a target belongs to: OpOverload -> dispatch, str -> named, else function.

    Examples:
        >>> infer_level(torch.roll).value
        'function'
    """
    if isinstance(target, torch._ops.OpOverload):
        return PatchLevel.DISPATCH
    if isinstance(target, AttributeTarget):
        return PatchLevel.ATTRIBUTE
    if isinstance(target, str):
        return PatchLevel.NAMED
    return PatchLevel.FUNCTION


def resolve_target(target: Any, level: PatchLevel) -> Any:
    """Return the registry key for ``target`` at ``level`` or raise ``ValueError`` saying why.

    Function-level targets may be given as dotted strings (``"torch.roll"``);
    attribute-level targets are `AttributeTarget` whose owner has the attribute.
    """
    if level is PatchLevel.ATTRIBUTE:
        if not isinstance(target, AttributeTarget):
            raise ValueError(f"attribute-level targets must be AttributeTarget(owner, name), got {type(target).__name__}")
        if not isinstance(target.owner, (type, types.ModuleType)):
            raise ValueError(f"the owner of {target.name!r} must be a class or a module, got {type(target.owner).__name__}")
        if not hasattr(target.owner, target.name):
            raise ValueError(f"{target} does not exist (no attribute {target.name!r} on its owner)")
        return target
    if level is PatchLevel.DISPATCH:
        if isinstance(target, torch._ops.OpOverloadPacket):
            raise ValueError(
                f"{target} is an overload packet; declare a specific overload such as "
                f"{target}.default"
            )
        if not isinstance(target, torch._ops.OpOverload):
            raise ValueError(
                f"dispatch-level targets must be torch OpOverloads (e.g. torch.ops.aten.roll.default), "
                f"got {type(target).__name__}"
            )
        return target
    if level is PatchLevel.NAMED:
        if not isinstance(target, str):
            raise ValueError(
                f"named-level targets must be op names like 'mylib.op.default', got {type(target).__name__}"
            )
        if not _custom_op_exists(target):
            raise ValueError(f"no op named {target!r} is registered with torch.ops")
        return target
    if isinstance(target, str):
        try:
            target = _import_dotted(target)
        except LookupError as error:
            raise ValueError(str(error)) from None
    if not callable(target):
        raise ValueError(f"function-level targets must be callables, got {type(target).__name__}")
    return target


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
            f"{level.value}-level handlers are called as {expected}; "
            f"this one cannot take those arguments: {error}"
        ) from None
