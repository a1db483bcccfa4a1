"""Output shapes from torch's own argument checks, run once per configuration on meta tensors.

Handlers let torch validate a call and give the global output shape by calling
the op on meta tensors of the operands' global shapes. The answer depends only on
the shapes, dtypes and the other arguments, and a layer calls its op with the same
ones every step, so `meta_output_shape` caches it (a wrong call is not cached: it
raises torch's own error every time).

Examples:
    >>> import torch.nn.functional as F
    >>> x, w = torch.zeros(1, 2, 9, 9), torch.zeros(4, 2, 3, 3)
    >>> meta_output_shape(F.conv2d, (x, w, None, 2, 1))
    torch.Size([1, 4, 5, 5])
    >>> meta_output_shape(F.max_pool2d, (x,), {"kernel_size": 2, "return_indices": True})
    (torch.Size([1, 2, 4, 4]), torch.Size([1, 2, 4, 4]))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["meta_output_shape"]


class _TensorKey(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _key(value: Any, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorKey(tuple(value.shape), dtype or value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v, dtype) for v in value))
    return value


def _rebuild(key: Any) -> Any:
    if isinstance(key, _TensorKey):
        return torch.empty(key.shape, device="meta", dtype=key.dtype)
    if isinstance(key, tuple) and len(key) == 2 and key[0] in ("list", "tuple"):
        items = [_rebuild(k) for k in key[1]]
        return items if key[0] == "list" else tuple(items)
    return key


def _shapes(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return result.shape
    if isinstance(result, (list, tuple)):
        return tuple(_shapes(r) for r in result)
    return result


@functools.lru_cache(maxsize=1024)
def _cached(func: Callable[..., Any], args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]) -> Any:
    return _shapes(func(*(_rebuild(a) for a in args), **{k: _rebuild(v) for k, v in kwargs}))


def meta_output_shape(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> Any:
    """Shape(s) of ``func(*args, **kwargs)`` computed on meta tensors of the tensors' shapes (cached).

    Tensors in ``args``/``kwargs`` (ShardTensors: their global shape) stand for meta
    tensors of their shape and dtype (``dtype`` overrides every dtype: autocast does not
    run on the meta device). Returns a ``torch.Size``, or a tuple of them for an op that
    returns several tensors. Arguments that cannot be hashed are computed uncached.
    """
    arg_keys = tuple(_key(a, dtype) for a in args)
    kwarg_keys = tuple(sorted((k, _key(v, dtype)) for k, v in (kwargs or {}).items()))
    try:
        return _cached(func, arg_keys, kwarg_keys)
    except TypeError as error:
        if "unhashable" not in str(error):
            raise
    return _shapes(func(*(_rebuild(a) for a in arg_keys), **{k: _rebuild(v) for k, v in kwarg_keys}))
