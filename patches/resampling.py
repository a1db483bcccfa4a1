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
  Unsharded dims are resized by ``F.interpolate`` on the local block. ``area`` is
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

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

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
    local_of,
    meta_output_shape,
    require_shard_input,
    sharded_dims,
    split_rows_by_owner,
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


class _DimPlan(NamedTuple):
    """What one sharded dim's resampling needs besides the data; the same every step for one layer."""

    copies: bool  # every output row is its source row (weight 1): a plain copy
    ranges: list[tuple[int, int]]  # output rows of each coordinate
    wanted: list[range]  # input rows each coordinate fetches
    taps: list[tuple[torch.Tensor, torch.Tensor | None]]  # this rank's (index into its window, weight) per tap


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
    j0, j1 = ranges[coord]
    base = wanted[coord].start if j1 > j0 else 0
    shape = [1] * ndim
    shape[d] = j1 - j0
    taps = [
        ((rows[j0:j1, k] - base).to(device), None if mode in _NEAREST else weights[j0:j1, k].reshape(shape).to(device))
        for k in range(rows.shape[1])
    ]
    return _DimPlan(copies, ranges, wanted, taps)


def _resample_dim(
    local: torch.Tensor, layout: DimLayout, mode: str, out_size: int, scale: float | None, align_corners: bool
) -> tuple[torch.Tensor, list[int]]:
    """Interpolate along one sharded dim; returns the local result and the output rows per coordinate."""
    d = layout.tensor_dim
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
    )
    if mode in ("nearest", "bicubic") and out_size == layout.total and not plan.copies:
        # PyTorch's nearest (1-D/3-D) and bicubic kernels move rows here, but their backward
        # copies them: no sharded result can match both, so refuse rather than pick one.
        raise MissingShardPatch(
            f"torch.nn.functional.interpolate: mode={mode!r} with scale_factor={scale} keeps dim {d} at "
            f"size {out_size} but shifts rows, and PyTorch's own backward treats it as a copy (forward and "
            "backward disagree; PhysicsNeMo's built-in is wrong or fails here on uneven or empty shards); pass "
            "size= or scale_factor=1.0 for that dim"
        )
    window = gather_global_indices(local, layout, plan.wanted)
    out = None
    for index, weight in plan.taps:
        term = window.index_select(d, index)
        if weight is not None:
            term = term * weight
        out = term if out is None else out + term
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
    sizes: dict[int, list[int]] = {}
    for d, layout in sorted(spatial.items()):
        local, sizes[d] = _resample_dim(local, layout, mode, out_shape[d], scales[d - 2], align)
    rest = [d for d in range(2, x.ndim) if d not in spatial]
    if rest:
        final_shape = list(local.shape)
        for d in rest:
            final_shape[d] = out_shape[d]
        if local.numel() == 0:
            local = connected_zeros(local, final_shape)
        else:
            # Sharded dims are already resized: ask for an unchanged size there (PyTorch then copies rows).
            local_kwargs = {"mode": mode, "align_corners": a["align_corners"]}
            if use_scale:
                local_kwargs["scale_factor"] = [1.0 if d in spatial else scales[d - 2] for d in range(2, x.ndim)]
            else:
                local_kwargs["size"] = [local.shape[d] if d in spatial else out_shape[d] for d in range(2, x.ndim)]
            local = func(local, **local_kwargs)
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
