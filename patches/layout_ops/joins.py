"""Joins and splits of uneven shards: the layout_ops family's ops that take or give several tensors.

``cat`` (and its aliases) of identically sharded tensors along an unsharded dim, with a
replicated or DTensor-sharded operand cut to the shards' rows and a differently split
partner re-split to them (`_rows_like`); ``stack`` along a new dim; ``split`` / ``chunk`` /
``tensor_split`` into pieces of the local block; ``unbind`` along a sharded dim (gathered
first). The family's declarations, and what it refuses, are in the package
(``physicsnemo_shardext.patches.layout_ops``); views and reshapes in its ``views`` module.

Examples:
    ``x`` of shape ``(1, 4, 7, 3)`` split 5 + 2 on dim 2, on 2 ranks:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
    >>> a, b = torch.cat([x, 2 * x], dim=1).split(4, dim=1)   # no communication either way
    >>> b.placements, torch.equal(b.full_tensor(), 2 * x.full_tensor())
    ((Shard(dim=2),), True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.layout_ops.views import _row_counts, gather_dims
from physicsnemo_shardext.primitives import (
    build_shard_tensor,
    delegate,
    describe_target,
    eager_handler,
    fallback,
    from_local_like,
    is_partial,
    is_tracing,
    local_of,
    mesh_of,
    placements_of,
    replicated_part,
    resplit_rows,
    sharded_dims,
    sum_grad_over,
)

__all__ = ["cat_local", "split_local", "stack_local", "unbind_gathering_sharded_dim"]


@eager_handler
def unbind_gathering_sharded_dim(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``unbind`` along a sharded dim: that dim is gathered first (`gather_dims`), then the built-in.

    PhysicsNeMo's ``aten.unbind`` handler raises a bare ``RuntimeError`` ("No implementation for
    unbinding along sharding axis yet"); each piece is one row of the dim, held by one rank, so
    the pieces come out ``Replicate`` on that mesh dim (one all-gather). Every other unbind
    (an unsharded dim, ``Partial``, not a ShardTensor) goes to what this replaced.
    """
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if type(x) is not ShardTensor or is_partial(x) or not isinstance(dim, int) or x.ndim == 0:
        return delegate(func, types, args, kwargs)
    dim %= x.ndim
    if dim not in sharded_dims(x):
        if is_tracing((x,)) and all(isinstance(p, (Shard, Replicate)) for p in placements_of(x)):
            return _unbind_local(x, dim)  # the built-in is not traced; this is what it computes
        return delegate(func, types, args, kwargs)
    return delegate(func, types, (gather_dims(x, [dim]), dim), {})


def _unbind_local(x: ShardTensor, dim: int) -> tuple[ShardTensor, ...]:
    """``unbind`` along a dim no mesh dim shards: the local block's pieces, each sharded dim after ``dim`` one lower."""
    placements = [Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > dim else p for p in placements_of(x)]
    sizes = {(d - 1 if d > dim else d): layout.sizes for d, layout in sharded_dims(x).items()}
    return tuple(build_shard_tensor(piece, mesh_of(x), placements, sizes) for piece in local_of(x).unbind(dim))


def _identical_shard_inputs(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], verb: str
) -> tuple[list[ShardTensor], int]:
    """The ``tensors`` and ``dim`` of a cat/stack call, refused unless every input is sharded identically."""
    tensors = list(kwargs.get("tensors", args[0] if args else ()))
    dim = _cat_dim(args, kwargs)
    name = describe_target(func)
    if not tensors or not all(isinstance(t, ShardTensor) for t in tensors):
        raise MissingShardPatch(
            f"{name}: every input must be a ShardTensor (got {[type(t).__name__ for t in tensors]}; the DTensor "
            "fallback assumes even chunks and fails on uneven shards)"
        )
    # The most sharded input sets the layout: one replicated on a mesh dim is cut to it, never the reverse.
    first = max(tensors, key=lambda t: sum(isinstance(p, Shard) for p in placements_of(t)))
    placements = placements_of(first)  # Partial inputs never get here: cat/stack delegate them
    rows = _row_counts(first)
    tensors = [_rows_like(t, first) for t in tensors]
    for t in tensors[1:]:
        if mesh_of(t) != mesh_of(first) or placements_of(t) != placements or _row_counts(t) != rows:
            raise MissingShardPatch(
                f"{name}: inputs sharded differently ({placements_of(t)} rows {_row_counts(t)} vs "
                f"{placements} rows {rows}); {verb} needs identical shards (the DTensor fallback assumes even "
                "chunks and fails on uneven shards)"
            )
    return tensors, dim


