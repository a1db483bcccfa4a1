"""Allocate a layer's scratch buffers sharded like the tensors it works on.

Layers such as PhysicsNeMo's ``AFNO2DLayer`` allocate full-size buffers with
``torch.zeros(shape)`` (shapes taken from a sharded tensor's *global* shape) and
then fill regions of them with sharded values. A plain buffer can only hold
such values replicated, so everything computed from it would run redundantly on
every rank, and a ``Replicate`` DTensor parameter meeting the plain buffer is an
error in DTensor. Inside `sharded_allocations`, a factory call whose
shape lines up with a ShardTensor seen earlier in the same block on every one of
its sharded dims (same global size) instead returns a ShardTensor with that
tensor's placements and row split. The global value is the same (zeros are zeros),
so the program means what it meant; it just stays sharded.

Only ``torch.zeros``/``ones``/``empty``/``full`` with an explicit shape are
rewritten, and only when the caller did not ask for ``requires_grad``; every
other call is untouched.

Examples:
    On 2 ranks, ``x`` of global shape ``(4, 6)`` split 4/2 on dim 1; the buffer
    allocated from its global shape comes out split the same way:

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.arange(24.0).reshape(4, 6), mesh, [Shard(1)], [4, 2])
    >>> with sharded_allocations():
    ...     y = x * 2
    ...     buffer = torch.zeros(y.shape)
    >>> type(buffer).__name__, tuple(buffer.to_local().shape) == [(4, 4), (4, 2)][rank]
    ('ShardTensor', True)
    >>> torch.equal(buffer.full_tensor(), torch.zeros(4, 6))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from physicsnemo_shardext.primitives.layout import build_shard_tensor, sharded_dims
from physicsnemo_shardext.primitives.wrapping import local_of

__all__ = ["sharded_allocations"]

_FACTORIES: dict[Callable[..., Any], int] = {torch.zeros: 0, torch.ones: 0, torch.empty: 0, torch.full: 1}


def _shape_of(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The requested shape of a factory call, or None when it is not given as one sequence or ints."""
    if "size" in kwargs:
        shape = kwargs["size"]
    elif func is torch.full:
        shape = args[0] if args else None
    elif len(args) == 1 and isinstance(args[0], (Sequence, torch.Size)):
        shape = args[0]
    else:
        shape = args
    if not isinstance(shape, (Sequence, torch.Size)) or not all(isinstance(n, int) for n in shape):
        return None
    return tuple(int(n) for n in shape)


class sharded_allocations(TorchFunctionMode):  # noqa: N801 - used like a function: `with sharded_allocations():`
    """A scope in which full-size buffers are allocated sharded like the ShardTensors around them.

    ShardTensors produced or consumed in the scope are remembered (newest first);
    a factory call is sharded like the newest one that matches its shape.

    Examples:
        Layer code runs unchanged; its ``torch.zeros`` buffers are sharded
        (here ``layer_forward`` stands for a layer such as ``AFNO2DLayer.forward``):

        ```python
        with sharded_allocations():
            out = layer_forward(x)
        ```
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen: list[ShardTensor] = []

    def _remember(self, tree: Any) -> None:
        for leaf in tree_leaves(tree):
            if isinstance(leaf, ShardTensor) and not any(p.is_partial() for p in leaf._spec.placements):
                self._seen.insert(0, leaf)
        del self._seen[8:]  # a handful of recent tensors is all a layer's buffers refer to

    def _sharded_buffer(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ShardTensor | None:
        if kwargs.get("requires_grad") or kwargs.get("out") is not None:
            return None
        shape = _shape_of(func, args, kwargs)
        if shape is None:
            return None
        for like in self._seen:
            layouts = sharded_dims(like)
            if layouts and all(d < len(shape) and shape[d] == layout.total for d, layout in layouts.items()):
                local_shape = list(shape)
                for d, layout in layouts.items():
                    local_shape[d] = layout.local_size
                local_args = (local_shape, *args[1:]) if func is torch.full else (local_shape,)
                local_kwargs = {k: v for k, v in kwargs.items() if k != "size"}
                local_kwargs.setdefault("device", local_of(like).device)
                local = func(*local_args, **local_kwargs)
                return build_shard_tensor(
                    local, like._spec.mesh, like._spec.placements, {d: layout.sizes for d, layout in layouts.items()}
                )
        return None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and self._seen:
            buffer = self._sharded_buffer(func, args, kwargs)
            if buffer is not None:
                return buffer
        self._remember((args, kwargs))
        result = func(*args, **kwargs)
        self._remember(result)
        return result
