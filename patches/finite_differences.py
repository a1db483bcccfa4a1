"""torch.gradient and torch.diff along sharded dims, by halo exchange.

Without these patches the calls go through the DTensor fallback (an all-gather
of the activation; its backward fails on torch 2.14). Here each rank fetches
only the rows its stencil needs from other ranks
(`gather_global_indices`, which also
reaches past a neighbour whose shard is thinner than the halo), runs the torch
op on its extended block and keeps its own rows.

``torch.gradient`` (``spacing`` a scalar, a list of scalars or a list of 1-D
coordinate tensors; ``dim`` None, an int or a tuple; ``edge_order`` 1 or 2):
halo of one row on each side, widened at the global edges to the
``edge_order + 1`` rows of the one-sided formula. Every output keeps the
input's placements and shard sizes.

``torch.diff`` (any ``n``, ``prepend``/``append``, ``dim``): along a sharded dim
the output is ``n`` rows shorter. **Which ranks lose rows:** the ``prepend`` rows
count as the first coordinate's and the ``append`` rows as the last
coordinate's; output row ``j`` (``= sum_k c_k z[j + k]`` over the concatenation
``z``) belongs to the owner of ``z[j]``, so the last ``n`` rows of ``z`` start
no output row: the trailing coordinate(s) lose ``n`` rows in all (possibly
emptying thin shards), and each rank needs a halo of ``n`` rows *after* its
shard. Example: sizes 5/2, ``n=1`` -> output sizes 5/1; sizes 5/1, ``n=2``
-> 4/0.

Delegated (to the DTensor fallback, which gathers the input; forward and
gradients checked on 2 ranks against a single process): ``Partial`` inputs
(linear stencils; the result stays ``Partial(sum)``), plain coordinate tensors
that require grad, and ``prepend``/``append`` given as ShardTensors that are
``Replicate`` or sharded on the diff dim only, next to an input sharded on the
diff dim only (or replicated, or ``Partial``): even and uneven splits; sharded
on other dims too where every shard holds ``torch.chunk``'s rows; coordinate
tensors in ``spacing`` given as ``Replicate`` ShardTensors or as 1-D ``Shard(0)``
ShardTensors split exactly like the input's dim they belong to.

Refused (``MissingShardPatch``): ``prepend``/``append`` as ShardTensors sharded
on another dim, or next to an input sharded on another dim, unless every shard
holds ``torch.chunk``'s rows (DTensor's own layout, where the fallback is right);
measured on other splits (6/1, 7/0): the fallback raises "Sizes of tensors must
match", and with an input that requires grad one rank raises while the other
hangs; coordinate tensors that are plain DTensors, or ShardTensors other than
the delegated ones (not yet measured against the fallback); also not yet measured:
plain ``prepend``/``append`` that require grad while ShardTensor's promotion of
plain tensors is disabled, spacing of another type; non-int dims are refused
because the fallback fails too (torch itself raises ``TypeError`` for a named dim).

Examples:
    On 2 ranks, ``x`` of shape (4, 17) sharded ``Shard(1)`` 10/7:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(0, 1, 4 * 17).reshape(4, 17) ** 2
    >>> x = shard_tensor(full, mesh, [Shard(1)], [10, 7])
    >>> gx, gy = torch.gradient(x, spacing=0.5, edge_order=2)   # both Shard(1), 10/7
    >>> tuple(gy.to_local().shape) == [(4, 10), (4, 7)][rank]
    True
    >>> all(torch.allclose(g.full_tensor(), e) for g, e in zip((gx, gy), torch.gradient(full, spacing=0.5, edge_order=2)))
    True
    >>> d = torch.diff(x, n=2, dim=1)                           # the last rank loses the 2 rows: 10/5
    >>> tuple(d.to_local().shape) == [(4, 10), (4, 5)][rank]
    True
    >>> torch.allclose(d.full_tensor(), torch.diff(full, n=2, dim=1))
    True
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Partial, Replicate

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    delegate,
    describe_target,
    eager_handler,
    from_local_like,
    gather_global_indices,
    is_partial,
    local_of,
    mesh_of,
    meta_output_shape,
    normalize_dim,
    placements_of,
    require_shard_input,
    sharded_dims,
)

__all__ = ["diff_output_sizes", "sharded_diff", "sharded_gradient"]


def _local_block(full: torch.Tensor, layouts: dict[int, DimLayout], skip: int) -> torch.Tensor:
    """This rank's block of a replicated ``full`` tensor along every sharded dim except ``skip``."""
    for d, layout in layouts.items():
        if d != skip:
            full = full.narrow(d, layout.start, layout.local_size)
    return full


