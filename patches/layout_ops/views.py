"""Views and reshapes of uneven shards: the layout_ops family's ops that keep one tensor.

``permute`` / ``transpose`` / ``movedim`` / ``squeeze`` (each ``Shard(d)`` follows its dim),
``contiguous`` / ``clone`` and the ``*_like`` constructors (same shards), ``.real`` /
``.imag`` / ``view_as_real`` / ``view_as_complex`` (views of the local block), and
``flatten`` / ``unflatten`` / ``reshape`` / ``view`` that merge or split a sharded dim
(`reshape_sharded`, with `gather_dims` for a second sharded dim). The family's
declarations, and what it refuses, are in the package (``physicsnemo_shardext.patches.layout_ops``);
joins and splits (``cat``, ``stack``, ``split``, ``unbind``) in its ``joins`` module.

Examples:
    ``x`` of shape ``(1, 4, 7, 3)`` split 5 + 2 on dim 2, on 2 ranks:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
    >>> y = x.permute(0, 2, 1, 3).flatten(2)     # Shard(1) after the permute; the flatten keeps it
    >>> y.placements, y.to_local().shape[1] == [5, 2][rank]
    ((Shard(dim=1),), True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives import (
    DimLayout,
    aligned_split_sizes,
    balanced_split_sizes,
    bind_arguments,
    build_shard_tensor,
    delegate,
    delegate_when_traced,
    describe_target,
    eager_handler,
    fallback,
    from_local_like,
    is_partial,
    is_tracing,
    local_of,
    mesh_of,
    meta_output_shape,
    move_shard,
    placements_of,
    resplit_rows,
    sharded_dims,
)

__all__ = [
    "clone_local",
    "complex_view_local",
    "flatten_local",
    "gather_dims",
    "like_local",
    "movedim_local",
    "permute_local",
    "reshape_merging_sharded_dims",
    "reshape_sharded",
    "squeeze_local",
    "transpose_local",
    "unflatten_local",
]


def _moved(x: ShardTensor, local: torch.Tensor, order: Sequence[int]) -> ShardTensor:
    """Wrap ``local`` (``x``'s block with dims reordered: new dim i is old dim ``order[i]``)."""
    new_index = {old: new for new, old in enumerate(order)}
    placements = [Shard(new_index[p.dim % x.ndim]) if isinstance(p, Shard) else p for p in placements_of(x)]
    sizes = {new_index[d]: layout.sizes for d, layout in sharded_dims(x).items()}
    return build_shard_tensor(local, mesh_of(x), placements, sizes)


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
    return _moved(x, local_of(x).permute(order), order)


def _squeeze(input: Any, dim: Any = None) -> None:
    """Mirror of ``torch.squeeze``'s parameters (a C builtin without an introspectable signature)."""


@eager_handler
def squeeze_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``x.squeeze(dim)`` / ``torch.squeeze(x)`` on the local block: the dims of global size 1 go, shards follow.

    The dims are chosen from the *global* shape and passed to the local squeeze
    explicitly: an uneven split can leave a rank one row (or none) on a sharded dim,
    which a bare local ``squeeze()`` would drop too. The DTensor fallback infers the
    output's split as ``torch.chunk``'s and raises a shape error on any other split
    (DLWP's ``torch.squeeze(face, dim=2)`` of a 5/3 split). A sharded dim of global
    size 1 is delegated.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(21.0).reshape(1, 3, 1, 7), mesh, [Shard(3)], [6, 1])
        >>> y = squeeze_local(torch.squeeze, (), (x,), {})
        >>> y.placements, tuple(y.to_local().shape) == [(3, 6), (3, 1)][rank]
        ((Shard(dim=1),), True)
    """
    bound = bind_arguments(_squeeze, args, kwargs)
    x, dim = bound["input"], bound["dim"]
    if not isinstance(x, ShardTensor) or is_partial(x) or x.ndim == 0:
        return delegate(func, types, args, kwargs)
    asked = range(x.ndim) if dim is None else (dim if isinstance(dim, (tuple, list)) else (dim,))
    dims = sorted({int(d) % x.ndim for d in asked if x.shape[int(d) % x.ndim] == 1})
    if set(dims) & set(sharded_dims(x)):
        return delegate(func, types, args, kwargs)
    order = [d for d in range(x.ndim) if d not in dims]
    return _moved(x, local_of(x).squeeze(tuple(dims)) if dims else local_of(x).view_as(local_of(x)), order)


@eager_handler
def transpose_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.transpose(d0, d1)`` / ``torch.transpose(x, d0, d1)`` on the local block.

    Its aliases ``swapdims(dim0, dim1)`` and ``swapaxes(axis0, axis1)`` (function and method) reach it too.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = transpose_local(torch.transpose, (), (x, 2, 3), {})
        >>> y.placements, y.to_local().shape[3] == [5, 2][rank]
        ((Shard(dim=3),), True)
    """
    x, *rest = args
    d0 = kwargs.get("dim0", kwargs.get("axis0", rest[0] if rest else None))
    d1 = kwargs.get("dim1", kwargs.get("axis1", rest[1] if len(rest) > 1 else None))
    d0, d1 = int(d0) % x.ndim, int(d1) % x.ndim
    order = list(range(x.ndim))
    order[d0], order[d1] = d1, d0
    return _moved(x, local_of(x).transpose(d0, d1), order)


@eager_handler
def movedim_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.movedim(source, destination)`` / ``torch.movedim`` (and their alias ``moveaxis``) on the local block.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = movedim_local(torch.moveaxis, (), (x, 2, 0), {})
        >>> y.placements, y.to_local().shape[0] == [5, 2][rank]
        ((Shard(dim=0),), True)
    """
    x, *rest = args
    source = kwargs.get("source", rest[0] if rest else None)
    destination = kwargs.get("destination", rest[1] if len(rest) > 1 else None)
    sources = [int(d) % x.ndim for d in ([source] if isinstance(source, int) else source)]
    destinations = [int(d) % x.ndim for d in ([destination] if isinstance(destination, int) else destination)]
    if (
        len(sources) != len(destinations)
        or len(set(sources)) != len(sources)
        or len(set(destinations)) != len(destinations)
    ):
        return delegate(func, types, args, kwargs)  # torch's own error
    order: list[int | None] = [None] * x.ndim
    for old, new in zip(sources, destinations):
        order[new] = old
    rest_dims = iter(d for d in range(x.ndim) if d not in sources)
    full = [d if d is not None else next(rest_dims) for d in order]
    return _moved(x, local_of(x).permute(full), full)


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
    return from_local_like(func(local_of(x), *rest, **kwargs), x)


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
    return build_shard_tensor(func(local_of(x)), mesh_of(x), placements_of(x), rows)


@eager_handler
def flatten_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.flatten(start, end)`` / ``torch.flatten``: a reshape merging dims ``start..end`` (see `reshape_sharded`).

    With the group's first non-unit dim sharded (AFNO's patch embedding ``x.flatten(2)`` of
    ``(B, D, h, w)`` sharded on ``h``), the flatten is local and each rank's row count is
    multiplied by the product of the other dims. With a dim in front of the sharded one
    holding more than one row (ViT's ``x.flatten(2)`` sharded on ``W``), the shard is first
    moved to that dim (`move_shard`, one all-to-all); a batch dim 0 of more than one
    sample in front of it is refused (samples would interleave).

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = x.flatten(2)                       # (1, 4, 21): rows 5/2 become 15/6
        >>> y.placements, y.to_local().shape[2] == [15, 6][rank]
        ((Shard(dim=2),), True)

        Sharded on W (5/1): the shard moves to H first (one all-to-all; H split 3/1 like W's
        5/6 and 1/6 shares), then the tokens are 18/6:

        >>> full = torch.arange(48.0).reshape(1, 2, 4, 6)
        >>> tokens = shard_tensor(full, mesh, [Shard(3)], [5, 1]).flatten(2).transpose(1, 2)
        >>> tokens.placements, tokens.to_local().shape[1] == [18, 6][rank]
        ((Shard(dim=1),), True)
        >>> torch.equal(tokens.full_tensor(), full.flatten(2).mT)
        True
    """
    x, *rest = args
    start = kwargs.get("start_dim", rest[0] if rest else 0)
    end = kwargs.get("end_dim", rest[1] if len(rest) > 1 else -1)
    if not isinstance(x, ShardTensor) or is_partial(x):
        return fallback(func, args, kwargs)  # as before this plugin
    if x.ndim == 0:
        return from_local_like(func(local_of(x), *rest, **kwargs), x)
    new_shape = tuple(meta_output_shape(torch.flatten, (x, int(start), int(end))))
    if not _reshapable(x, new_shape):
        return fallback(func, args, kwargs)  # zero-size dims: as before this plugin
    return reshape_sharded(func, x, new_shape)


@eager_handler
def unflatten_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``x.unflatten(dim, sizes)`` / ``torch.unflatten``: a reshape splitting ``dim`` (see `reshape_sharded`).

    A sharded ``dim`` splits into ``sizes`` with the first new dim of more than one row
    sharded. Rank boundaries must fall on multiples of the product of the new dims behind
    it; where they do not (tokens split 25/23 unflattened into an ``8 x 6`` grid), the
    rows are re-split to the nearest multiples first (`resplit_rows`: only the rows
    between old and new boundaries travel).

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(84.0).reshape(1, 4, 7, 3), mesh, [Shard(2)], [5, 2])
        >>> y = x.flatten(2).unflatten(2, (7, 3))  # rows 15/6 back to 5/2
        >>> y.placements, y.to_local().shape[2] == [5, 2][rank]
        ((Shard(dim=2),), True)
        >>> t = shard_tensor(torch.arange(144.0).reshape(1, 3, 48), mesh, [Shard(2)], [25, 23])
        >>> grid = t.unflatten(2, (8, 6))          # boundary 25 -> 24: one token moves, rows 4/4
        >>> expected = t.full_tensor().unflatten(2, (8, 6))
        >>> grid.placements, grid.to_local().shape[2], torch.equal(grid.full_tensor(), expected)
        ((Shard(dim=2),), 4, True)
    """
    x, *rest = args
    dim = kwargs.get("dim", rest[0] if rest else None)
    shape = kwargs.get("sizes", rest[1] if len(rest) > 1 else None)
    if not isinstance(x, ShardTensor) or is_partial(x):
        return fallback(func, args, kwargs)  # as before this plugin
    dim = int(dim) % x.ndim
    new_shape = tuple(meta_output_shape(torch.unflatten, (x, dim, tuple(shape))))
    if not _reshapable(x, new_shape):
        return fallback(func, args, kwargs)  # zero-size dims: as before this plugin
    return reshape_sharded(func, x, new_shape)


def _prod(sizes: Iterable[int]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _view_groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pair the dims of two shapes (sizes >= 1, equal numel) into groups of equal products, in order.

    Each group holds at least one dim of each shape: old dims ``o`` become new dims ``n``, a
    contiguous range of elements either way. Trailing unit dims join the group before them.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) or j < len(new):
        o: list[int] = []
        n: list[int] = []
        po = pn = 1
        if i < len(old):
            o.append(i)
            po *= old[i]
            i += 1
        if j < len(new):
            n.append(j)
            pn *= new[j]
            j += 1
        while po != pn:  # equal totals: the smaller side always has a dim left
            if po < pn:
                o.append(i)
                po *= old[i]
                i += 1
            else:
                n.append(j)
                pn *= new[j]
                j += 1
        if groups and (not o or not n):
            groups[-1][0].extend(o)
            groups[-1][1].extend(n)
        else:
            groups.append((o, n))
    return [(tuple(o), tuple(n)) for o, n in groups]


def _proportional_sizes(total: int, weights: Sequence[int]) -> tuple[int, ...]:
    """``total`` rows split in proportion to ``weights`` (largest remainders, ties to the lower coordinate).

    Where a shard moves from one dim to another, each rank keeps its share of the tensor
    (its load), and the bytes moved, ``sum_r local_r * (1 - share_r)``, are no more than an
    even split's (up to rounding); an empty shard stays empty and sends nothing.
    """
    weight = sum(weights)
    if weight == 0:
        return balanced_split_sizes(total, len(weights))
    sizes = [total * w // weight for w in weights]
    remainders = sorted(range(len(weights)), key=lambda c: (-(total * weights[c] % weight), c))
    for c in remainders[: total - sum(sizes)]:
        sizes[c] += 1
    return tuple(sizes)


def _reshapable(x: ShardTensor, new_shape: Sequence[int]) -> bool:
    """Whether `reshape_sharded` takes ``x -> new_shape``: Shard/Replicate placements, no zero-size or 0-d shape."""
    if x.ndim == 0 or len(new_shape) == 0 or 0 in tuple(x.shape) or 0 in tuple(new_shape):
        return False
    if not all(isinstance(p, (Shard, Replicate)) for p in placements_of(x)):
        return False
    try:
        sharded_dims(x)
    except MissingShardPatch:  # one dim sharded over several mesh dims
        return False
    return True


def reshape_sharded(func: Any, x: ShardTensor, new_shape: Sequence[int]) -> ShardTensor:
    """``x`` reshaped to ``new_shape`` (resolved, same numel), every sharded dim carried to the output.

    The dims are paired into groups (old dims -> new dims of equal product). In each group
    holding a sharded dim:

    1. further sharded dims of the group (an H- and W-sharded grid into points) are
       gathered (`gather_dims`, one all-gather): the points can be split over one mesh dim only;
    2. if dims of more than one row precede the sharded dim in the group, the shard moves to
       the first of them (`move_shard`, one all-to-all; its rows in proportion to the sharded
       dim's split, so each rank keeps its share and an empty shard sends nothing): then each
       rank's elements of the group are one contiguous range. That first dim being dim 0 (a batch
       of more than one sample) is refused: samples' rows would interleave;
    3. the group's output is sharded on its first new dim ``g`` of more than one row; the
       rank boundaries must be multiples of the product ``k`` of the new dims behind ``g``,
       else the elements are re-split to the nearest multiples (`resplit_rows`: only the
       elements between old and new boundaries travel, at most ``k // 2`` per boundary);
    4. the local block is reshaped; no communication in any other case.

    Examples:
        Swin's window partition of ``(1, 8, 6, C)`` split 5/3 on H into 2 x 2 windows: the
        boundary 5 moves to 4 (rank 0 sends one image row), then 6 windows per rank:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(96.0).reshape(1, 8, 6, 2)
        >>> x = shard_tensor(full, mesh, [Shard(1)], [5, 3])
        >>> windows = x.view(1, 4, 2, 3, 2, 2).permute(0, 1, 3, 2, 4, 5).reshape(-1, 2, 2, 2)
        >>> windows.placements, windows.to_local().shape[0]
        ((Shard(dim=0),), 6)
        >>> back = windows.view(1, 4, 3, 2, 2, 2).permute(0, 1, 3, 2, 4, 5).reshape(1, 8, 6, 2)
        >>> back.placements, back.to_local().shape[1], torch.equal(back.full_tensor(), full)
        ((Shard(dim=1),), 4, True)
    """
    new_shape = tuple(int(n) for n in new_shape)
    groups = _view_groups(tuple(x.shape), new_shape)
    layouts = sharded_dims(x)
    # plan (no communication): what to gather, where each group's shard moves, what is refused
    gathered: list[int] = []
    moves: list[tuple[int, int]] = []
    for old, _ in groups:
        sharded = [d for d in old if d in layouts]
        if not sharded:
            continue
        gathered += sharded[1:]
        head = sharded[0]
        front = [d for d in old if d < head and x.shape[d] != 1]
        if front and front[0] == 0:
            before = list(range(old[0], head))
            raise MissingShardPatch(
                f"{describe_target(func)}{tuple(x.shape)} -> {tuple(new_shape)}: merges sharded dim {head} with dims "
                f"{before} in front of it (sizes {tuple(x.shape[old[0] : head])}); each rank's rows would interleave "
                f"across ranks in the merged dim (dim 0 holds {x.shape[0]} samples: a batch of more than one sample "
                "per domain group, e.g. FNO's decoder or Swin's window partition with B > 1). Use one sample per "
                "domain group, or move the sharded dim first (permute)"
            )
        if front:
            moves.append((head, front[0]))
    if gathered:
        x = gather_dims(x, gathered)
        layouts = sharded_dims(x)
    local = local_of(x)
    for src, dst in moves:
        layout = layouts.pop(src)
        sizes = _proportional_sizes(x.shape[dst], layout.sizes)
        local = move_shard(local, layout, dst, sizes)
        layouts[dst] = DimLayout(dst, layout.mesh_dim, sizes, layout.coord, layout.mesh)
    # each group as one dim: a sharded group's elements form one contiguous range per rank
    blocks = local.reshape([_prod(local.shape[d] for d in old) for old, _ in groups])
    placements = list(placements_of(x))
    sizes_by_dim: dict[int, tuple[int, ...]] = {}
    local_shape: list[int] = []
    for i, (old, new) in enumerate(groups):
        sharded = [d for d in old if d in layouts]
        if not sharded:
            local_shape += [new_shape[j] for j in new]
            continue
        layout = layouts[sharded[0]]
        inner = _prod(x.shape[d] for d in old if d > layout.tensor_dim)
        elements = tuple(n * inner for n in layout.sizes)
        g = next((j for j in new if new_shape[j] != 1), new[0])
        k = _prod(new_shape[j] for j in new if j > g)
        if any(offset % k for offset in DimLayout(i, layout.mesh_dim, elements, layout.coord, None).offsets):
            aligned = aligned_split_sizes(elements, k)
            blocks = resplit_rows(blocks, DimLayout(i, layout.mesh_dim, elements, layout.coord, layout.mesh), aligned)
            elements = aligned
        rows = tuple(n // k for n in elements)
        placements[layout.mesh_dim] = Shard(g)
        sizes_by_dim[g] = rows
        local_shape += [rows[layout.coord] if j == g else new_shape[j] for j in new]
    return build_shard_tensor(blocks.reshape(local_shape), mesh_of(x), placements, sizes_by_dim)


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
    placements = [Replicate() if isinstance(p, Shard) and p.dim % x.ndim in dims else p for p in placements_of(x)]
    return x.redistribute(mesh_of(x), placements)


@eager_handler
def reshape_merging_sharded_dims(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``reshape``/``view`` that merges or splits a sharded dim: `reshape_sharded`; the rest goes to the built-in.

    Taken here: a ShardTensor (Shard/Replicate placements) whose sharded dim is merged with
    other dims or split into several (tokens <-> grid, windows, points). Delegated to
    PhysicsNeMo's built-in: reshapes that keep every sharded dim as it is, ``Partial``
    inputs, ``view(dtype)``, nested sharding of one dim, zero-size dims and invalid shapes
    (torch's error comes back).

    Examples:
        Tokens ``(1, 48, C)`` split 25/23 back to a grid ``(1, 8, 6, C)``: the boundary moves to
        24 (rank 0 sends one token), H is split 4/4:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> t = shard_tensor(torch.arange(96.0).reshape(1, 48, 2), mesh, [Shard(1)], [25, 23])
        >>> grid = t.reshape(1, 8, 6, 2)
        >>> expected = t.full_tensor().reshape(1, 8, 6, 2)
        >>> grid.placements, grid.to_local().shape[1], torch.equal(grid.full_tensor(), expected)
        ((Shard(dim=1),), 4, True)

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
            new_shape = tuple(meta_output_shape(torch.reshape, (x, tuple(shape))))
        except (RuntimeError, TypeError):
            new_shape = None  # view(dtype), a bad shape: the built-in's business
        if new_shape is not None and _reshapable(x, new_shape):
            layouts = sharded_dims(x)
            groups = _view_groups(tuple(x.shape), new_shape)
            if any(len(old) + len(new) > 2 for old, new in groups if set(old) & layouts.keys()):
                return reshape_sharded(func, x, new_shape)
            if is_tracing((x,)):
                return _view_keeping_shards(func, x, new_shape, groups)
    return delegate(func, types, args, kwargs)


def _view_keeping_shards(
    func: Callable[..., Any], x: ShardTensor, new_shape: tuple[int, ...], groups: list[Any]
) -> ShardTensor:
    """A reshape/view that keeps every sharded dim whole, as a view of the local block (no exchange).

    Traced calls take it instead of PhysicsNeMo's built-in, which is not traced; the
    sizes are those of the eager result (each sharded dim keeps its rows per coordinate).
    """
    layouts = sharded_dims(x)
    moved = {old[0]: new[0] for old, new in groups if old and old[0] in layouts}
    local = local_of(x)
    local_shape = list(new_shape)
    for old_dim, new_dim in moved.items():
        local_shape[new_dim] = local.shape[old_dim]
    placements = [Shard(moved[p.dim]) if isinstance(p, Shard) else p for p in placements_of(x)]
    return build_shard_tensor(
        func(local, local_shape),
        mesh_of(x),
        placements,
        {new_dim: layouts[old_dim].sizes for old_dim, new_dim in moved.items()},
    )


def _row_counts(x: ShardTensor) -> dict[int, tuple[int, ...]]:
    return {d: layout.sizes for d, layout in sharded_dims(x).items()}


@eager_handler
def like_local(func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``zeros_like`` / ``ones_like`` / ``empty_like`` / ``full_like`` of a ShardTensor: the same shards, locally.

    Any ``dtype`` included: ``nn.MultiheadAttention`` turns a bool padding mask into a float one
    with ``torch.zeros_like(mask, dtype=...)``, which the fallback re-cut evenly on uneven splits.
    A ``Partial`` input keeps the fallback.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> mask = shard_tensor(torch.tensor([[True, False, True, True, False]]), mesh, [Shard(1)], [4, 1])
        >>> z = torch.zeros_like(mask, dtype=torch.float32)
        >>> z.placements, z.dtype, z.to_local().shape[1] == [4, 1][rank]
        ((Shard(dim=1),), torch.float32, True)
    """
    x, *rest = args
    if not isinstance(x, ShardTensor) or is_partial(x):
        return fallback(func, args, kwargs)  # as before this plugin
    return from_local_like(func(local_of(x), *rest, **kwargs), x)