def _rows_like(x: ShardTensor, like: ShardTensor) -> ShardTensor:
    """``x`` re-split to ``like``'s rows when both have one mesh and placements but other row counts.

    A UNet's skip connection meets its upsampled partner split differently once pooling
    rounded an odd shard (10/6 -> 5/3 -> 3/1 -> 6/2 vs 5/3): only the rows that change owner
    move, in one all-to-all per sharded dim (backward: the reverse). Anything else is
    returned unchanged for the caller to judge.
    """
    if x is not like and mesh_of(x) == mesh_of(like):
        x = _cut_replicated_mesh_dims(x, like)
    if x is like or mesh_of(x) != mesh_of(like) or placements_of(x) != placements_of(like):
        return x
    layouts, wanted = sharded_dims(x), _row_counts(like)
    if set(layouts) != set(wanted) or all(layouts[d].sizes == wanted[d] for d in layouts):
        return x
    if any(layouts[d].total != sum(wanted[d]) for d in layouts):
        return x  # different extents: not a re-split, the caller refuses
    local = local_of(x)
    for d, layout in layouts.items():
        local = resplit_rows(local, layout, wanted[d])
    return build_shard_tensor(local, mesh_of(x), placements_of(x), wanted)


def _cut_replicated_mesh_dims(x: ShardTensor, like: ShardTensor) -> ShardTensor:
    """``x`` cut to ``like``'s rows on the mesh dims where ``x`` is ``Replicate`` and ``like`` is ``Shard``.

    A 2-D-sharded UNet's skip meets a partner whose W came back replicated (SongUNet's
    attention at 8x8 on a 2x2 mesh): the replicated rows are narrowed to ``like``'s block,
    no communication; the gradient is summed over those mesh dims. Every other mismatch
    returns ``x`` unchanged for the caller to judge.
    """
    own, wanted = placements_of(x), placements_of(like)
    if len(own) != len(wanted) or own == wanted:
        return x
    sharded = {p.dim % x.ndim for p in own if isinstance(p, Shard)}
    cut = [
        i
        for i, (p, q) in enumerate(zip(own, wanted))
        if isinstance(p, Replicate) and isinstance(q, Shard) and q.dim % x.ndim not in sharded
    ]
    if not cut or any(p != q for i, (p, q) in enumerate(zip(own, wanted)) if i not in cut):
        return x
    if any(x.shape[wanted[i].dim % x.ndim] != like.shape[wanted[i].dim % x.ndim] for i in cut):
        return x
    layouts = sharded_dims(like)
    local = sum_grad_over(local_of(x), mesh_of(x), cut)
    sizes = {d: layout.sizes for d, layout in sharded_dims(x).items()}
    for i in cut:
        dim = wanted[i].dim % x.ndim
        local = local.narrow(dim, layouts[dim].start, layouts[dim].local_size)
        sizes[dim] = layouts[dim].sizes
    return build_shard_tensor(local, mesh_of(x), wanted, sizes)