# Mirrors of torch's C builtins (no introspectable signature), for ``bind_arguments``.
def _gradient(input: Any, *, spacing: Any = None, dim: Any = None, edge_order: int = 1) -> None:
    """``torch.gradient`` (``spacing=None`` stands for torch's default of 1 per dim)."""


def _diff(input: Any, n: int = 1, dim: int = -1, prepend: Any = None, append: Any = None) -> None:
    """``torch.diff``/``Tensor.diff``."""


def _has_grad_coordinates(spacing: Any) -> bool:
    """Plain coordinate tensors that require grad: the DTensor fallback differentiates them right."""
    items = spacing if isinstance(spacing, (list, tuple)) else [spacing]
    return torch.is_grad_enabled() and any(
        isinstance(s, torch.Tensor) and not isinstance(s, DTensor) and s.requires_grad for s in items
    )


def _holds_torch_chunks(t: ShardTensor) -> bool:
    """Whether every sharded dim of ``t`` holds ``torch.chunk``'s rows, none empty (DTensor's own layout)."""
    for layout in sharded_dims(t).values():
        if list(layout.sizes) != [len(c) for c in torch.arange(layout.total).chunk(layout.parts)]:
            return False
    return True


def _fallback_takes_extras(x: Any, dim: Any, extras: Sequence[ShardTensor]) -> bool:
    """Whether the DTensor fallback runs ``torch.diff`` right with these ShardTensor prepend/append.

    Measured on 2 ranks (forward and gradients, even and uneven splits): right when no tensor
    (``x`` or an extra) is sharded on a dim other than ``dim`` (``x`` may also be ``Partial``);
    with a shard on another dim, right only where every shard holds ``torch.chunk``'s rows
    (DTensor's own layout), else it raises, or one rank raises while the other hangs.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or not isinstance(x, torch.Tensor):
        return False
    d = dim % max(x.ndim, 1)
    if any(e.ndim != x.ndim or is_partial(e) for e in extras):
        return False
    sharded = [t for t in (x, *extras) if isinstance(t, ShardTensor)]
    off_dim = any(p.is_shard() and p.dim % t.ndim != d for t in sharded for p in t.placements)
    return not off_dim or all(_holds_torch_chunks(t) for t in sharded)


def _fallback_takes_coordinates(x: Any, spacing: Any, dim: Any) -> bool:
    """Whether ``spacing`` holds ShardTensor coordinates the DTensor fallback was measured right for.

    Measured on 2 ranks (forward and gradients, splits 4/3, 6/1, 7/0): ``Replicate`` ShardTensor
    coordinates, and 1-D ``Shard(0)`` ones split exactly like the input's dim they belong to.
    """
    if not isinstance(x, ShardTensor) or not isinstance(spacing, (list, tuple)):
        return False
    items = list(spacing)
    if not any(isinstance(s, ShardTensor) for s in items) or any(isinstance(s, DTensor) for s in items):
        return False  # no ShardTensor coordinates, or plain DTensor ones (not measured)
    dims = list(range(x.ndim)) if dim is None else list(dim) if isinstance(dim, (list, tuple)) else [dim]
    if len(dims) != len(items) or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        return False
    try:
        layouts = sharded_dims(x)
        for d, coords in zip(dims, items):
            if not isinstance(coords, ShardTensor) or all(p.is_replicate() for p in coords.placements):
                continue
            layout, own = layouts.get(d % x.ndim), sharded_dims(coords)
            if coords.ndim != 1 or layout is None or set(own) != {0} or mesh_of(coords) != mesh_of(x):
                return False
            if (own[0].mesh_dim, own[0].sizes) != (layout.mesh_dim, layout.sizes) or is_partial(coords):
                return False
    except MissingShardPatch:  # a dim sharded over several mesh dims
        return False
    return True


# -- torch.gradient ------------------------------------------------------------------------


def _gradient_halo(layout: DimLayout, coord: int, edge_order: int) -> range:
    """Global rows coordinate ``coord`` needs: its shard, one row each side, the edge stencil at the ends."""
    start, stop, n = layout.offsets[coord], layout.offsets[coord] + layout.sizes[coord], layout.total
    if start == stop:
        return range(0)
    lo, hi = max(0, start - 1), min(n, stop + 1)
    if start == 0:
        hi = max(hi, min(n, edge_order + 1))
    if stop == n:
        lo = min(lo, max(0, n - edge_order - 1))
    return range(lo, hi)


def _spacing_per_dim(func: Callable[..., Any], spacing: Any, dims: Sequence[int]) -> list[Any]:
    """One spacing per differentiated dim: a number or a 1-D coordinate tensor."""
    if spacing is None:
        return [1.0] * len(dims)
    if isinstance(spacing, numbers.Number):
        return [spacing] * len(dims)
    if isinstance(spacing, (list, tuple)):
        items = list(spacing)
        for item in items:
            if isinstance(item, (ShardTensor, DTensor)):
                raise MissingShardPatch(
                    f"{describe_target(func)}: coordinate tensors in spacing as DTensors, or as ShardTensors "
                    "other than Replicate ones or 1-D Shard(0) ones split like the input's dim, are not supported "
                    "(the DTensor fallback is not measured for them); pass plain 1-D coordinate tensors "
                    "(identical on every rank)"
                )
            if isinstance(item, torch.Tensor) and item.requires_grad and torch.is_grad_enabled():
                raise MissingShardPatch(
                    f"{describe_target(func)}: coordinate tensors that require grad are not supported on "
                    "ShardTensor (their gradient would be split over ranks)"
                )
        if len(items) == 1 and len(dims) > 1 and isinstance(items[0], numbers.Number):
            return items * len(dims)
        return items
    raise MissingShardPatch(f"{describe_target(func)}: spacing of type {type(spacing).__name__} is not supported")


def _validate_gradient(x: ShardTensor, spacing: Any, dim: Any, edge_order: int) -> None:
    """Raise what torch would raise, on every rank and before any communication (cached per configuration)."""
    kwargs: dict[str, Any] = {"edge_order": edge_order}
    if spacing is not None:
        kwargs["spacing"] = spacing
    if dim is not None:
        kwargs["dim"] = dim
    meta_output_shape(torch.gradient, (x,), kwargs)


@eager_handler
def sharded_gradient(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """torch.gradient of a ShardTensor; every output keeps the input's placements and shard sizes.

    Examples:
        Plain coordinates (identical on every rank) along a dim split 1/3 on 2 ranks:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full, coords = torch.arange(4.0) ** 2, torch.tensor([0.0, 1.0, 3.0, 4.0])
        >>> (g,) = torch.gradient(shard_tensor(full, mesh, [Shard(0)], [1, 3]), spacing=[coords])
        >>> torch.allclose(g.full_tensor(), torch.gradient(full, spacing=[coords])[0])
        True
    """
    bound = bind_arguments(_gradient, args, kwargs)
    x, spacing, dim, edge_order = bound["input"], bound["spacing"], bound["dim"], bound["edge_order"]
    # Only a *ShardTensor* Partial input is delegated: a plain DTensor input (next to ShardTensor
    # coordinates) is refused below, as it always was.
    partial = isinstance(x, ShardTensor) and is_partial(x)
    if partial or _has_grad_coordinates(spacing) or _fallback_takes_coordinates(x, spacing, dim):
        return delegate(func, types, args, kwargs)
    x = require_shard_input(func, x)
    if dim is None:
        dims = list(range(x.ndim))
    else:
        dims = [normalize_dim(func, d, x.ndim) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    per_dim = _spacing_per_dim(func, spacing, dims)
    _validate_gradient(x, spacing, dim, edge_order)

    layouts = sharded_dims(x)
    local = local_of(x)
    outputs = []
    for d, step in zip(dims, per_dim):
        layout = layouts.get(d)
        if layout is None:
            (grad,) = torch.gradient(local, spacing=[step], dim=d, edge_order=edge_order)
            outputs.append(from_local_like(grad, x))
            continue
        rows = _gradient_halo(layout, layout.coord, edge_order)
        padded = gather_global_indices(local, layout, lambda c, lay=layout: _gradient_halo(lay, c, edge_order))
        if layout.local_size == 0:
            grad = padded.to(torch.result_type(local, 1.0))  # an empty block of the output dtype
        else:
            if isinstance(step, torch.Tensor):
                step = step[rows.start : rows.stop]
            (grad,) = torch.gradient(padded, spacing=[step], dim=d, edge_order=edge_order)
            grad = grad.narrow(d, layout.start - rows.start, layout.local_size)
        outputs.append(from_local_like(grad, x))
    return tuple(outputs)


# -- torch.diff ----------------------------------------------------------------------------


def diff_output_sizes(sizes: Sequence[int], n: int, prepend_rows: int = 0, append_rows: int = 0) -> list[int]:
    """Rows per coordinate of ``torch.diff``'s output: prepend/append join the end coordinates, the tail loses ``n``.

    Examples:
        >>> diff_output_sizes([5, 2], 1), diff_output_sizes([5, 1], 2), diff_output_sizes([0, 3, 0], 1, 2, 1)
        ([5, 1], [4, 0], [2, 3, 0])
    """
    extended = list(sizes)
    extended[0] += prepend_rows
    extended[-1] += append_rows
    remove = n
    for coord in range(len(extended) - 1, -1, -1):
        taken = min(remove, extended[coord])
        extended[coord] -= taken
        remove -= taken
    return extended


def _extra_rows(
    func: Callable[..., Any], name: str, extra: Any, x: ShardTensor, dim: int, layouts: dict[int, DimLayout]
) -> torch.Tensor | None:
    """This rank's block (along the other sharded dims) of a prepend/append tensor, differentiable."""
    if extra is None:
        return None
    if isinstance(extra, ShardTensor):
        raise MissingShardPatch(
            f"{describe_target(func)}: {name} as a ShardTensor is not supported; pass a plain tensor "
            "(identical on every rank)"
        )
    if isinstance(extra, DTensor):
        # A plain tensor that ShardTensor promoted to Replicate. Along every mesh dim that shards x,
        # each rank uses a different part of it (or none), so its gradient is a partial sum there,
        # which the promotion's bridge all-reduces in backward; along the other mesh dims it is replicated.
        if not all(p.is_replicate() for p in extra.placements) or extra.device_mesh != mesh_of(x):
            raise MissingShardPatch(
                f"{describe_target(func)}: {name} with placements {extra.placements} on another mesh or sharded"
            )
        grad_placements = [Partial() if p.is_shard() else Replicate() for p in placements_of(x)]
        full = extra.to_local(grad_placements=grad_placements)
    elif isinstance(extra, torch.Tensor):
        if extra.requires_grad and torch.is_grad_enabled() and layouts:
            raise MissingShardPatch(
                f"{describe_target(func)}: a plain {name} that requires grad, with ShardTensor's promotion of "
                "plain tensors disabled (its gradient would be split over ranks)"
            )
        full = extra
    else:
        raise MissingShardPatch(f"{describe_target(func)}: {name} of type {type(extra).__name__}")
    return full


