"""Argument handling that every handler starts with: bind a call, expand scalars to tuples.

A handler receives ``args``/``kwargs`` exactly as the user wrote them. Binding
them against the *reference callable's* signature (the torch function itself,
or a mirror function with the same parameters where torch's builtin has no
introspectable signature) lets Python do the positional/keyword matching, fill
in defaults and raise ``TypeError`` for a wrong call, as torch itself would.

Examples:
    >>> import torch.nn.functional as F
    >>> bound = bind_arguments(F.interpolate, ("x",), {"scale_factor": 2})
    >>> bound["size"], bound["scale_factor"], bound["mode"]
    (None, 2, 'nearest')
    >>> def softmax(input, dim=None, dtype=None): ...   # a mirror of torch.softmax's parameters
    >>> bind_arguments(softmax, ("x",), {"dim": 1})
    {'input': 'x', 'dim': 1, 'dtype': None}
    >>> expand_to(2, 3), expand_to([4], 2), expand_to((1, 2), 2)
    ((2, 2, 2), (4, 4), (1, 2))
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["bind_arguments", "expand_to"]


@functools.cache
def _signature(reference: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(reference)
    except (TypeError, ValueError) as error:  # C builtins such as torch.softmax
        raise TypeError(
            f"bind_arguments: {reference!r} has no introspectable signature; pass a mirror function "
            "with the same parameters (names, order, defaults) instead"
        ) from error


@functools.cache
def _fast_plan(reference: Callable[..., Any]) -> tuple[tuple[str, ...], int, dict[str, Any]] | None:
    """(names, how many may be positional, defaults) where binding is plain name matching, else ``None``.

    ``inspect.Signature.bind`` costs about 10 µs a call; a handler binds on every call.
    Signatures with ``*args``, ``**kwargs`` or positional-only parameters keep using it.
    """
    names: list[str] = []
    defaults: dict[str, Any] = {}
    positional = 0
    for parameter in _signature(reference).parameters.values():
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            if positional != len(names):  # a positional parameter after a keyword-only one cannot happen
                return None
            positional += 1
        elif parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            return None
        names.append(parameter.name)
        if parameter.default is not inspect.Parameter.empty:
            defaults[parameter.name] = parameter.default
    return tuple(names), positional, defaults


def bind_arguments(reference: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``args``/``kwargs`` mapped onto ``reference``'s parameters by name, defaults filled in.

    Raises ``TypeError`` for a call ``reference`` itself would reject (too many
    positional arguments, an unknown keyword, a missing required argument).

    Examples:
        >>> def pad(input, pad, mode="constant", value=None): ...
        >>> bind_arguments(pad, ("x", (1, 1)), {})
        {'input': 'x', 'pad': (1, 1), 'mode': 'constant', 'value': None}
        >>> bind_arguments(pad, ("x", (1, 1)), {"size": 3})
        Traceback (most recent call last):
        ...
        TypeError: pad(): got an unexpected keyword argument 'size'
    """
    plan = _fast_plan(reference)
    if plan is not None:
        names, positional, defaults = plan
        given = dict(zip(names, args))
        if (
            len(args) <= positional
            and all(k in defaults or k in names for k in kwargs)
            and not any(k in given for k in kwargs)
        ):
            given.update(kwargs)
            if all(n in given or n in defaults for n in names):
                return {n: given[n] if n in given else defaults[n] for n in names}
        # Anything unusual (a missing or unknown argument): inspect's binding, for its error message.
    name = getattr(reference, "__name__", "function")
    signature = _signature(reference)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{name}(): {error}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def expand_to(value: Any, n: int, *, what: str = "argument", op: str = "") -> tuple[Any, ...]:
    """``value`` as an ``n``-tuple: a scalar (or ``None``) repeated, a 1-sequence repeated, an ``n``-sequence kept.

    The scalar-or-tuple convention of torch's conv, pool and resampling arguments;
    any other length raises ``ValueError`` naming ``what`` and ``op``.

    Examples:
        >>> expand_to(None, 2)
        (None, None)
        >>> expand_to((1, 2, 3), 2, what="stride", op="avg_pool2d")
        Traceback (most recent call last):
        ...
        ValueError: avg_pool2d: stride must have 2 elements, got (1, 2, 3)
    """
    if not isinstance(value, (list, tuple)):
        return (value,) * n
    items = tuple(value)
    if len(items) == 1:
        return items * n
    if len(items) != n:
        prefix = f"{op}: " if op else ""
        raise ValueError(f"{prefix}{what} must have {n} elements, got {items}")
    return items
