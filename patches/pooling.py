"""Max/avg pooling (any kernel, stride, padding, dilation, ceil_mode) and adaptive pooling on uneven shards.

PhysicsNeMo 2.2's pooling patches only cover ``stride == kernel_size`` with every
local size divisible by the stride: an odd local size raises
``UndeterminedShardingError``, other strides are refused, and adaptive pooling
takes the DTensor fallback (whose backward is broken on torch 2.14).

Here every output row along a sharded spatial dimension is computed by the rank
that owns the *centre* of its window (clipped to the input's rows). That rank
fetches the few rows its windows reach past its shard on either side
(`gather_global_indices`, only the overlap moves), pads the global boundary
itself and runs the local op with no padding. Output shards are therefore as
uneven as the windows fall out: coordinate ``c`` holds the output rows whose
window centre lies in its input rows.

Windows that tile every shard exactly (``kernel_size == stride``, no padding, every
shard's rows divisible by the stride) need no rows from a neighbour: each rank pools
its own block, as PhysicsNeMo's built-in does, without the built-in's wrapping cost.

Adaptive pooling with output size 1 along a sharded dimension (global pooling)
reduces locally and all-reduces the per-channel result (O(channels) bytes); that
mesh dimension becomes ``Replicate`` in the output. Other adaptive output sizes use
the adaptive windows ``[floor(i*L/out), ceil((i+1)*L/out))``, each computed by the owner
of its first row.

Max-pool indices (``return_indices=True``) are *global* flat indices over the
input's spatial dims, as in a single-process run; ties resolve to the first
element in row-major order, as in PyTorch.

Delegated (`delegate`: the built-in where
PhysicsNeMo has one, else the DTensor fallback), checked on 2 ranks against
single-process, values and gradients:

* ``Partial`` inputs of ``avg_pool1d/2d/3d`` with ``stride == kernel_size`` (built-in:
  an average is linear, each rank's term is pooled; other strides, which the built-in
  refuses, are pooled term by term here the same way), of ``max_pool1d/2d_with_indices`` (fallback: sums the terms first, ``Replicate``) and of
  ``adaptive_avg_pool1d/2d`` (fallback: keeps the ``Partial(sum)``);
* calls whose input is not a ShardTensor (a ShardTensor elsewhere in the arguments).

Refused (``MissingShardPatch``): ``Partial`` inputs of ``max_pool1d/2d/3d`` (the
built-in max-pools each rank's term: wrong, the max of a partial sum is not the sum
of the maxima), of ``max_pool3d_with_indices``, ``adaptive_avg_pool3d`` and the adaptive
max pools (the fallback's forward is right but its backward fails: DTensor has no
sharding rule for their backward ops); a spatial dim sharded over two mesh dims
(PhysicsNeMo 2.2's ShardTensor cannot hold that layout on CPU ranks: ``from_dtensor``
rejects its local shape, checked on a 2x2 mesh). Limitation: NaNs in a global (output size 1) adaptive max over a
sharded dim are not propagated like PyTorch does (see docs/patches/pooling.md).

Examples:
    On 2 ranks (``mesh``, ``rank``), height 17 split 10/7:

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Replicate, Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-1, 1, 2 * 17 * 4).reshape(1, 2, 17, 4)
    >>> x = shard_tensor(full, mesh, [Shard(2)], [10, 7])
    >>> y = F.max_pool2d(x, 3, stride=2, padding=1)   # window centres 0, 2, .., 8 / 10, .., 16
    >>> tuple(y.to_local().shape) == [(1, 2, 5, 2), (1, 2, 4, 2)][rank]
    True
    >>> torch.equal(y.full_tensor(), F.max_pool2d(full, 3, stride=2, padding=1))
    True
    >>> g = F.adaptive_avg_pool2d(x, 1)                # global pooling: Replicate on the mesh
    >>> tuple(g.placements) == (Replicate(),), tuple(g.to_local().shape)
    (True, (1, 2, 1, 1))
    >>> torch.allclose(g.to_local(), full.mean((2, 3), keepdim=True), atol=1e-6)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Replicate

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    PoolStrips,
    bind_arguments,
    connected_zeros,
    delegate,
    describe_target,
    eager_handler,
    exchanging_strip_avg_pool,
    exchanging_strip_max_pool,
    expand_to,
    from_local_like,
    gather_global_indices,
    is_partial,
    local_of,
    max_over,
    meta_output_shape,
    min_over,
    placements_of,
    pool_strip_geometry,
    require_shard_input,
    sharded_dims,
    split_rows_by_owner,
    strip_avg_pool,
    strip_max_pool,
    sum_to_replicated,
)

__all__ = ["adaptive_pool_handler", "pool_handler"]

_INDEX_NONE = torch.iinfo(torch.int64).max  # "no candidate" in the global max tie-break


_BACKWARD_FAILS = "the DTensor fallback's backward fails: no sharding rule for its backward op"
#: Pools whose delegate is wrong or fails on a Partial(sum) input (checked on 2 ranks); the others delegate.
_PARTIAL_REFUSED: dict[Callable, str] = {
    **{
        f: "the built-in max-pools each rank's term: the max of a partial sum is not the sum of the maxima"
        for f in (F.max_pool1d, F.max_pool2d, F.max_pool3d)
    },
    F.max_pool3d_with_indices: _BACKWARD_FAILS,
    F.adaptive_avg_pool3d: _BACKWARD_FAILS,
    **{
        f: _BACKWARD_FAILS
        for f in (
            F.adaptive_max_pool1d,
            F.adaptive_max_pool2d,
            F.adaptive_max_pool3d,
            F.adaptive_max_pool1d_with_indices,
            F.adaptive_max_pool2d_with_indices,
            F.adaptive_max_pool3d_with_indices,
        )
    },
}


def _partial_delegated(func: Callable[..., Any], x: ShardTensor) -> bool:
    """Whether a Partial input goes to the delegate (True), else refuse it with the measured reason."""
    if not is_partial(x):
        return False
    if func in _PARTIAL_REFUSED:
        require_shard_input(func, x, _PARTIAL_REFUSED[func])
    return True


def _builtin_refuses_stride(a: dict[str, Any]) -> bool:
    """Whether PhysicsNeMo's avg-pool built-in refuses these arguments (it needs ``stride == kernel_size``).

    Examples:
        >>> _builtin_refuses_stride({"kernel_size": 2, "stride": None}), _builtin_refuses_stride({"kernel_size": 3, "stride": 1})
        (False, True)
    """
    stride = a["stride"] if a["stride"] is not None else a["kernel_size"]
    return stride != a["kernel_size"]


# -- windows along one spatial dimension ----------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _pool_ranges(
    sizes: tuple[int, ...], out: int, kernel: int, stride: int, padding: int, dilation: int
) -> list[tuple[int, int]]:
    """Output rows per coordinate: each goes to the owner of its window's centre row (clipped to the input).

    By the centre, as the convolution family does: the halo a rank fetches is then split
    between its two neighbours (``k3 s2 p1``: one row instead of two). Cached, since a layer
    asks for the same split every step.

    Examples:
        >>> _pool_ranges((10, 7), 9, 3, 2, 1, 1)     # centres 0, 2, .., 16: rows 0..4 / 5..8
        [(0, 5), (5, 9)]
    """
    last = sum(sizes) - 1
    centres = [min(max(j * stride - padding + dilation * (kernel - 1) // 2, 0), last) for j in range(out)]
    layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=tuple(sizes), coord=0, mesh=None)
    return split_rows_by_owner(layout, centres)


@dataclass(frozen=True)
class _Axis:
    """This rank's share of one spatial dim: output rows [j0, j1) and the input rows [lo, hi) they read."""

    dim: int
    layout: DimLayout | None
    out_sizes: tuple[int, ...] | None  # per coordinate, sharded dims only
    j0: int
    j1: int
    lo: int
    hi: int

    @property
    def out_local(self) -> int:
        return self.j1 - self.j0


