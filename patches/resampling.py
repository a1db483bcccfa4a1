"""pixel_shuffle / pixel_unshuffle and interpolate (nn.Upsample) on uneven shards.

PhysicsNeMo 2.2 has no pixel-shuffle patch (the DTensor fallback crashes in
shape inference on uneven shards), and its ``F.interpolate`` patch is silently
wrong with ``align_corners=True`` and crashes with ``size=``.

* ``pixel_shuffle(r)``: each input row becomes ``r`` output rows, so a sharded
  height/width stays local and the output shards are ``r`` times the input's.
  A sharded channel dim stays local when every shard holds whole groups of ``r*r``
  channels; otherwise it is refused.
* ``pixel_unshuffle(r)``: every ``r`` consecutive rows form one output row. Shards
  whose sizes are multiples of ``r`` stay local; otherwise group ``g`` moves to the
  owner of its first row (`gather_global_indices`,
  fewer than ``r`` rows per boundary), and output shards hold the groups they own.
* ``interpolate`` with modes ``nearest``, ``nearest-exact``, ``linear``,
  ``bilinear``, ``trilinear``, ``bicubic`` (``align_corners`` either way, ``size=`` or
  ``scale_factor=``, ``recompute_scale_factor``): along a sharded dim, each output
  row's source coordinate is computed *globally* with PyTorch's own formulas
  (the user's ``scale_factor`` included), the row goes to the rank holding its
  left source row, and that rank fetches the neighbours it lacks (linear: at
  most one row per boundary; bicubic: 1 left, 2 right; nearest: none) and interpolates.
  Unsharded dims are resized by ``F.interpolate``. Both are done a chunk of output rows
  at a time, straight from the block and the halo rows, so the output is the one
  block-sized buffer (its backward likewise forms only the block's gradient). ``area`` is
  adaptive average pooling and goes through ``F.adaptive_avg_pool{1,2,3}d``.

Delegated (`delegate`), checked on 2 ranks
against single-process, values and gradients: ``Partial`` inputs of ``interpolate``
(the built-in resizes each rank's term: interpolation is linear) and of
``pixel_shuffle`` / ``pixel_unshuffle`` (the DTensor fallback keeps the
``Partial(sum)``: a permutation of elements).

Refused (``MissingShardPatch``), each checked against the delegate on 2 ranks:

* ``antialias=True`` with a sharded spatial dim: PhysicsNeMo's built-in (which this
  overrides) raises ``TypeError`` with ``size=``, is silently wrong with
  ``align_corners=True`` (8 rows split 4/4, ``scale_factor=2``: output off by 0.22,
  gradient by 0.52) and fails on some uneven splits ("The size of tensor a (3) must
  match the size of tensor b (4)");
* ``pixel_shuffle`` with channel shards that split a group of ``r*r`` channels: the
  DTensor fallback runs the kernel on the local channels and fails ("input.size(-3)=6
  is not divisible by 4");
* 1-D/3-D ``nearest`` whose ``scale_factor`` keeps a sharded dim's size but shifts its
  rows, and ``bicubic`` likewise: PyTorch's forward shifts the rows while its backward
  copies them. The built-in happens to reproduce both on 2 ranks with non-empty shards
  (its halo row is exactly the shift), but it is wrong with an empty shard (off by 1.4),
  raises ``TypeError`` for a per-dim ``scale_factor``, aborts gloo on 4 ranks with uneven
  shards (collective size mismatch), and for ``bicubic`` is wrong on uneven shards
  (9 rows split 5/4, ``scale_factor=1.1``: off by 0.47).

Examples:
    On 2 ranks (``mesh``, ``rank``), height 17 split 10/7 (and 16 split 10/6):

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-1, 1, 17 * 4).reshape(1, 1, 17, 4)
    >>> x = shard_tensor(full, mesh, [Shard(2)], [10, 7])
    >>> y = F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=True)   # height 25
    >>> tuple(y.to_local().shape) == [(1, 1, 15, 6), (1, 1, 10, 6)][rank]
    True
    >>> expected = F.interpolate(full, scale_factor=1.5, mode="bilinear", align_corners=True)
    >>> torch.allclose(y.full_tensor(), expected, atol=1e-6)
    True
    >>> rows = torch.arange(16 * 4, dtype=torch.float32).reshape(1, 1, 16, 4)
    >>> z = F.pixel_unshuffle(shard_tensor(rows, mesh, [Shard(2)], [10, 6]), 2)    # groups split 5/3
    >>> tuple(z.to_local().shape) == [(1, 4, 5, 2), (1, 4, 3, 2)][rank]
    True
    >>> torch.equal(z.full_tensor(), F.pixel_unshuffle(rows, 2))
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    connected_zeros,
    delegate,
    describe_target,
    eager_handler,
    expand_to,
    from_local_like,
    gather_global_indices,
    is_partial,
    linear_backward,
    local_of,
    meta_output_shape,
    outside_trace,
    require_shard_input,
    sharded_dims,
    split_rows_by_owner,
    traced_constants,
)

__all__ = ["interpolate_handler", "pixel_shuffle_handler", "pixel_unshuffle_handler", "source_rows"]


# -- pixel shuffle -------------------------------------------------------------------------------------
# Mirrors of the C builtins' parameters (no introspectable signature).
def _pixel_shuffle(input: Any, upscale_factor: int) -> None:
    """The parameters of ``F.pixel_shuffle``."""


def _pixel_unshuffle(input: Any, downscale_factor: int) -> None:
    """The parameters of ``F.pixel_unshuffle``."""


@eager_handler
def pixel_shuffle_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``pixel_shuffle`` on uneven shards: local for sharded rows/batch; channel shards need whole groups.

    Declared with ``patches.function(torch.nn.functional.pixel_shuffle, pixel_shuffle_handler)``.
    """
    op = describe_target(func)
    a = bind_arguments(_pixel_shuffle, args, kwargs)
    x, r = a["input"], int(a["upscale_factor"])
    if is_partial(x):
        return delegate(func, types, args, kwargs)  # a permutation of elements: the fallback keeps Partial(sum)
    meta_output_shape(func, (x, r))  # PyTorch's own argument checks (cached per configuration)
    channel = x.ndim - 3
    sizes: dict[int, list[int]] = {}
    for d, layout in sharded_dims(x).items():
        if d == channel:
            if any(s % (r * r) for s in layout.sizes):
                raise MissingShardPatch(
                    f"{op}: channel shards {layout.sizes} split groups of upscale_factor**2 = {r * r} channels; "
                    "shard height/width instead, or make every channel shard a multiple of r*r"
                )
            sizes[d] = [s // (r * r) for s in layout.sizes]
        elif d > channel:
            sizes[d] = [s * r for s in layout.sizes]
    local = local_of(x)
    if local.numel() == 0:  # PyTorch's pixel_shuffle backward mis-shapes empty gradients
        shape = list(local.shape)
        shape[channel] //= r * r
        shape[-2] *= r
        shape[-1] *= r
        return from_local_like(connected_zeros(local, shape), x, sizes_by_tensor_dim=sizes)
    return from_local_like(func(local, r), x, sizes_by_tensor_dim=sizes)


@eager_handler
def pixel_unshuffle_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``pixel_unshuffle`` on uneven shards: rows regrouped so that each rank holds whole groups of ``r``.

    Declared with ``patches.function(torch.nn.functional.pixel_unshuffle, pixel_unshuffle_handler)``.
    """
    a = bind_arguments(_pixel_unshuffle, args, kwargs)
    x, r = a["input"], int(a["downscale_factor"])
    if is_partial(x):
        return delegate(func, types, args, kwargs)  # a permutation of elements: the fallback keeps Partial(sum)
    meta_output_shape(func, (x, r))
    channel = x.ndim - 3
    local = local_of(x)
    sizes: dict[int, list[int]] = {}
    for d, layout in sharded_dims(x).items():
        if d == channel:
            sizes[d] = [s * r * r for s in layout.sizes]
        elif d > channel:
            groups = split_rows_by_owner(layout, [g * r for g in range(layout.total // r)])
            if any(s % r for s in layout.sizes):
                # Move each group of r rows to the owner of its first row (only split groups travel).
                local = gather_global_indices(local, layout, lambda c, g=groups: range(g[c][0] * r, g[c][1] * r))
            sizes[d] = [g1 - g0 for g0, g1 in groups]
    if local.numel() == 0:
        shape = list(local.shape)
        shape[channel] *= r * r
        shape[-2] //= r
        shape[-1] //= r
        return from_local_like(connected_zeros(local, shape), x, sizes_by_tensor_dim=sizes)
    return from_local_like(func(local, r), x, sizes_by_tensor_dim=sizes)


# -- interpolate ---------------------------------------------------------------------------------------
_LINEAR = {"linear", "bilinear", "trilinear"}
_NEAREST = {"nearest", "nearest-exact"}


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _nearest_rows(mode: str, in_size: int, out_size: int, scale: float | None, spatial_dims: int) -> torch.Tensor:
    """Source row of each output row, read off PyTorch's own nearest kernel run on a row-number probe.

    The kernels differ in details by rank (2-D copies rows when the size is unchanged
    whatever the scale; 1-D and 3-D apply the scale), so the kernel itself is asked.
    """
    shape = [1, 1] + [1] * spatial_dims
    shape[2] = in_size
    probe = torch.arange(in_size, dtype=torch.float64).reshape(shape)
    if scale is not None:
        probed = F.interpolate(probe, scale_factor=[scale] + [1.0] * (spatial_dims - 1), mode=mode)
    else:
        probed = F.interpolate(probe, size=[out_size] + [1] * (spatial_dims - 1), mode=mode)
    return probed.reshape(-1).to(torch.int64)


def source_rows(
    mode: str,
    in_size: int,
    out_size: int,
    scale: float | None,
    align_corners: bool,
    dtype: torch.dtype,
    spatial_dims: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global source rows and weights of every output row, as PyTorch's CPU kernels compute them.

    Returns ``(i0, i1, w0, w1)``: output row ``j`` is ``x[i0[j]] * w0[j] + x[i1[j]] * w1[j]``
    (nearest modes: ``i1 = i0``, ``w0 = 1``, ``w1 = 0``). ``scale`` is the user's
    ``scale_factor`` for this dim (``None`` when the size was given or recomputed);
    ``spatial_dims`` is the number of resized dims of the call (nearest kernels differ by it).

    Examples:
        >>> [t.tolist() for t in source_rows("linear", 3, 5, None, True, torch.float64)]
        [[0, 0, 1, 1, 2], [1, 1, 2, 2, 2], [1.0, 0.5, 1.0, 0.5, 1.0], [0.0, 0.5, 0.0, 0.5, 0.0]]
    """
    j = torch.arange(out_size, dtype=torch.int64)
    if mode in _NEAREST:
        i0 = _nearest_rows(mode, in_size, out_size, scale, spatial_dims)
        return i0, i0, torch.ones(out_size, dtype=dtype), torch.zeros(out_size, dtype=dtype)
    if out_size == in_size:  # the linear kernels copy rows when the size is unchanged, whatever the scale
        return j, j, torch.ones(out_size, dtype=dtype), torch.zeros(out_size, dtype=dtype)
    op = _opmath(dtype)
    if align_corners:
        ratio = torch.tensor(in_size - 1, dtype=op) / (out_size - 1) if out_size > 1 else torch.tensor(0.0, dtype=op)
        real = ratio * j.to(op)
    else:
        ratio = torch.tensor(1.0 / scale, dtype=op) if scale else torch.tensor(in_size, dtype=op) / out_size
        real = torch.clamp(ratio * (j.to(op) + 0.5) - 0.5, min=0)
    i0 = torch.clamp(torch.floor(real).to(torch.int64), max=in_size - 1)
    w1 = torch.clamp(real - i0.to(op), 0, 1)
    i1 = i0 + (i0 < in_size - 1).to(torch.int64)
    return i0, i1, (1 - w1).to(dtype), w1.to(dtype)


def cubic_source_rows(
    in_size: int, out_size: int, scale: float | None, align_corners: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Four clamped global source rows and their weights per output row, as PyTorch's bicubic kernel.

    Returns ``(rows, weights)`` of shape ``(out_size, 4)``; output row ``j`` is ``sum_k x[rows[j, k]] * weights[j, k]``.

    Examples:
        >>> rows, weights = cubic_source_rows(4, 4, None, False, torch.float64)
        >>> rows[1].tolist(), weights[1].tolist()
        ([0, 1, 2, 3], [0.0, 1.0, 0.0, 0.0])
    """
    op = _opmath(dtype)
    j = torch.arange(out_size, dtype=op)
    if align_corners:
        ratio = torch.tensor(in_size - 1, dtype=op) / (out_size - 1) if out_size > 1 else torch.tensor(0.0, dtype=op)
        real = ratio * j
    else:
        ratio = torch.tensor(1.0 / scale, dtype=op) if scale else torch.tensor(in_size, dtype=op) / out_size
        real = ratio * (j + 0.5) - 0.5  # no clamp at 0 for cubic
    index = torch.clamp(torch.floor(real).to(torch.int64), max=in_size - 1)
    t = torch.clamp(real - index.to(op), 0, 1)
    a = -0.75

    def near(x: torch.Tensor) -> torch.Tensor:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = torch.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], dim=1)
    rows = torch.clamp(index.unsqueeze(1) + torch.arange(-1, 3).unsqueeze(0), 0, in_size - 1)
    return rows, weights.to(dtype)


def _taps(
    mode: str,
    in_size: int,
    out_size: int,
    scale: float | None,
    align_corners: bool,
    dtype: torch.dtype,
    spatial_dims: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source rows ``(out, taps)`` and weights ``(out, taps)`` for any supported mode."""
    if mode == "bicubic":
        return cubic_source_rows(in_size, out_size, scale, align_corners, dtype)
    i0, i1, w0, w1 = source_rows(mode, in_size, out_size, scale, align_corners, dtype, spatial_dims)
    if mode in _NEAREST:
        return i0.unsqueeze(1), w0.unsqueeze(1)
    return torch.stack([i0, i1], 1), torch.stack([w0, w1], 1)


class _Chunk(NamedTuple):
    """A run of this rank's output rows and the window rows it reads, in the pieces that hold them."""

    start: int  # first output row (local)
    rows: int
    pieces: tuple[tuple[bool, int, int], ...]  # (from the halo, else the local block; first row; rows)
    taps: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]  # (index into the pieces' rows, weight) per tap


class _DimPlan(NamedTuple):
    """What one sharded dim's resampling needs besides the data; the same every step for one layer."""

    copies: bool  # every output row is its source row (weight 1): a plain copy
    ranges: list[tuple[int, int]]  # output rows of each coordinate
    halo: list[list[int]]  # global rows each coordinate fetches (those of its window it does not hold)
    chunks: tuple[_Chunk, ...]  # this rank's output rows, a few at a time
    returned: list[list[int]]  # per coordinate: the positions, among all halos, of the rows it owns ...
    targets: torch.Tensor  # ... and, for this rank, the local row each of them is added into


#: Output rows are formed this many bytes (or 1/`_CHUNKS` of the rows) at a time: the temporaries of
#: the taps, the weights and the other resized dims stay that small; only the output is block-sized.
_CHUNK_BYTES = 1 << 17
_CHUNKS = 32


def _window_pieces(first: int, stop: int, n_left: int, own: tuple[int, int]) -> tuple[tuple[bool, int, int], ...]:
    """Window positions ``[first, stop)`` as pieces of the halo (left rows, then right) and the local block."""
    own_start, own_rows = own
    pieces = []
    for lo, hi, in_halo, shift in (
        (0, n_left, True, 0),
        (n_left, n_left + own_rows, False, own_start - n_left),
        (n_left + own_rows, stop, True, -own_rows),
    ):
        a, b = max(first, lo), min(stop, hi)
        if a < b:
            pieces.append((in_halo, a + shift, b - a))
    return tuple(pieces)


@functools.lru_cache(maxsize=256)
def _dim_plan(
    mode: str,
    sizes: tuple[int, ...],
    coord: int,
    out_size: int,
    scale: float | None,
    align_corners: bool,
    dtype: torch.dtype,
    spatial_dims: int,
    d: int,
    ndim: int,
    device: torch.device,
    chunk_rows: int,
) -> _DimPlan:
    layout = DimLayout(tensor_dim=d, mesh_dim=0, sizes=sizes, coord=coord, mesh=None)
    rows, weights = _taps(mode, layout.total, out_size, scale, align_corners, dtype, spatial_dims)
    tap = 1 if mode == "bicubic" else 0
    copies = torch.equal(rows[:, tap], torch.arange(out_size)) and bool((weights[:, tap] == 1).all())
    # The row goes to the owner of its left source row (the second tap for bicubic).
    anchor = rows[:, 1] if mode == "bicubic" else rows[:, 0]
    ranges = split_rows_by_owner(layout, anchor.tolist())
    low, high = rows.min(1).values.tolist(), rows.max(1).values.tolist()
    wanted = [range(min(low[j0:j1]), max(high[j0:j1]) + 1) if j1 > j0 else range(0) for j0, j1 in ranges]
    owned = [range(layout.offsets[c], layout.offsets[c] + sizes[c]) for c in range(layout.parts)]
    halo = [[r for r in w if r not in o] for w, o in zip(wanted, owned)]
    # The adjoint of the halo exchange: every halo row's gradient goes back to the row's owner.
    where = [(c, p, r) for c, rows_c in enumerate(halo) for p, r in enumerate(rows_c)]
    firsts = [sum(len(h) for h in halo[:c]) for c in range(layout.parts)]
    returned = [[firsts[c] + p for c, p, r in where if layout.owner_of(r) == o] for o in range(layout.parts)]
    targets = [r - layout.offsets[coord] for c, p, r in where if layout.owner_of(r) == coord]
    j0, j1 = ranges[coord]
    window = wanted[coord]
    n_left = sum(1 for r in halo[coord] if r < layout.offsets[coord])
    own_rows = len(window) - len(halo[coord])
    own = (window.start + n_left - layout.offsets[coord] if own_rows else 0, own_rows)
    index = rows[j0:j1] - (window.start if j1 > j0 else 0)
    chunks = []
    for a in range(0, j1 - j0, chunk_rows):
        n = min(chunk_rows, j1 - j0 - a)
        first, last = int(index[a : a + n].min()), int(index[a : a + n].max())
        shape = [1] * ndim
        shape[d] = n
        taps = tuple(
            (
                (index[a : a + n, k] - first).to(device),
                None if mode in _NEAREST else weights[j0 + a : j0 + a + n, k].reshape(shape).to(device),
            )
            for k in range(rows.shape[1])
        )
        chunks.append(_Chunk(a, n, _window_pieces(first, last + 1, n_left, own), taps))
    return _DimPlan(
        copies, ranges, halo, tuple(chunks), returned, torch.tensor(targets, dtype=torch.long, device=device)
    )


Resize = Callable[[torch.Tensor], torch.Tensor]


def _read(pieces: tuple[tuple[bool, int, int], ...], halo: torch.Tensor, local: torch.Tensor, d: int) -> torch.Tensor:
    """The window rows of one chunk: a view of the local block, or a small concatenation with halo rows."""
    parts = [(halo if in_halo else local).narrow(d, first, rows) for in_halo, first, rows in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, d)


def _resample_rows(
    local: torch.Tensor, layout: DimLayout, plan: _DimPlan, out_shape: list[int], rest: Resize | None
) -> torch.Tensor:
    """This rank's output rows along the sharded dim (then the other resized dims, ``rest``), chunk by chunk.

    Only the halo rows are fetched, and each chunk's temporaries are chunk-sized: the output is
    the one block-sized buffer. Linear in ``local``; `_return_rows` is its adjoint.
    """
    d = layout.tensor_dim
    halo = gather_global_indices(local, layout, plan.halo) if any(plan.halo) else local.narrow(d, 0, 0)
    out: torch.Tensor | None = None
    for chunk in plan.chunks if math.prod(out_shape) else ():
        source = _read(chunk.pieces, halo, local, d)
        rows: torch.Tensor | None = None
        for index, weight in chunk.taps:  # the same products and sums as x[i0] * w0 + x[i1] * w1
            term = source.index_select(d, index)
            if weight is not None:
                term.mul_(weight)
            rows = term if rows is None else rows.add_(term)
        assert rows is not None
        if rest is not None:
            rows = rest(rows)
        if out is None:
            out = rows.new_empty(out_shape)
        out.narrow(d, chunk.start, chunk.rows).copy_(rows)
    if out is None:  # no output rows here (an empty shard, or all rows owned elsewhere)
        dtype = local.dtype
        if rest is not None and local.numel() and math.prod(out_shape):
            dtype = rest(local.narrow(d, 0, min(1, local.shape[d]))).dtype  # what autocast makes of it
        out = local.new_empty(out_shape, dtype=dtype)
    return out


def _return_rows(
    grad: torch.Tensor,
    layout: DimLayout,
    plan: _DimPlan,
    local_shape: torch.Size,
    local_dtype: torch.dtype,
    rest: Resize | None,
) -> torch.Tensor:
    """The adjoint of `_resample_rows`: the gradient of this rank's block, formed in one block-sized buffer."""
    d = layout.tensor_dim
    grad_local = grad.new_zeros(local_shape, dtype=local_dtype)
    halo_shape = list(local_shape)
    halo_shape[d] = len(plan.halo[layout.coord])
    grad_halo = grad.new_zeros(halo_shape, dtype=local_dtype)
    for chunk in plan.chunks if grad.numel() and grad_local.numel() else ():
        g = grad.narrow(d, chunk.start, chunk.rows)
        window_shape = list(local_shape)
        window_shape[d] = sum(rows for _, _, rows in chunk.pieces)
        rows_shape = list(window_shape)
        rows_shape[d] = chunk.rows
        if rest is not None:
            g = _resize_adjoint(g, rows_shape, rest).to(local_dtype)
        window = g.new_zeros(window_shape, dtype=local_dtype)
        for index, weight in chunk.taps:
            window.index_add_(d, index, g if weight is None else g * weight)
        at = 0
        for in_halo, first, rows in chunk.pieces:
            (grad_halo if in_halo else grad_local).narrow(d, first, rows).add_(window.narrow(d, at, rows))
            at += rows
    if any(plan.halo):
        # The halo rows' gradients go back to their owners (the halos, seen as one sharded dim).
        halos = dataclasses.replace(layout, sizes=tuple(len(h) for h in plan.halo))
        grad_local.index_add_(d, plan.targets, gather_global_indices(grad_halo, halos, plan.returned))
    return grad_local


def _resize_adjoint(grad: torch.Tensor, shape: list[int], rest: Resize) -> torch.Tensor:
    """The gradient of ``rest`` (PyTorch's own interpolate over the other dims) at a block of ``shape``."""
    with torch.enable_grad(), torch.autocast(grad.device.type, enabled=False):
        probe = grad.new_zeros(shape).requires_grad_(True)
        (result,) = torch.autograd.grad(rest(probe), probe, grad)
    return result


def _resample_dim(
    local: torch.Tensor,
    layout: DimLayout,
    mode: str,
    out_size: int,
    scale: float | None,
    align_corners: bool,
    rest: tuple[Resize, list[int]] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Interpolate along one sharded dim (then ``rest``: the other dims and their sizes); returns the local
    result and the output rows per coordinate."""
    d = layout.tensor_dim
    final = local.shape if rest is None else rest[1]
    row_bytes = local.element_size() * math.prod(s for k, s in enumerate(final) if k != d)
    rows_here = -(-out_size // max(layout.parts, 1))  # about this rank's output rows
    chunk_rows = max(1, -(-rows_here // _CHUNKS), _CHUNK_BYTES // max(row_bytes, 1))
    with outside_trace():  # the plan reads its index tensors' values: real ones, cached
        plan = _dim_plan(
            mode,
            tuple(layout.sizes),
            layout.coord,
            out_size,
            scale,
            align_corners,
            local.dtype,
            local.ndim - 2,
            d,
            local.ndim,
            local.device,
            chunk_rows,
        )
    plan = traced_constants(plan, local)
    if mode in ("nearest", "bicubic") and out_size == layout.total and not plan.copies:
        # PyTorch's nearest (1-D/3-D) and bicubic kernels move rows here, but their backward
        # copies them: no sharded result can match both, so refuse rather than pick one.
        raise MissingShardPatch(
            f"torch.nn.functional.interpolate: mode={mode!r} with scale_factor={scale} keeps dim {d} at "
            f"size {out_size} but shifts rows, and PyTorch's own backward treats it as a copy (forward and "
            "backward disagree; PhysicsNeMo's built-in is wrong or fails here on uneven or empty shards); pass "
            "size= or scale_factor=1.0 for that dim"
        )
    j0, j1 = plan.ranges[layout.coord]
    out_shape = list(local.shape) if rest is None else list(rest[1])
    out_shape[d] = j1 - j0
    resize = None if rest is None else rest[0]
    shape, dtype = local.shape, local.dtype
    out = linear_backward(
        local,
        lambda t: _resample_rows(t, layout, plan, out_shape, resize),
        lambda g: _return_rows(g, layout, plan, shape, dtype, resize),
    )
    return out, [b - a for a, b in plan.ranges]


@eager_handler
def interpolate_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``F.interpolate`` on uneven shards with globally computed source coordinates.

    Declared with ``patches.function(torch.nn.functional.interpolate, interpolate_handler, override=True)``.
    """
    op = describe_target(func)
    a = bind_arguments(F.interpolate, args, kwargs)
    x, mode = a["input"], a["mode"]
    if is_partial(x):
        return delegate(func, types, args, kwargs)  # interpolation is linear: the built-in resizes each term
    require_shard_input(func, x)
    meta_kwargs = {k: v for k, v in a.items() if k != "input"}
    out_shape = meta_output_shape(func, (x,), meta_kwargs)  # PyTorch's checks, cached per configuration
    n = x.ndim - 2
    spatial = {d: l for d, l in sharded_dims(x).items() if d >= 2}
    if not spatial:
        if a["size"] is None:
            # Nothing sharded along the resized dims: PhysicsNeMo's built-in runs the local op, as we would.
            return physicsnemo_shardext.builtin_handler(func)(func, types, args, kwargs)
        return from_local_like(func(local_of(x), **meta_kwargs), x)
    if mode == "area":
        pool = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}[n]
        return pool(x, tuple(out_shape[2:]) if n > 1 else out_shape[2])
    if a["antialias"]:
        raise MissingShardPatch(
            f"{op}: antialias=True with a sharded spatial dim {sorted(spatial)} is not supported (PhysicsNeMo's "
            "built-in raises with size=, is wrong with align_corners=True and fails on some uneven shards)"
        )
    if mode not in _LINEAR | _NEAREST | {"bicubic"}:
        raise MissingShardPatch(
            f"{op}: mode={mode!r} with a sharded spatial dim {sorted(spatial)} is not supported "
            "(supported: nearest, nearest-exact, linear, bilinear, trilinear, bicubic, area)"
        )
    use_scale = a["scale_factor"] is not None and not a["recompute_scale_factor"]
    # PyTorch's checks above leave a scalar or one scale per resized dim.
    scales = expand_to(a["scale_factor"] if use_scale else None, n, what="scale_factor", op=op)
    align = bool(a["align_corners"]) if mode in _LINEAR | {"bicubic"} else False

    local = local_of(x)
    rest_dims = [d for d in range(2, x.ndim) if d not in spatial]

    def resize(t: torch.Tensor) -> torch.Tensor:
        # Sharded dims are already resized: ask for an unchanged size there (PyTorch then copies rows).
        local_kwargs: dict[str, Any] = {"mode": mode, "align_corners": a["align_corners"]}
        if use_scale:
            local_kwargs["scale_factor"] = [1.0 if d in spatial else scales[d - 2] for d in range(2, x.ndim)]
        else:
            local_kwargs["size"] = [t.shape[d] if d in spatial else out_shape[d] for d in range(2, x.ndim)]
        return cast(torch.Tensor, func(t, **local_kwargs))

    sizes: dict[int, list[int]] = {}
    order = sorted(spatial.items())
    for i, (d, layout) in enumerate(order):
        rest = None
        if rest_dims and i == len(order) - 1:
            # The other resized dims go with the last sharded one, a few output rows at a time.
            rest = (resize, [out_shape[k] if k in rest_dims else local.shape[k] for k in range(x.ndim)])
        local, sizes[d] = _resample_dim(local, layout, mode, out_shape[d], scales[d - 2], align, rest)
    return from_local_like(local, x, sizes_by_tensor_dim=sizes)


# -- plugin hooks --------------------------------------------------------------------------------------
@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare pixel (un)shuffle and interpolate (overriding PhysicsNeMo's interpolate)."""
    patches.function(F.pixel_shuffle, pixel_shuffle_handler, description="pixel_shuffle: local on row/batch shards")
    patches.function(
        F.pixel_unshuffle,
        pixel_unshuffle_handler,
        description="pixel_unshuffle: groups of r rows regrouped to the owner of their first row",
    )
    patches.function(
        F.interpolate,
        interpolate_handler,
        override=True,
        description="interpolate: global source coordinates; at most one neighbour row per boundary",
    )