def _validate_diff(x: ShardTensor, n: int, dim: int, prepend: Any, append: Any) -> None:
    """Raise what torch would raise, on every rank and before any communication (cached per configuration)."""
    meta_output_shape(torch.diff, (x,), {"n": n, "dim": dim, "prepend": prepend, "append": append})


@eager_handler
def sharded_diff(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """torch.diff of a ShardTensor; along a sharded dim the trailing ranks lose the ``n`` rows.

    Examples:
        A plain ``prepend`` row counts as the first coordinate's (sizes 2/3 -> 3/2):

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full, first = torch.arange(5.0) ** 2, torch.tensor([-1.0])
        >>> d = shard_tensor(full, mesh, [Shard(0)], [2, 3]).diff(prepend=first)
        >>> tuple(d.to_local().shape) == [(3,), (2,)][rank]
        True
        >>> torch.equal(d.full_tensor(), full.diff(prepend=first))
        True
    """
    bound = bind_arguments(_diff, args, kwargs)
    x = bound["input"]
    extras = [bound[k] for k in ("prepend", "append") if isinstance(bound[k], ShardTensor)]
    if extras and not _fallback_takes_extras(x, bound["dim"], extras):
        raise MissingShardPatch(
            f"{describe_target(func)}: prepend/append as a ShardTensor, with the input or it sharded on a dim "
            f"other than dim={bound['dim']} on splits that are not torch.chunk's (placements "
            f"{[tuple(t.placements) for t in [x, *extras] if isinstance(t, (ShardTensor, DTensor))]}), "
            "is not supported: "
            "the DTensor fallback raises there, or one rank raises while the other hangs (measured on 2 ranks); "
            "pass a plain tensor (identical on every rank)"
        )
    if is_partial(x) or extras:
        return delegate(func, types, args, kwargs)  # linear in x / extra rows the fallback aligns right
    x = require_shard_input(func, x)
    n, dim = int(bound["n"]), normalize_dim(func, bound["dim"], x.ndim)
    layouts = sharded_dims(x)
    prepend = _extra_rows(func, "prepend", bound["prepend"], x, dim, layouts)
    append = _extra_rows(func, "append", bound["append"], x, dim, layouts)
    _validate_diff(x, n, dim, prepend, append)
    if prepend is not None:
        prepend = _local_block(prepend, layouts, dim)
    if append is not None:
        append = _local_block(append, layouts, dim)

    local = local_of(x)
    layout = layouts.get(dim)
    if layout is None:
        return from_local_like(torch.diff(local, n=n, dim=dim, prepend=prepend, append=append), x)

    # z = [prepend; x; append]; this rank's output rows [j0, j1) need z rows [j0, j1 + n).
    p = 0 if prepend is None else prepend.shape[dim]
    a = 0 if append is None else append.shape[dim]
    out_sizes = diff_output_sizes(layout.sizes, n, p, a)
    z_total = p + layout.total + a

    def z_rows(coord: int) -> range:
        j0 = sum(out_sizes[:coord])
        j1 = j0 + out_sizes[coord]
        return range(j0, min(j1 + n, z_total)) if j1 > j0 else range(0)

    def x_rows(coord: int) -> list[int]:
        rows = z_rows(coord)
        return list(range(max(rows.start, p) - p, min(rows.stop, p + layout.total) - p))

    mine = z_rows(layout.coord)
    pieces = []
    # prepend/append pieces are taken (possibly 0 rows) on every rank: the autograd graphs then
    # match across ranks, so the all-reduce in the backward of their promotion runs everywhere.
    if prepend is not None:
        first = min(mine.start, p)
        pieces.append(prepend.narrow(dim, first, min(mine.stop, p) - first if mine.start < p else 0))
    pieces.append(gather_global_indices(local, layout, x_rows))
    if append is not None:
        end = p + layout.total
        first = min(max(mine.start, end) - end, a)
        pieces.append(append.narrow(dim, first, max(0, mine.stop - end - first)))
    chunk = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
    out = torch.diff(chunk, n=n, dim=dim)
    if n == 0:
        out = out.clone()  # torch.diff(n=0) returns its input; the chunk may alias the local block
    return from_local_like(out, x, sizes_by_tensor_dim={dim: out_sizes})


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare torch.gradient and torch.diff handlers."""
    patches.function(
        torch.gradient,
        sharded_gradient,
        description="torch.gradient: halo of one row (edge_order+1 at the global edges) per sharded dim",
    )
    for target in (torch.diff, torch.Tensor.diff):
        patches.function(
            target,
            sharded_diff,
            description=f"{describe_target(target)}: halo of n rows after each shard; trailing ranks lose n rows",
        )