def _fetch(
    local: torch.Tensor, axes: Sequence[_Axis], windows: Callable[[_Axis, int], tuple[int, int]]
) -> torch.Tensor:
    """Input rows [lo, hi) of every axis: exchanged along sharded dims, sliced along the others."""
    for axis in axes:
        if axis.layout is None:
            local = local.narrow(axis.dim, axis.lo, axis.hi - axis.lo)
        else:
            # Every rank along the mesh dim calls this (an empty window included): it is a collective.
            local = gather_global_indices(local, axis.layout, lambda c, a=axis: range(*windows(a, c)))
    return local


# -- max / avg pooling ------------------------------------------------------------------------------
# Mirrors of the pools' parameters (most are C builtins or boolean dispatchers without a usable signature).
def _max_pool(
    input: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> None:
    """The parameters of ``F.max_pool{1,2,3}d`` (and ``_with_indices``)."""


def _avg_pool1d(
    input: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
) -> None:
    """The parameters of ``F.avg_pool1d``."""


def _avg_pool(
    input: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> None:
    """The parameters of ``F.avg_pool2d/3d``."""


def _adaptive_avg_pool(input: Any, output_size: Any) -> None:
    """The parameters of ``F.adaptive_avg_pool{1,2,3}d``."""


def _adaptive_max_pool(input: Any, output_size: Any, return_indices: bool = False) -> None:
    """The parameters of ``F.adaptive_max_pool{1,2,3}d`` (and ``_with_indices``)."""


_MAX_POOLS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3}
_MAX_POOLS_WITH_INDICES = {F.max_pool1d_with_indices: 1, F.max_pool2d_with_indices: 2, F.max_pool3d_with_indices: 3}
_AVG_POOLS = {F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3}
_LOCAL_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


@dataclass(frozen=True)
class _PoolConfig:
    n: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    ceil_mode: bool


def _sum_pool(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """Window sums with no padding (avg pooling with divisor 1; 1-D goes through 2-D)."""
    n = len(kernel)
    if n == 1:
        return F.avg_pool2d(x.unsqueeze(-2), (1, kernel[0]), (1, stride[0]), divisor_override=1).squeeze(-2)
    pool = F.avg_pool2d if n == 2 else F.avg_pool3d
    return pool(x, tuple(kernel), tuple(stride), divisor_override=1)


def _global_flat_index(
    local_index: torch.Tensor,
    block_shape: Sequence[int],
    to_global: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    global_shape: Sequence[int],
) -> torch.Tensor:
    """Turn flat indices into a local block of spatial shape ``block_shape`` into global flat indices."""
    flat = torch.zeros_like(local_index)
    remaining = local_index
    coords = []
    for size in reversed(block_shape):
        coords.append(remaining % size)
        remaining = remaining // size
    for coord, convert, size in zip(reversed(coords), to_global, global_shape):
        flat = flat * size + convert(coord)
    return flat


def _tiles_every_shard(x: ShardTensor, cfg: _PoolConfig, spatial: dict[int, DimLayout], return_indices: bool) -> bool:
    """Disjoint windows tile every shard exactly: each rank's output is the pool of its own block."""
    if return_indices or x.ndim != cfg.n + 2 or cfg.kernel != cfg.stride:
        return False
    if any(p != 0 for p in cfg.padding) or any(d != 1 for d in cfg.dilation):
        return False
    return all(size % cfg.stride[d - (x.ndim - cfg.n)] == 0 for d, layout in spatial.items() for size in layout.sizes)


@eager_handler
def pool_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Max/avg pooling (1-3 d) of a ShardTensor with any kernel/stride/padding on uneven shards.

    Declared for every max/avg pool with ``patches.function(target, pool_handler, override=True)``
    (the ``_with_indices`` variants without ``override``: PhysicsNeMo has no built-in for them).
    """
    op = describe_target(func)
    is_max = func in _MAX_POOLS or func in _MAX_POOLS_WITH_INDICES
    n = {**_MAX_POOLS, **_MAX_POOLS_WITH_INDICES, **_AVG_POOLS}[func]
    a = bind_arguments(_max_pool if is_max else (_avg_pool1d if n == 1 else _avg_pool), args, kwargs)
    x = a["input"]
    if isinstance(x, ShardTensor) and not is_max and is_partial(x) and _builtin_refuses_stride(a):
        # An average is linear, so the pool of each rank's term is a term of the pooled sum. The
        # built-in does exactly that, but only for stride == kernel_size; other strides run here.
        return from_local_like(func(local_of(x), **{k: v for k, v in a.items() if k != "input"}), x)
    if not isinstance(x, ShardTensor) or _partial_delegated(func, x):
        return delegate(func, types, args, kwargs)  # checked on 2 ranks (see the module docstring)
    return_indices = is_max and (func in _MAX_POOLS_WITH_INDICES or bool(a["return_indices"]))
    stride = a["stride"]
    if stride is None or (not isinstance(stride, int) and len(stride) == 0):
        stride = a["kernel_size"]
    cfg = _PoolConfig(
        n=n,
        kernel=expand_to(a["kernel_size"], n, what="kernel_size", op=op),
        stride=expand_to(stride, n, what="stride", op=op),
        padding=expand_to(a["padding"], n, what="padding", op=op),
        dilation=expand_to(a["dilation"], n, what="dilation", op=op) if is_max else (1,) * n,
        ceil_mode=bool(a["ceil_mode"]),
    )
    # Let PyTorch validate the arguments (and give the global output shape) on a meta tensor.
    meta_kwargs = {k: v for k, v in a.items() if k != "input" and v is not None}
    meta_out = meta_output_shape(func, (x,), meta_kwargs)
    global_out_shape = meta_out if isinstance(meta_out, torch.Size) else meta_out[0]  # (values, indices)

    first = x.ndim - n
    spatial = {d: l for d, l in sharded_dims(x).items() if d >= first}
    if _tiles_every_shard(x, cfg, spatial, return_indices):
        # Each rank pools its own block, as PhysicsNeMo's built-in does, without its to_local /
        # from_local round trip (spec inference, signature binding: most of a call's host time).
        out = func(local_of(x), **{k: v for k, v in a.items() if k != "input"})
        rows = {d: tuple(size // cfg.stride[d - first] for size in layout.sizes) for d, layout in spatial.items()}
        return from_local_like(out, x, rows)

    def window(axis_index: int, j0: int, j1: int) -> tuple[int, int, int, int]:
        """(lo, hi, pad_before, pad_after) of the input rows read by output rows [j0, j1)."""
        size = x.shape[first + axis_index]
        k, s, p, dil = cfg.kernel[axis_index], cfg.stride[axis_index], cfg.padding[axis_index], cfg.dilation[axis_index]
        if j1 <= j0:
            return 0, 0, 0, 0
        begin, end = j0 * s - p, (j1 - 1) * s - p + dil * (k - 1) + 1
        lo, hi = max(begin, 0), min(end, size)
        return lo, hi, lo - begin, end - hi

    axes: list[_Axis] = []
    ranges_by_dim: dict[int, list[tuple[int, int]]] = {}
    for i in range(n):
        d = first + i
        out = global_out_shape[d]
        layout = spatial.get(d)
        if layout is None:
            j0, j1, out_sizes = 0, out, None
        else:
            ranges_by_dim[d] = _pool_ranges(
                layout.sizes, out, cfg.kernel[i], cfg.stride[i], cfg.padding[i], cfg.dilation[i]
            )
            j0, j1 = ranges_by_dim[d][layout.coord]
            out_sizes = tuple(b - a_ for a_, b in ranges_by_dim[d])
        lo, hi, _, _ = window(i, j0, j1)
        axes.append(_Axis(d, layout, out_sizes, j0, j1, lo, hi))

    def rows_wanted(axis: _Axis, coord: int) -> tuple[int, int]:
        lo, hi, _, _ = window(axis.dim - first, *ranges_by_dim[axis.dim][coord])
        return lo, hi

    strips = _strip_plan(x, cfg, axes, ranges_by_dim, not return_indices)
    if strips is None:
        win = _fetch(local_of(x), axes, rows_wanted)
    else:
        axis, geometries = strips
        # A coordinate without strips fetches its whole window, as the general path does.
        wanted = [g.halo_rows if g is not None else range(*rows_wanted(axis, c)) for c, g in enumerate(geometries)]
        if all(geometries) and local_of(x).shape[0] > 0:  # every rank: the exchange inside one autograd Function
            pads = [window(i, ax.j0, ax.j1)[2:] for i, ax in enumerate(axes)]
            flat_pads = [v for before, after in reversed(pads) for v in (before, after)]

            def haloed(local: torch.Tensor) -> torch.Tensor:  # the general path, for create_graph
                rows = _fetch(local, axes, rows_wanted)
                padded = F.pad(rows, flat_pads, value=float("-inf") if is_max else 0.0) if any(flat_pads) else rows
                if is_max:
                    return _LOCAL_MAX[n](padded, cfg.kernel, cfg.stride, 0, cfg.dilation, False)
                summed: torch.Tensor = _sum_pool(padded, cfg.kernel, cfg.stride) / _avg_divisor(x, cfg, axes, a, rows)
                return summed

            g = geometries[axis.layout.coord]
            assert g is not None
            kernel, stride_, padding = cfg.kernel, cfg.stride, cfg.padding
            if is_max:
                values = exchanging_strip_max_pool(
                    local_of(x), axis.layout, wanted, g, kernel, stride_, padding, haloed
                )
            else:
                values = exchanging_strip_avg_pool(
                    local_of(x), axis.layout, wanted, g, kernel, stride_, padding, haloed, *_avg_options(a)
                )
            return from_local_like(values, x, sizes_by_tensor_dim={axis.dim: axis.out_sizes})
        fetched = gather_global_indices(local_of(x), axis.layout, wanted)
        g = geometries[axis.layout.coord]
        if g is not None and local_of(x).shape[0] > 0:
            if is_max:
                values = strip_max_pool(local_of(x), fetched, g, axis.dim, cfg.kernel, cfg.stride, cfg.padding)
            else:
                values = strip_avg_pool(
                    local_of(x), fetched, g, axis.dim, cfg.kernel, cfg.stride, cfg.padding, *_avg_options(a)
                )
            return from_local_like(values, x, sizes_by_tensor_dim={axis.dim: axis.out_sizes})
        win = _fetch(fetched, [ax for ax in axes if ax.layout is None], rows_wanted)
    out_shape = tuple(win.shape[:first]) + tuple(ax.out_local for ax in axes)
    pads = [window(i, ax.j0, ax.j1)[2:] for i, ax in enumerate(axes)]

    if win.numel() == 0 or any(ax.out_local == 0 for ax in axes):
        values = connected_zeros(win, out_shape)
        indices = torch.zeros(out_shape, dtype=torch.int64, device=win.device)
    else:
        flat_pads = [v for before, after in reversed(pads) for v in (before, after)]
        fill = float("-inf") if is_max else 0.0
        padded = F.pad(win, flat_pads, value=fill) if any(flat_pads) else win
        if is_max:
            values, local_idx = _LOCAL_MAX[n](
                padded, cfg.kernel, cfg.stride, 0, cfg.dilation, False, return_indices=True
            )
            if return_indices:
                # Padded-window coordinate -> global input coordinate, per spatial dim.
                shifts = [ax.lo - before for ax, (before, _) in zip(axes, pads)]
                indices = _global_flat_index(
                    local_idx, padded.shape[first:], [lambda c, s=s: c + s for s in shifts], x.shape[first:]
                )
        else:
            values = _sum_pool(padded, cfg.kernel, cfg.stride) / _avg_divisor(x, cfg, axes, a, win)
    sizes = {ax.dim: ax.out_sizes for ax in axes if ax.out_sizes is not None}
    result = from_local_like(values, x, sizes_by_tensor_dim=sizes)
    if return_indices:
        return result, from_local_like(indices, x, sizes_by_tensor_dim=sizes)
    return result


def _avg_options(a: dict[str, Any]) -> tuple[bool, int | None]:
    """``count_include_pad`` and ``divisor_override`` of a bound average pool."""
    override = a.get("divisor_override")
    return bool(a["count_include_pad"]), int(override) if override else None


def _strip_plan(
    x: ShardTensor, cfg: _PoolConfig, axes: Sequence[_Axis], ranges_by_dim: dict, values_only: bool
) -> tuple[_Axis, list[PoolStrips | None]] | None:
    """The sharded axis and every coordinate's strips, where a pool can run without a haloed copy."""
    sharded = [ax for ax in axes if ax.layout is not None]
    if not values_only or cfg.ceil_mode or cfg.n not in (2, 3) or x.ndim != cfg.n + 2 or len(sharded) != 1:
        return None
    if any(dil != 1 for dil in cfg.dilation):
        return None
    (axis,) = sharded
    i = axis.dim - 2
    layout = axis.layout
    assert layout is not None
    geometries = [
        pool_strip_geometry(layout.sizes, c, ranges_by_dim[axis.dim][c], cfg.kernel[i], cfg.stride[i], cfg.padding[i])
        for c in range(layout.parts)
    ]
    return axis, geometries


def _avg_divisor(x: ShardTensor, cfg: _PoolConfig, axes: Sequence[_Axis], a: dict, like: torch.Tensor) -> Any:
    """PyTorch's avg-pool divisor for this rank's output rows: a product of per-dim window counts."""
    if a.get("divisor_override"):
        return float(a["divisor_override"])
    first = x.ndim - cfg.n
    divisor = None
    for i, ax in enumerate(axes):
        size, k, s, p = x.shape[ax.dim], cfg.kernel[i], cfg.stride[i], cfg.padding[i]
        counts = []
        for j in range(ax.j0, ax.j1):
            start = j * s - p
            if a["count_include_pad"]:
                counts.append(min(start + k, size + p) - start)
            else:
                counts.append(min(start + k, size) - max(start, 0))
        shape = [1] * (x.ndim - first)
        shape[i] = len(counts)
        vector = torch.tensor(counts, dtype=like.dtype, device=like.device).reshape(shape)
        divisor = vector if divisor is None else divisor * vector
    return divisor


# -- adaptive pooling --------------------------------------------------------------------------------
_ADAPTIVE_AVG = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3}
_ADAPTIVE_MAX = {F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3}
_ADAPTIVE_MAX_WITH_INDICES = {
    F.adaptive_max_pool1d_with_indices: 1,
    F.adaptive_max_pool2d_with_indices: 2,
    F.adaptive_max_pool3d_with_indices: 3,
}


def _adaptive_start(i: int, size: int, out: int) -> int:
    return (i * size) // out


def _adaptive_end(i: int, size: int, out: int) -> int:
    return -((-(i + 1) * size) // out)


@dataclass(frozen=True)
class _AdaptiveAxis:
    """One spatial dim of an adaptive pool on this rank."""

    axis: _Axis
    out: int  # global output size
    is_global: bool  # sharded with output size 1: reduce locally, then all-reduce


@eager_handler
def adaptive_pool_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Adaptive avg/max pooling (1-3 d) of a ShardTensor on uneven shards.

    Declared for every adaptive pool with ``patches.function(target, adaptive_pool_handler)``.
    """
    is_max = func in _ADAPTIVE_MAX or func in _ADAPTIVE_MAX_WITH_INDICES
    n = {**_ADAPTIVE_AVG, **_ADAPTIVE_MAX, **_ADAPTIVE_MAX_WITH_INDICES}[func]
    a = bind_arguments(_adaptive_max_pool if is_max else _adaptive_avg_pool, args, kwargs)
    x = a["input"]
    if not isinstance(x, ShardTensor) or _partial_delegated(func, x):
        return delegate(func, types, args, kwargs)  # checked on 2 ranks (see the module docstring)
    return_indices = is_max and (func in _ADAPTIVE_MAX_WITH_INDICES or bool(a["return_indices"]))
    meta_kwargs = {k: v for k, v in a.items() if k != "input"}
    meta_out = meta_output_shape(func, (x,), meta_kwargs)
    global_out_shape = meta_out if isinstance(meta_out, torch.Size) else meta_out[0]  # (values, indices)

    first = x.ndim - n
    spatial = {d: l for d, l in sharded_dims(x).items() if d >= first}
    ranges_by_dim: dict[int, list[tuple[int, int]]] = {}
    dims: list[_AdaptiveAxis] = []
    for i in range(n):
        d = first + i
        size, out = x.shape[d], global_out_shape[d]
        layout = spatial.get(d)
        if layout is not None and out == 1 and layout.parts > 1:
            axis = _Axis(d, None, None, 0, 1, 0, layout.local_size)  # own rows only, no exchange
            dims.append(_AdaptiveAxis(axis, out, True))
            continue
        if layout is None:
            j0, j1, out_sizes = 0, out, None
        else:
            ranges_by_dim[d] = split_rows_by_owner(layout, [_adaptive_start(j, size, out) for j in range(out)])
            j0, j1 = ranges_by_dim[d][layout.coord]
            out_sizes = tuple(b - a_ for a_, b in ranges_by_dim[d])
        lo, hi = (_adaptive_start(j0, size, out), _adaptive_end(j1 - 1, size, out)) if j1 > j0 else (0, 0)
        dims.append(_AdaptiveAxis(_Axis(d, layout, out_sizes, j0, j1, lo, hi), out, False))

    def rows_wanted(axis: _Axis, coord: int) -> tuple[int, int]:
        j0, j1 = ranges_by_dim[axis.dim][coord]
        size, out = x.shape[axis.dim], global_out_shape[axis.dim]
        return (_adaptive_start(j0, size, out), _adaptive_end(j1 - 1, size, out)) if j1 > j0 else (0, 0)

    win = _fetch(local_of(x), [ad.axis for ad in dims], rows_wanted)

    # Lay every output row's window out as one block of equal length M (short windows are
    # filled with a sentinel row appended at the end), so that one local pool with
    # kernel = stride = M computes them all with PyTorch's own reduction order and tie rule.
    fill = float("-inf") if is_max else 0.0
    blocks, block_len, block_rows = win, [], []
    for ad in dims:
        d, size, ax = ad.axis.dim, x.shape[ad.axis.dim], ad.axis
        if ad.is_global:
            rows = [list(range(win.shape[d]))]
            starts = [spatial[d].start]
        else:
            rows = [
                list(range(_adaptive_start(j, size, ad.out) - ax.lo, _adaptive_end(j, size, ad.out) - ax.lo))
                for j in range(ax.j0, ax.j1)
            ]
            starts = [_adaptive_start(j, size, ad.out) for j in range(ax.j0, ax.j1)]
        length = max([len(r) for r in rows] + [1])
        sentinel = blocks.shape[d]
        index = [r + [sentinel] * (length - len(r)) for r in rows]
        pad_shape = list(blocks.shape)
        pad_shape[d] = 1
        extended = torch.cat([blocks, blocks.new_full(pad_shape, fill)], d)
        flat_index = torch.tensor([v for r in index for v in r], dtype=torch.long, device=win.device)
        blocks = extended.index_select(d, flat_index)
        block_len.append(length)
        block_rows.append((starts, [len(r) for r in rows], length))

    out_shape = tuple(win.shape[:first]) + tuple(1 if ad.is_global else ad.axis.out_local for ad in dims)
    if blocks.numel() == 0 or 0 in out_shape:
        values = connected_zeros(blocks, out_shape)
        indices = torch.zeros(out_shape, dtype=torch.int64, device=win.device)
    elif is_max:
        values, local_idx = _LOCAL_MAX[n](blocks, block_len, block_len, 0, 1, False, return_indices=True)

        def to_global(starts: list[int], lengths: list[int], length: int) -> Callable[[torch.Tensor], torch.Tensor]:
            base = torch.tensor(starts, dtype=torch.long, device=win.device)
            valid = torch.tensor(lengths, dtype=torch.long, device=win.device)

            def convert(coord: torch.Tensor) -> torch.Tensor:
                row, offset = coord // length, coord % length
                # A sentinel (empty local share of a global dim) must lose every tie: push it out of range.
                return torch.where(offset < valid[row], base[row] + offset, torch.full_like(coord, -1))

            return convert

        indices = _global_flat_index(
            local_idx, blocks.shape[first:], [to_global(*r) for r in block_rows], x.shape[first:]
        )
        indices = torch.where(indices < 0, torch.full_like(indices, _INDEX_NONE), indices)
    else:
        values = _sum_pool(blocks, block_len, block_len)

    placements = list(placements_of(x))
    for ad in dims:
        if not ad.is_global:
            continue
        layout = spatial[ad.axis.dim]
        if is_max:
            values, indices = _global_max(values, indices, layout)
        else:
            values = sum_to_replicated(values, layout.mesh, [layout.mesh_dim])
        placements[layout.mesh_dim] = Replicate()
    if not is_max:
        values = values / _adaptive_divisor(x, dims, values)
    sizes = {ad.axis.dim: ad.axis.out_sizes for ad in dims if ad.axis.out_sizes is not None}
    result = from_local_like(values, x, sizes_by_tensor_dim=sizes, placements=placements)
    if return_indices:
        return result, from_local_like(indices, x, sizes_by_tensor_dim=sizes, placements=placements)
    return result


def _global_max(values: torch.Tensor, indices: torch.Tensor, layout: DimLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Max over the ranks along ``layout``'s mesh dim; ties go to the smallest global flat index (PyTorch's first max)."""
    over = [layout.mesh_dim]
    best = max_over(values, layout.mesh, over)
    tied = torch.where(values.detach() == best, indices, torch.full_like(indices, _INDEX_NONE))
    candidate = min_over(tied, layout.mesh, over)
    mine = (indices == candidate) & (values.detach() == best)
    # Only the winner contributes, so the gradient reaches exactly one element.
    winner = torch.where(mine, values, torch.zeros_like(values))
    return sum_to_replicated(winner, layout.mesh, [layout.mesh_dim]), candidate


def _adaptive_divisor(x: ShardTensor, dims: Sequence[_AdaptiveAxis], like: torch.Tensor) -> torch.Tensor:
    """Window lengths of this rank's output rows, multiplied over the spatial dims."""
    n = len(dims)
    divisor = None
    for i, ad in enumerate(dims):
        size = x.shape[ad.axis.dim]
        if ad.is_global:
            counts = [size]
        else:
            counts = [
                _adaptive_end(j, size, ad.out) - _adaptive_start(j, size, ad.out) for j in range(ad.axis.j0, ad.axis.j1)
            ]
        shape = [1] * n
        shape[i] = len(counts)
        vector = torch.tensor(counts, dtype=like.dtype, device=like.device).reshape(shape)
        divisor = vector if divisor is None else divisor * vector
    return divisor


# -- plugin hooks --------------------------------------------------------------------------------------
@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the pooling handlers (overriding PhysicsNeMo's max/avg pooling built-ins)."""
    for target in (*_MAX_POOLS, *_AVG_POOLS):
        patches.function(
            target,
            pool_handler,
            override=True,
            description=f"{describe_target(target)}: any kernel/stride/padding on uneven shards (window-overlap rows only)",
        )
    for target in _MAX_POOLS_WITH_INDICES:
        patches.function(target, pool_handler, description=f"{describe_target(target)}: global flat indices")
    for target in (*_ADAPTIVE_AVG, *_ADAPTIVE_MAX, *_ADAPTIVE_MAX_WITH_INDICES):
        patches.function(
            target,
            adaptive_pool_handler,
            description=f"{describe_target(target)}: adaptive windows; output size 1 on a sharded dim all-reduces",
        )