@eager_handler
def cat_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``torch.cat(tensors, dim)`` of identically sharded tensors along a dimension that is not sharded.

    Its aliases ``torch.concat`` and ``torch.concatenate(tensors, axis)`` reach it too.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> z = cat_local(torch.cat, (), ([x, 2 * x], 1), {})
        >>> z.placements, tuple(z.to_local().shape) == [(1, 8, 5, 3), (1, 8, 2, 3)][rank]
        ((Shard(dim=2),), True)
    """
    tensors = list(kwargs.get("tensors", args[0] if args else ()))
    dim = _cat_dim(args, kwargs)
    if any(is_partial(t) for t in tensors):
        # DTensor's cat of Partial(sum) operands is right (GeoTransolver's context builder).
        return delegate(func, types, args, kwargs)
    if _delegate_differently_sharded(tensors):
        return delegate(func, types, args, kwargs)
    reference = next((t for t in tensors if isinstance(t, ShardTensor)), None)
    if reference is not None and any(isinstance(t, torch.Tensor) and not isinstance(t, ShardTensor) for t in tensors):
        # A replicated operand (a plain tensor, e.g. FNO's full coordinate grid, or a Replicate
        # DTensor) is cut to the ShardTensor's rows; its gradient, if any, is summed over the shards.
        # A plain DTensor sharded DTensor's way (even chunks, e.g. FLARE's positional buffer) is
        # gathered first (differentiably), since its chunks need not line up with uneven shards.
        tensors = [
            t if isinstance(t, ShardTensor) else _replicated_rows(_gathered(t), reference, func) for t in tensors
        ]
        args, kwargs = (tensors, dim), {}
    tensors, dim = _identical_shard_inputs(func, args, kwargs, "concatenation")
    first = tensors[0]
    dim %= first.ndim
    placements = placements_of(first)
    if any(isinstance(p, Shard) and p.dim % first.ndim == dim for p in placements):
        # The fallback gathers the sharded dim: Replicate output, right on uneven shards (checked on 2 ranks).
        return delegate(func, types, (tensors, dim), {})
    local = torch.cat([local_of(t) for t in tensors], dim=dim)
    return from_local_like(local, first)


def _cat_dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ``dim`` of a cat call; its alias ``torch.concatenate`` names it ``axis``."""
    return int(kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0)))


def _delegate_differently_sharded(tensors: Sequence[Any], plain_too: bool = False) -> bool:
    """Whether a cat/stack of differently laid out inputs goes to the DTensor fallback.

    The fallback assumes DTensor's even ``torch.chunk`` rows; with them it is right (checked
    on 2 ranks, values and gradients: ``Shard`` next to another ``Shard`` dim, next to a
    ``Replicate`` ShardTensor, or, for ``stack``, next to a plain tensor). With uneven
    (or empty) shards it fails (a size mismatch, or the ``uneven_redistribute`` guard), so
    those stay with the handler, which refuses them. ``plain_too``: a plain tensor among
    the inputs counts as a different layout (``stack``; ``cat`` cuts it to the rows itself).
    """
    shards = [t for t in tensors if isinstance(t, ShardTensor)]
    if not shards or len(shards) == len(tensors) and _identically_sharded(shards):
        return False
    if len(shards) < len(tensors) and not plain_too and _identically_sharded(shards):
        return False
    return all(_dtensor_chunks(t) for t in shards)


def _identically_sharded(tensors: Sequence[ShardTensor]) -> bool:
    first = tensors[0]
    return all(
        mesh_of(t) == mesh_of(first)
        and placements_of(t) == placements_of(first)
        and _row_counts(t) == _row_counts(first)
        for t in tensors[1:]
    )


def _dtensor_chunks(t: ShardTensor) -> bool:
    """Whether every sharded dim of ``t`` holds ``torch.chunk``'s rows, none empty (DTensor's own layout)."""
    for layout in sharded_dims(t).values():
        chunks = [len(c) for c in torch.arange(layout.total).chunk(len(layout.sizes))]
        if list(layout.sizes) != chunks:  # fewer chunks than ranks: an empty shard
            return False
    return True


def _gathered(value: Any) -> Any:
    """A plain DTensor with ``Shard`` placements as a full plain tensor (differentiable all-gather); else ``value``."""
    if (
        isinstance(value, DTensor)
        and not isinstance(value, ShardTensor)
        and not all(p.is_replicate() for p in value.placements)
    ):
        return value.full_tensor()
    return value


