"""Layout ops on uneven shards: permute, transpose, contiguous/clone, cat, stack, flatten, reshape, complex views.

PhysicsNeMo has no patch for these, so on a ShardTensor they take the DTensor
fallback, which re-derives the output's shard sizes by *even chunking*
whenever the output's shape, stride or placements differ from the input's.
On uneven shards that fails (``expected local shape ... does not match``):
a transpose or permute that renumbers the sharded dim, ``.contiguous()`` of a
a permuted tensor, a ``torch.cat`` of sharded feature maps along channels.
PhysicsNeMo's own models hit all of them (UNet's attention gates and skip
connections, SRResNet's ``PixelShuffle3d``). ``F.prelu``, which lived here
before, is in the ``pointwise`` family.

Every op here is local, with no communication in the forward pass, except a
reshape or flatten that merges two sharded dims (one all-gather):

* ``permute`` / ``transpose``: the local block is permuted; each ``Shard(d)``
  follows its dimension to its new index, with the same per-rank row counts;
* ``contiguous`` / ``clone``: same placements and row counts;
* ``cat`` along a dimension that is not sharded: the inputs must share mesh,
  placements and row counts on every sharded dim (then the local blocks line
  up row for row); a plain or replicated input of the full size (FNO's
  coordinate grid) is cut to each rank's rows, its gradient summed over the shards;
* ``stack`` of identically sharded tensors along a new dim; sharded dims at or
  after it move up by one;
* ``flatten`` when the group starts with a sharded dim, or only size-1 dims precede
  it (rows stay contiguous; row counts scale by the other dims' product), ``unflatten`` of a sharded dim
  whose rows per rank are multiples of the new inner dims' product;
* ``reshape`` / ``view`` (override the built-ins) and ``flatten`` that merge two
  sharded dims (an H- and W-sharded grid into points): the inner dim is gathered
  over its mesh dim first (one all-gather), because DTensor cannot split points
  over two mesh dims with uneven, per-group sizes; the points come out sharded
  over the outer dim's mesh dim and replicated over the other. Other reshapes go
  to PhysicsNeMo's built-in;
* ``.real`` / ``.imag`` / ``torch.real`` / ``torch.imag`` / ``view_as_real`` /
  ``view_as_complex`` (AFNO's spectral block): views of the local block, same
  placements and row counts.

A plain DTensor with ``Shard`` placements next to ShardTensors in ``cat`` (FLARE's
positional buffer, sharded DTensor's way in even chunks) is gathered first (one
all-gather, differentiable), then cut to the ShardTensors' rows like a replicated input.

Delegated (`delegate`: the built-in for
reshape/view, else the DTensor fallback), checked on 2 ranks: ``Partial`` inputs of
``cat`` and ``stack`` (GeoTransolver's context builder), of reshape/view, and of
flatten/unflatten/complex views (as before this plugin); reshapes that merge no
sharded dim with a dim in front of it; ``cat`` along a sharded dim (the fallback
gathers it: ``Replicate`` output, values and gradients right on uneven shards);
``view_as_complex`` with its last dim sharded (the fallback gathers it: ``Replicate``);
``stack`` of inputs of different shapes (torch's own error comes back); ``cat`` and
``stack`` of differently laid out inputs (``Shard`` of another dim, a ``Replicate``
ShardTensor, for ``stack`` a plain tensor) whose shards all hold DTensor's own
``torch.chunk`` rows, none empty (the fallback redistributes them right: values and
gradients equal single-process).

Refused (``MissingShardPatch``): a reshape/view/flatten that merges a sharded dim
with dims in front of it holding more than one row (a batch of 2 samples per domain
group merged with the sharded H, as FNO's decoder does: each rank's rows would
interleave in the merged dim, which the built-in labels ``Shard`` anyway); ``cat`` and
``stack`` of differently laid out
inputs when a shard is uneven or empty (the fallback assumes ``torch.chunk`` rows: a
size mismatch, e.g. "Sizes of tensors must match except in dimension 1", or the
``uneven_redistribute`` guard; checked on 2 ranks); a replicated ``cat`` input of the
wrong size (torch rejects it too); ``unflatten`` cutting across a rank boundary (the
fallback fails: "Cannot unflatten unevenly sharded tensor" even on 6/6 shards).

Examples:
    ``x`` of shape ``(1, 4, 7, 3)`` split 5 + 2 on dim 2, on 2 ranks:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(84.0).reshape(1, 4, 7, 3)
    >>> x = shard_tensor(full, mesh, [Shard(2)], [5, 2])
    >>> y = x.permute(0, 2, 1, 3)             # the shard follows its dim: Shard(1), rows 5/2
    >>> y.placements, y.to_local().shape[1] == [5, 2][rank]
    ((Shard(dim=1),), True)
    >>> z = torch.cat([x, 2 * x], dim=1)      # 8 channels, rows still 5/2, no communication
    >>> tuple(z.to_local().shape) == [(1, 8, 5, 3), (1, 8, 2, 3)][rank]
    True
    >>> torch.equal(z.full_tensor(), torch.cat([full, 2 * full], dim=1))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from physicsnemo_shardext import FunctionHandler, MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    build_shard_tensor,
    delegate,
    delegate_when_traced,
    describe_target,
    eager_handler,
    fallback,
    from_local_like,
    is_partial,
    replicated_part,
    sharded_dims,
)

__all__ = [
    "cat_local", "clone_local", "complex_view_local", "flatten_local", "gather_dims", "permute_local",
    "reshape_merging_sharded_dims", "stack_local", "transpose_local", "unflatten_local",
]


def _moved(x: ShardTensor, local: torch.Tensor, order: Sequence[int]) -> ShardTensor:
    """Wrap ``local`` (``x``'s block with dims reordered: new dim i is old dim ``order[i]``)."""
    new_index = {old: new for new, old in enumerate(order)}
    placements = [Shard(new_index[p.dim % x.ndim]) if isinstance(p, Shard) else p for p in x._spec.placements]
    sizes = {new_index[d]: layout.sizes for d, layout in sharded_dims(x).items()}
    return build_shard_tensor(local, x._spec.mesh, placements, sizes)


@eager_handler
def permute_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.permute(*dims)`` / ``torch.permute(x, dims)`` on the local block; shards follow their dims.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = permute_local(torch.Tensor.permute, (), (x, 0, 2, 1, 3), {})
        >>> y.placements, y.to_local().shape[1] == [5, 2][rank]
        ((Shard(dim=1),), True)
    """
    x, *rest = args
    dims = kwargs.get("dims", rest[0] if len(rest) == 1 else rest)
    if isinstance(dims, int):
        dims = [dims]
    order = [int(d) % x.ndim for d in dims]
    return _moved(x, x.to_local().permute(order), order)


@eager_handler
def transpose_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.transpose(d0, d1)`` / ``torch.transpose(x, d0, d1)`` on the local block.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = transpose_local(torch.transpose, (), (x, 2, 3), {})
        >>> y.placements, y.to_local().shape[3] == [5, 2][rank]
        ((Shard(dim=3),), True)
    """
    x, *rest = args
    d0 = kwargs.get("dim0", rest[0] if rest else None)
    d1 = kwargs.get("dim1", rest[1] if len(rest) > 1 else None)
    d0, d1 = int(d0) % x.ndim, int(d1) % x.ndim
    order = list(range(x.ndim))
    order[d0], order[d1] = d1, d0
    return _moved(x, x.to_local().transpose(d0, d1), order)


@eager_handler
@delegate_when_traced  # AOTAutograd makes tangents contiguous on fake ShardTensors, past any graph break
def clone_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.contiguous()`` / ``x.clone()`` on the local block; placements and row counts unchanged.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = clone_local(torch.Tensor.contiguous, (), (x.transpose(2, 3),), {})
        >>> y.placements, y.to_local().is_contiguous(), y.to_local().shape[3] == [5, 2][rank]
        ((Shard(dim=3),), True, True)
    """
    x, *rest = args
    return from_local_like(func(x.to_local(), *rest, **kwargs), x)


@eager_handler
def complex_view_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``.real`` / ``.imag`` / ``torch.view_as_real`` / ``torch.view_as_complex`` as views of the local block.

    Placements and per-rank row counts are unchanged (``view_as_real`` appends an unsharded
    dim of 2, ``view_as_complex`` drops it); ``view_as_complex`` of a tensor sharded on its
    last dim goes to the DTensor fallback (which gathers it); ``Partial`` inputs too, as before.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.complex(torch.arange(6.0), torch.ones(6)).reshape(2, 3)
        >>> x_ft = shard_tensor(full, mesh, [Shard(1)], [2, 1])
        >>> re = x_ft.real                         # split 2/1 on dim 1, like x_ft
        >>> re.placements, torch.equal(re.to_local(), x_ft.to_local().real), re.to_local().shape[1] == [2, 1][rank]
        ((Shard(dim=1),), True, True)
    """
    x, *rest = args
    if not isinstance(x, ShardTensor) or rest or kwargs or is_partial(x):
        return fallback(func, args, kwargs)  # as before this plugin
    rows = _row_counts(x)
    if func is torch.view_as_complex and (x.ndim - 1) in rows:
        return fallback(func, args, kwargs)  # gathers the last dim: Replicate, right (checked on 2 ranks)
    return build_shard_tensor(func(x.to_local()), x._spec.mesh, x._spec.placements, rows)


@eager_handler
def flatten_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.flatten(start, end)`` / ``torch.flatten`` on the local block when only the group's first dim is sharded.

    Rows of the first dim stay contiguous in the flattened dim, so each rank's count is
    multiplied by the product of the other dims in the group (e.g. AFNO's patch embedding
    ``x.flatten(2)`` of ``(B, D, h, w)`` sharded on ``h``). Dims of size 1 in front of the
    sharded dim (batch 1) do not matter; a sharded dim behind dims holding more than one row
    (a batch of 2 flattened with ``h``) is refused, its rows would interleave across ranks.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = x.flatten(2)                       # (1, 4, 21): rows 5/2 become 15/6
        >>> y.placements, y.to_local().shape[2] == [15, 6][rank]
        ((Shard(dim=2),), True)
    """
    x, *rest = args
    start = kwargs.get("start_dim", rest[0] if rest else 0)
    end = kwargs.get("end_dim", rest[1] if len(rest) > 1 else -1)
    if not isinstance(x, ShardTensor) or is_partial(x):
        return fallback(func, args, kwargs)  # as before this plugin
    if x.ndim == 0:
        return from_local_like(func(x.to_local(), *rest, **kwargs), x)
    start, end = int(start) % x.ndim, int(end) % x.ndim
    rows = _row_counts(x)
    group = sorted(d for d in rows if start <= d <= end)
    head = group[0] if group else start
    lead = 1
    for d in range(start, head):
        lead *= x.shape[d]
    if lead != 1:
        raise MissingShardPatch(
            f"{describe_target(func)}({start}, {end}) of shape {tuple(x.shape)}: merges sharded dim {head} with "
            f"dims {list(range(start, head))} in front of it (sizes {tuple(x.shape[start:head])}); its rows would "
            "interleave across ranks (e.g. a batch of more than one sample per domain group)"
        )
    if group[1:]:
        # Two sharded dims in one group (an H- and W-sharded grid into points): DTensor can split
        # the points over one mesh dim only, so the inner dims are gathered first.
        x = gather_dims(x, group[1:])
        rows = _row_counts(x)
    factor = 1
    for d in range(head + 1, end + 1):
        factor *= x.shape[d]
    shift = end - start
    placements, sizes = list(x._spec.placements), {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % x.ndim
            new_d = d if d < start else start if d <= end else d - shift
            placements[m] = Shard(new_d)
            sizes[new_d] = tuple(n * factor for n in rows[d]) if d == head else rows[d]
    return build_shard_tensor(x.to_local().flatten(start, end), x._spec.mesh, placements, sizes)


@eager_handler
def unflatten_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.unflatten(dim, sizes)`` / ``torch.unflatten`` on the local block.

    A sharded ``dim`` splits into ``sizes`` with the first new dim sharded; every rank's row
    count must be a multiple of the product of the other new sizes (else refused).

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = x.flatten(2).unflatten(2, (7, 3))  # rows 15/6 back to 5/2
        >>> y.placements, y.to_local().shape[2] == [5, 2][rank]
        ((Shard(dim=2),), True)
    """
    x, *rest = args
    dim = kwargs.get("dim", rest[0] if rest else None)
    shape = kwargs.get("sizes", rest[1] if len(rest) > 1 else None)
    if not isinstance(x, ShardTensor) or is_partial(x):
        return fallback(func, args, kwargs)  # as before this plugin
    dim = int(dim) % x.ndim
    rows = _row_counts(x)
    new_shape = list(torch.empty(x.shape[dim], device="meta").unflatten(0, tuple(shape)).shape)
    inner = 1
    for n in new_shape[1:]:
        inner *= n
    if dim in rows and any(n % inner for n in rows[dim]):
        raise MissingShardPatch(
            f"{describe_target(func)}(dim={dim}, sizes={tuple(shape)}): rows per rank {rows[dim]} are not "
            f"multiples of {inner}; a rank boundary would fall inside the new inner dims"
        )
    grow = len(new_shape) - 1
    placements, sizes = list(x._spec.placements), {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % x.ndim
            new_d = d if d <= dim else d + grow
            placements[m] = Shard(new_d)
            sizes[new_d] = tuple(n // inner for n in rows[d]) if d == dim else rows[d]
    first = x.to_local().shape[dim] // inner if dim in rows else new_shape[0]  # explicit: a rank may hold 0 rows
    local = x.to_local().unflatten(dim, [first, *new_shape[1:]])
    return build_shard_tensor(local, x._spec.mesh, placements, sizes)


def _prefix_products(shape: Sequence[int]) -> list[int]:
    products, running = [1], 1
    for n in shape:
        running *= n
        products.append(running)
    return products


def _merged_sharded_dims(x: ShardTensor, new_shape: Sequence[int]) -> list[int]:
    """Sharded dims of ``x`` that a reshape to ``new_shape`` merges into an earlier sharded dim.

    Old dims ``a < b`` end up in one new dim unless the element offset at some boundary
    ``k`` in ``(a, b]`` is also a boundary of the new shape (equal prefix products).
    """
    old_products = _prefix_products(x.shape)
    new_boundaries = set(_prefix_products(new_shape))
    merged, previous = [], None
    for d in sorted(_row_counts(x)):
        if previous is not None and not any(old_products[k] in new_boundaries for k in range(previous + 1, d + 1)):
            merged.append(d)
        else:
            previous = d
    return merged


def gather_dims(x: ShardTensor, dims: Sequence[int]) -> ShardTensor:
    """``x`` with ``dims`` made whole: their mesh dims become ``Replicate`` (uneven shards included).

    Used where a layout op would interleave the rows of two sharded dims (flattening an H- and
    W-sharded grid into points): DTensor can express the points split over one mesh dim, not
    over two, so the inner dims are gathered first. Differentiable; the backward pass keeps
    this rank's rows (the gradient of the now replicated dims is replicated).

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> whole = gather_dims(x, [2])            # one all-gather with the true 5/2 sizes
        >>> whole.placements, tuple(whole.to_local().shape)
        ((Replicate(),), (1, 4, 7, 3))

        On a 2-D mesh (not run here), a grid sharded on H (mesh dim 0) and W (mesh dim 1):

        ```python
        points = gather_dims(grid, [3]).permute(0, 2, 3, 1).reshape(-1, channels)
        ```
    """
    placements = [Replicate() if isinstance(p, Shard) and p.dim % x.ndim in dims else p for p in x._spec.placements]
    return x.redistribute(x._spec.mesh, placements)


@eager_handler
def reshape_merging_sharded_dims(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``reshape``/``view`` that merges two sharded dims: gather the inner one first, then the built-in.

    Every other reshape goes to PhysicsNeMo's built-in handler unchanged.

    Examples:
        On a 2-D mesh (not run here: the doctests have a 1-D one), a grid ``(1, c, H, W)``
        sharded on H and W:

        ```python
        points = grid.permute(0, 2, 3, 1).reshape(-1, c)
        # points: (H*W, c), Shard(0) over the H mesh dim (rows H_i * W), Replicate over the W mesh dim
        ```
    """
    x, *rest = args
    if isinstance(x, ShardTensor) and not is_partial(x):
        shape = kwargs.get("shape", kwargs.get("size", rest[0] if len(rest) == 1 else rest))
        if isinstance(shape, int):
            shape = (shape,)
        try:
            new_shape = torch.empty(x.shape, device="meta").reshape(tuple(shape)).shape
        except (RuntimeError, TypeError):
            new_shape = None  # let the built-in report the bad shape
        try:
            merged = _merged_sharded_dims(x, new_shape) if new_shape is not None else []
        except MissingShardPatch:  # one dim sharded over several mesh dims: the built-in's business
            merged = []
        if new_shape is not None:
            _refuse_interleaving(func, x, new_shape, merged)
        if merged:
            args = (gather_dims(x, merged), *rest)
    return delegate(func, types, args, kwargs)


def _refuse_interleaving(func: Any, x: ShardTensor, new_shape: Sequence[int], merged: Sequence[int]) -> None:
    """Refuse a reshape that merges a sharded dim with dims in front of it holding more than one row.

    With ``B > 1`` samples, ``(B, H, C) -> (B*H, C)`` puts sample 0's rows of every rank first:
    rank 1's rows of sample 0 would sit in the middle of the merged dim, not after rank 0's
    rows of every sample, so no ``Shard`` of the merged dim describes the result (the
    built-in labels it ``Shard(0)`` anyway). Size-1 leading dims (batch 1) merge harmlessly.
    """
    try:
        rows = _row_counts(x)
    except MissingShardPatch:  # one dim sharded over several mesh dims: the built-in's business
        return
    old_products = _prefix_products(x.shape)
    new_boundaries = set(_prefix_products(new_shape))
    for d in sorted(rows):
        if d in merged or old_products[d] in new_boundaries:
            continue
        start = max(k for k in range(d + 1) if old_products[k] in new_boundaries)
        raise MissingShardPatch(
            f"{describe_target(func)}{tuple(x.shape)} -> {tuple(new_shape)}: merges sharded dim {d} with dims "
            f"{list(range(start, d))} in front of it (sizes {tuple(x.shape[start:d])}); each rank's rows would "
            "interleave across ranks in the merged dim (e.g. a batch of more than one sample per domain "
            "group). Move the sharded dim first (permute) or use one sample per domain group"
        )


def _row_counts(x: ShardTensor) -> dict[int, tuple[int, ...]]:
    return {d: layout.sizes for d, layout in sharded_dims(x).items()}


def _identical_shard_inputs(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], verb: str
) -> tuple[list[ShardTensor], int]:
    """The ``tensors`` and ``dim`` of a cat/stack call, refused unless every input is sharded identically."""
    tensors = list(kwargs.get("tensors", args[0] if args else ()))
    dim = int(kwargs.get("dim", args[1] if len(args) > 1 else 0))
    name = describe_target(func)
    if not tensors or not all(isinstance(t, ShardTensor) for t in tensors):
        raise MissingShardPatch(
            f"{name}: every input must be a ShardTensor (got {[type(t).__name__ for t in tensors]}; the DTensor "
            "fallback assumes even chunks and fails on uneven shards)"
        )
    first = tensors[0]
    placements = tuple(first._spec.placements)  # Partial inputs never get here: cat/stack delegate them
    rows = _row_counts(first)
    for t in tensors[1:]:
        if t._spec.mesh != first._spec.mesh or tuple(t._spec.placements) != placements or _row_counts(t) != rows:
            raise MissingShardPatch(
                f"{name}: inputs sharded differently ({tuple(t._spec.placements)} rows {_row_counts(t)} vs "
                f"{placements} rows {rows}); {verb} needs identical shards (the DTensor fallback assumes even "
                "chunks and fails on uneven shards)"
            )
    return tensors, dim


@eager_handler
def cat_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``torch.cat(tensors, dim)`` of identically sharded tensors along a dimension that is not sharded.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> z = cat_local(torch.cat, (), ([x, 2 * x], 1), {})
        >>> z.placements, tuple(z.to_local().shape) == [(1, 8, 5, 3), (1, 8, 2, 3)][rank]
        ((Shard(dim=2),), True)
    """
    tensors = list(kwargs.get("tensors", args[0] if args else ()))
    dim = int(kwargs.get("dim", args[1] if len(args) > 1 else 0))
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
            t if isinstance(t, ShardTensor)
            else _replicated_rows(_gathered(t), reference, func)
            for t in tensors
        ]
        args, kwargs = (tensors, dim), {}
    tensors, dim = _identical_shard_inputs(func, args, kwargs, "concatenation")
    first = tensors[0]
    dim %= first.ndim
    placements = tuple(first._spec.placements)
    if any(isinstance(p, Shard) and p.dim % first.ndim == dim for p in placements):
        # The fallback gathers the sharded dim: Replicate output, right on uneven shards (checked on 2 ranks).
        return delegate(func, types, args, kwargs)
    local = torch.cat([t.to_local() for t in tensors], dim=dim)
    return from_local_like(local, first)


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
        t._spec.mesh == first._spec.mesh and tuple(t._spec.placements) == tuple(first._spec.placements)
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
    if isinstance(value, DTensor) and not isinstance(value, ShardTensor) and not all(
        p.is_replicate() for p in value.placements
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
    new_placements = [Shard(p.dim % first.ndim + (p.dim % first.ndim >= dim)) if isinstance(p, Shard) else p
                      for p in first._spec.placements]
    sizes = {d + (d >= dim): n for d, n in _row_counts(first).items()}
    local = torch.stack([t.to_local() for t in tensors], dim=dim)
    return build_shard_tensor(local, first._spec.mesh, new_placements, sizes)


_TARGETS: tuple[tuple[Any, FunctionHandler, str], ...] = (
    (torch.Tensor.permute, permute_local, "permute the local block; Shard dims follow (no communication)"),
    (torch.permute, permute_local, "permute the local block; Shard dims follow (no communication)"),
    (torch.Tensor.transpose, transpose_local, "transpose the local block; Shard dims follow (no communication)"),
    (torch.transpose, transpose_local, "transpose the local block; Shard dims follow (no communication)"),
    (torch.Tensor.contiguous, clone_local, "contiguous local block, same shards (no communication)"),
    (torch.Tensor.clone, clone_local, "clone of the local block, same shards (no communication)"),
    (torch.clone, clone_local, "clone of the local block, same shards (no communication)"),
    (torch.cat, cat_local, "cat of identically sharded tensors along an unsharded dim (no communication)"),
    (torch.stack, stack_local, "stack of identically sharded tensors along a new dim (no communication)"),
    (torch.Tensor.flatten, flatten_local, "flatten with the sharded dim first of the group: local, rows scale"),
    (torch.flatten, flatten_local, "flatten with the sharded dim first of the group: local, rows scale"),
    (torch.Tensor.unflatten, unflatten_local, "unflatten of a dim; a sharded one keeps its first new dim sharded"),
    (torch.unflatten, unflatten_local, "unflatten of a dim; a sharded one keeps its first new dim sharded"),
    (torch.Tensor.real.__get__, complex_view_local, "x.real as a view of the local block, same shards"),
    (torch.Tensor.imag.__get__, complex_view_local, "x.imag as a view of the local block, same shards"),
    (torch.real, complex_view_local, "torch.real as a view of the local block, same shards"),
    (torch.imag, complex_view_local, "torch.imag as a view of the local block, same shards"),
    (torch.view_as_real, complex_view_local, "view_as_real of the local block; appended dim unsharded"),
    (torch.view_as_complex, complex_view_local, "view_as_complex of the local block; last dim must be unsharded"),
)



@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the local layout handlers, and the reshapes that merge two sharded dims (override)."""
    for target, handler, description in _TARGETS:
        patches.function(target, handler, description=description)
    for target in (torch.Tensor.reshape, torch.reshape, torch.Tensor.view):
        patches.function(target, reshape_merging_sharded_dims, override=True,
                         description="reshape merging two sharded dims: gather the inner one, then the built-in")