def _replicated_rows(value: Any, like: ShardTensor, func: Any) -> ShardTensor:
    """A replicated operand of ``cat`` as a ShardTensor split like ``like`` (no broadcasting, as in ``cat``)."""
    name = describe_target(func)
    if value.ndim != like.ndim or any(value.shape[d] != like.shape[d] for d in _row_counts(like)):
        raise MissingShardPatch(
            f"{name}: a replicated input of shape {tuple(value.shape)} does not match the sharded dims of "
            f"shape {tuple(like.shape)}"
        )
    return from_local_like(replicated_part(value, like, f"{name}: replicated input"), like)


@eager_handler
def stack_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``torch.stack(tensors, dim)`` of identically sharded tensors: local stack along the new (unsharded) dim.

    Sharded dims at or after ``dim`` move up by one and keep their row counts.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> o2 = stack_local(torch.stack, (), ([x, 2 * x],), {"dim": -1})
        >>> o2.placements, tuple(o2.to_local().shape) == [(1, 4, 5, 3, 2), (1, 4, 2, 3, 2)][rank]
        ((Shard(dim=2),), True)
    """
    tensors = list(kwargs.get("tensors", args[0] if args else ()))
    if any(is_partial(t) for t in tensors):
        return delegate(func, types, args, kwargs)  # DTensor stacks Partial(sum) operands right
    if _delegate_differently_sharded(tensors, plain_too=True):
        return delegate(func, types, args, kwargs)
    tensors, dim = _identical_shard_inputs(func, args, kwargs, "stacking")
    first = tensors[0]
    if any(t.shape != first.shape for t in tensors[1:]):
        return delegate(func, types, args, kwargs)  # torch's own error: stack expects each tensor to be equal size
    dim %= first.ndim + 1
    new_placements = [
        Shard(p.dim % first.ndim + (p.dim % first.ndim >= dim)) if isinstance(p, Shard) else p
        for p in placements_of(first)
    ]
    sizes = {d + (d >= dim): n for d, n in _row_counts(first).items()}
    local = torch.stack([local_of(t) for t in tensors], dim=dim)
    return build_shard_tensor(local, mesh_of(first), new_placements, sizes)


@eager_handler
def split_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``split`` / ``chunk`` / ``tensor_split`` along an unsharded dim: pieces of the local block.

    The pieces keep the input's placements and split, e.g. a fused ``qkv`` projection cut into
    q, k and v on a sequence split 5/4. A ``Partial`` input goes to the DTensor fallback as
    before this plugin. Along a sharded dim that dim is gathered first and the pieces are cut
    locally (the fallback assumed ``torch.chunk``'s rows on a 2-D mesh, and one piece's backward
    failed on any mesh). ``unbind``: `unbind_gathering_sharded_dim`.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> qkv = shard_tensor(torch.arange(54.0).reshape(1, 9, 6), mesh, [Shard(1)], [5, 4])
        >>> q, k, v = qkv.chunk(3, dim=-1)                # rows stay 5/4 (the fallback re-cut them 5/5)
        >>> q.placements, q.to_local().shape[1] == [5, 4][rank], torch.equal(v.full_tensor(), qkv.full_tensor()[..., 4:])
        ((Shard(dim=1),), True, True)
    """
    x, *rest = args
    if not isinstance(x, ShardTensor) or is_partial(x):
        return fallback(func, args, kwargs)  # as before this plugin
    dim = kwargs.get("dim", rest[1] if len(rest) > 1 else 0)
    if x.ndim and int(dim) % x.ndim in _row_counts(x):
        # Along a sharded dim the fallback's pieces failed: on a 2-D mesh it labels them with
        # torch.chunk's rows (a shape error on uneven shards), and on any mesh the backward of one
        # piece met plain zero gradients for the unused ones ("mixed torch.Tensor and DTensor";
        # tests/patches/test_layout_fuzz.py). Gather the split dim (what the fallback's forward did
        # too): the pieces are then local, and keep the other dims' splits.
        return split_local(func, types, (gather_dims(x, [int(dim) % x.ndim]), *rest), kwargs)
    if x.ndim == 0:
        return fallback(func, args, kwargs)  # torch's own error
    return tuple(from_local_like(piece, x) for piece in func(local_of(x), *rest, **kwargs))
