"""Strided, dilated, grouped and transposed convolutions on uneven shards.

PhysicsNeMo 2.2.2's conv patch (on ``F.conv1d/2d/3d`` and
``F.conv_transpose1d/2d/3d``) exchanges a fixed halo with the two neighbours
and predicts output shard sizes from the haloed input sizes. That is right for
stride-1 convolutions with odd kernels and "same" padding, but silently wrong
for strided convolutions on uneven shards (outputs, input and weight grads,
even the global shape), refuses even kernels and most transposed
convolutions, and raises ``IndexError`` on a mesh with a replicated mesh dim
(e.g. ``("ddp", "domain")`` with placements ``[Replicate(), Shard(2)]``).

This patch overrides it. A convolution sharded along **one** spatial dim (the
common case) runs without a haloed copy of the block (`strip_conv` in ``physicsnemo_shardext.primitives``): the
block is convolved as it is and only the few output rows next to its edges are
corrected with the halo rows, so per-rank memory is the block's and the output's,
as for a plain convolution of the block. Elsewhere (several sharded spatial dims,
autocast, a geometry the strips cannot start on) it delegates to the built-in
exactly where that is right (stride 1, odd kernel, symmetric "same" padding, every
mesh dim a ``Shard``, every shard at least a halo wide) and otherwise works per
sharded spatial dim, from global indices:

1. **Output rows per rank.** Output row ``o`` goes to the rank that holds the
   input row under its receptive field's *centre*: ``o*s - pad_left +
   d*(k-1)//2`` (convolution) or ``i*s - pad + d*(k-1)//2 = o`` for input row
   ``i`` (transposed). So a "same" conv keeps the input's split, a stride-2 conv
   halves it and a stride-2 transposed conv doubles it; other configurations
   give uneven output shards that fall out of the formula (e.g. a "valid" conv
   shrinks the last shard by ``d*(k-1) - d*(k-1)//2`` rows, the first by the rest).
2. **Input rows per rank.** Each rank fetches exactly the global input rows its
   output rows read (convolution: ``o*s - pad_left + t*d``; transposed: every
   ``i`` with ``i*s + t*d - pad`` in its range), with one
   `gather_global_indices` per sharded dim
   (halos wider than a tiny neighbour shard come from whoever owns the rows).
3. **Local op.** Convolution: zero-pad the rows beyond the global boundary and
   convolve with padding 0 along the sharded dims. Transposed: run
   ``conv_transpose`` with padding 0 / output_padding 0 along the sharded dims
   on the fetched rows, then crop (or zero-extend, where no input row reaches,
   e.g. ``output_padding`` rows) to this rank's output rows and add the bias.
   No boundary contribution is exchanged afterwards: a rank fetches the few
   input rows it needs instead of partial sums of output rows.

Several sharded spatial dims (2-D mesh) are fetched one after another; the
second fetch carries the first one's halo, so corners are right. Unsharded
spatial dims keep the caller's padding. Sharded batch dims need nothing.
Weight and bias gradients are partial sums over a rank's output rows; they are
summed over every mesh dim on which the input is sharded
(`sum_grad_over`, the contract of
PhysicsNeMo's ``GradReducer``), so they come back reduced and ``Replicate``; a
replicated mesh dim (``"ddp"`` with the batch replicated) is correctly left alone.

``Conv*d(padding_mode="circular" | "reflect" | "replicate")`` calls ``F.pad``
first, then this patch with padding 0: the periodic/mirrored halo comes from
the padding plugin (patches/padding.py).

Under ``torch.autocast`` the local convolution runs through autocast like a
single-process one (bf16 on CPU); the shape checks on meta tensors use the
autocast dtype, and a separately added bias is cast to the output's dtype.

Delegated to the built-in (`delegate`):
``Partial`` inputs without a bias (a convolution is linear: the built-in
convolves each rank's term; checked on 2 ranks).

Refused (``MissingShardPatch``): ``Partial`` inputs with a bias (the built-in
adds the bias once per rank: wrong); inputs sharded along the channel dim; a
ShardTensor weight sharded along a dim (weights must be plain tensors or replicated).

Examples:
    On 2 ranks (``mesh``, ``rank``), H = 17 split 10/7: a stride-2 conv halves the split.

    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-1, 1, 2 * 17 * 6).reshape(1, 2, 17, 6)
    >>> w = torch.linspace(-1, 1, 3 * 2 * 3 * 3).reshape(3, 2, 3, 3)
    >>> x = shard_tensor(full, mesh, [Shard(2)], [10, 7])
    >>> y = F.conv2d(x, w, stride=2, padding=1)       # H_out 9, shards 5/4
    >>> tuple(y.to_local().shape) == [(1, 3, 5, 3), (1, 3, 4, 3)][rank]
    True
    >>> torch.allclose(y.full_tensor(), F.conv2d(full, w, stride=2, padding=1), atol=1e-5)
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

from physicsnemo_shardext import MissingShardPatch, PatchSet, builtin_handler, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    conv_strip_geometry,
    delegate,
    describe_target,
    eager_handler,
    exchanging_strip_conv,
    expand_to,
    from_local_like,
    gather_global_indices,
    is_partial,
    local_of,
    mesh_of,
    meta_output_shape,
    placements_of,
    replicated_local,
    sharded_dims,
    sharding_mesh_dims,
    strip_conv,
    sum_grad_over,
    tie_to_graph,
)

__all__ = ["CONV_TARGETS", "TRANSPOSED_TARGETS", "RowPlan", "conv_row_plan", "conv_transpose_row_plan", "sharded_conv"]

CONV_TARGETS = (F.conv1d, F.conv2d, F.conv3d)
TRANSPOSED_TARGETS = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)


@dataclass(frozen=True)
class RowPlan:
    """For one sharded dim: output rows of each coordinate and the input rows it reads.

    Attributes:
        out_starts: first global output row of each coordinate (plus the total at the end).
        rows: per coordinate, the global input rows to fetch (in order).
        before: per coordinate, rows to add (>0, zeros) or crop (<0) before the local result.
        after: per coordinate, the same after it.
    """

    out_starts: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]
    before: tuple[int, ...]
    after: tuple[int, ...]

    def out_sizes(self) -> list[int]:
        """Output rows of each coordinate."""
        return [b - a for a, b in zip(self.out_starts[:-1], self.out_starts[1:])]


def _clip(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


def _starts(offsets: Sequence[int], total_out: int, anchor: Callable[[int], int]) -> list[int]:
    """Output start of each coordinate: the first output row whose anchor input row is in its range."""
    starts = [0] + [_clip(anchor(off), 0, total_out) for off in offsets[1:]] + [total_out]
    for c in range(1, len(starts)):  # keep them monotone (empty shards, clipping)
        starts[c] = max(starts[c], starts[c - 1])
    return starts


def conv_row_plan(sizes: Sequence[int], k: int, stride: int, dilation: int, pad_left: int, total_out: int) -> RowPlan:
    """Row plan of a convolution along one sharded dim.

    Examples:
        >>> plan = conv_row_plan([10, 7], k=4, stride=2, dilation=1, pad_left=1, total_out=8)
        >>> plan.out_sizes(), plan.rows[1], plan.before, plan.after
        ([5, 3], (9, 10, 11, 12, 13, 14, 15, 16), (1, 0), (0, 0))
    """
    # Cached: a layer asks for the same plan every step, and building it walks every row.
    return _conv_row_plan(
        tuple(int(s) for s in sizes), int(k), int(stride), int(dilation), int(pad_left), int(total_out)
    )


@functools.lru_cache(maxsize=1024)
def _conv_row_plan(
    sizes: tuple[int, ...], k: int, stride: int, dilation: int, pad_left: int, total_out: int
) -> RowPlan:
    offsets = [sum(sizes[:c]) for c in range(len(sizes))]
    total_in, reach = sum(sizes), dilation * (k - 1)
    # Output o covers input rows o*s - pad_left + [0, reach]; it belongs to whoever holds its centre.
    starts = _starts(offsets, total_out, lambda off: -((reach // 2 - pad_left - off) // stride))
    rows, before, after = [], [], []
    for c in range(len(sizes)):
        o0, o1 = starts[c], starts[c + 1]
        if o1 <= o0:
            rows.append(()), before.append(0), after.append(0)
            continue
        first, last = o0 * stride - pad_left, (o1 - 1) * stride - pad_left + reach
        fetched = tuple(range(max(first, 0), min(last, total_in - 1) + 1))
        zeros_before = min(max(0, -first), last - first + 1)
        rows.append(fetched), before.append(zeros_before)
        after.append(last - first + 1 - zeros_before - len(fetched))
    return RowPlan(tuple(starts), tuple(rows), tuple(before), tuple(after))


def conv_transpose_row_plan(
    sizes: Sequence[int], k: int, stride: int, dilation: int, padding: int, total_out: int
) -> RowPlan:
    """Row plan of a transposed convolution along one sharded dim.

    ``before``/``after`` adjust the local result of a padding-0 ``conv_transpose`` on
    the fetched rows to this coordinate's output rows (negative: crop).

    Examples:
        >>> plan = conv_transpose_row_plan([5, 4], k=3, stride=2, dilation=1, padding=1, total_out=18)
        >>> plan.out_sizes(), plan.rows, plan.before, plan.after
        ([10, 8], ((0, 1, 2, 3, 4, 5), (5, 6, 7, 8)), (-1, -1), (-2, 0))
    """
    return _conv_transpose_row_plan(
        tuple(int(s) for s in sizes), int(k), int(stride), int(dilation), int(padding), int(total_out)
    )


@functools.lru_cache(maxsize=1024)
def _conv_transpose_row_plan(
    sizes: tuple[int, ...], k: int, stride: int, dilation: int, padding: int, total_out: int
) -> RowPlan:
    offsets = [sum(sizes[:c]) for c in range(len(sizes))]
    total_in, reach = sum(sizes), dilation * (k - 1)
    # Input i spreads to uncropped rows i*s + [0, reach]; its centre lands on output i*s - padding + reach//2.
    starts = _starts(offsets, total_out, lambda off: off * stride - padding + reach // 2)
    rows, before, after = [], [], []
    for c in range(len(sizes)):
        u0, u1 = starts[c] + padding, starts[c + 1] + padding  # this coordinate's rows, uncropped frame
        lo = max(0, -((reach - u0) // stride))  # ceil((u0 - reach) / s)
        hi = min(total_in - 1, (u1 - 1) // stride)
        if u1 <= u0 or hi < lo:
            rows.append(()), before.append(u1 - u0), after.append(0)  # nothing reaches: all zeros (+bias)
            continue
        rows.append(tuple(range(lo, hi + 1)))
        local_stop = lo * stride + (hi - lo) * stride + reach + 1
        before.append(lo * stride - u0)
        after.append(u1 - local_stop)
    return RowPlan(tuple(starts), tuple(rows), tuple(before), tuple(after))


# -- argument handling ---------------------------------------------------------------------------
# Mirrors of the C builtins' parameters (F.conv*d have no introspectable signature).
def _conv(
    input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1
) -> None:
    """The parameters of ``F.conv1d/2d/3d``."""


def _conv_transpose(
    input: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    groups: int = 1,
    dilation: Any = 1,
) -> None:
    """The parameters of ``F.conv_transpose1d/2d/3d``."""


def _ints(value: Any, n: int, what: str, op: str) -> tuple[int, ...]:
    """``value`` as ``n`` Python ints (SymInts included)."""
    return tuple(int(v) for v in expand_to(value, n, what=what, op=op))


def _autocast_dtype(x: ShardTensor) -> torch.dtype | None:
    """The dtype autocast gives a convolution of ``x``'s local block, or ``None`` outside autocast."""
    device_type = local_of(x).device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _pads(padding: Any, weight: torch.Tensor, dilation: tuple[int, ...], n: int, op: str) -> list[tuple[int, int]]:
    """(left, right) zero padding per spatial dim; 'same' may be asymmetric (extra row on the right)."""
    if isinstance(padding, str):
        if padding == "same":
            totals = [dilation[i] * (weight.shape[2 + i] - 1) for i in range(n)]
            return [(t // 2, t - t // 2) for t in totals]
        return [(0, 0)] * n  # "valid" (other strings are refused before)
    return [(p, p) for p in _ints(padding, n, "padding", op)]


def _can_delegate(x: ShardTensor, layouts: dict[int, DimLayout], weight, stride, dilation, pads, transposed) -> bool:
    """Is this a case PhysicsNeMo's built-in conv patch gets right (stride-1 'same' halo conv)?"""
    if transposed or not all(p.is_shard() for p in placements_of(x)):
        return False  # it indexes mesh sizes by sharded mesh dims only (IndexError with Replicate dims)
    for d, layout in layouts.items():
        if d < 2:
            continue
        i = d - 2
        k, halo = weight.shape[d], dilation[i] * (weight.shape[d] - 1) // 2
        if k % 2 == 0 or stride[i] != 1 or pads[i] != (halo, halo) or layout.parts < 2:
            return False
        if min(layout.sizes) < max(halo, 1):
            return False  # its neighbour halo exchange cannot reach past a shard narrower than the halo
    return True


@eager_handler
def sharded_conv(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Convolution / transposed convolution on a ShardTensor (see the module docstring).

    Declared for every target of ``CONV_TARGETS`` and ``TRANSPOSED_TARGETS`` with
    ``patches.function(target, sharded_conv, override=True)``.
    """
    op = describe_target(func)
    transposed = func in TRANSPOSED_TARGETS
    a = bind_arguments(_conv_transpose if transposed else _conv, args, kwargs)
    x, padding, groups = a["input"], a["padding"], a["groups"]
    weight, bias = replicated_local(a["weight"], f"{op}: weight"), replicated_local(a["bias"], f"{op}: bias")
    if not isinstance(x, ShardTensor):
        raise MissingShardPatch(f"{op}: the input must be the ShardTensor (got {type(x).__name__})")
    placements = placements_of(x)
    if is_partial(x):
        if bias is None:  # a convolution is linear: the built-in convolves each rank's term, right
            return delegate(func, types, args, kwargs)
        raise MissingShardPatch(
            f"{op}: input has a Partial placement {placements} and a bias; the built-in would add "
            "the bias once per rank (redistribute first)"
        )
    if isinstance(padding, str) and padding not in ("valid", "same"):
        raise ValueError(f"{op}: invalid padding string {padding!r}")
    if transposed and isinstance(padding, str):
        raise ValueError(f"{op}: string padding is not supported for transposed convolutions")

    # torch's own argument checks (on the arguments as given) and the global output shape, on meta
    # tensors. Autocast does not run on the meta device: there the arguments take the dtype autocast
    # gives the local conv.
    dtype = _autocast_dtype(x)
    if transposed:
        meta_args = (x, weight, bias, a["stride"], padding, a["output_padding"], groups, a["dilation"])
    else:
        meta_args = (x, weight, bias, a["stride"], padding, a["dilation"], groups)
    global_shape = meta_output_shape(func, meta_args, dtype=dtype)
    n = weight.ndim - 2
    stride, dilation = _ints(a["stride"], n, "stride", op), _ints(a["dilation"], n, "dilation", op)
    output_padding = _ints(a.get("output_padding", 0), n, "output_padding", op)
    pads = _pads(padding, weight, dilation, n, op)

    layouts = sharded_dims(x)
    if 1 in layouts:
        raise MissingShardPatch(f"{op}: input sharded along the channel dim ({placements}) is not supported")
    spatial = {d: layout for d, layout in layouts.items() if d >= 2}
    strips = not transposed and dtype is None and _strips_apply(spatial, pads)
    if not strips and spatial and _can_delegate(x, layouts, weight, stride, dilation, pads, transposed):
        builtin = builtin_handler(func)
        if builtin is not None:
            return builtin(func, types, args, kwargs)

    # Weight/bias gradients are partial sums over this rank's rows: reduce over the sharded mesh dims.
    mesh_dims = sharding_mesh_dims(x)
    weight = sum_grad_over(weight, mesh_of(x), mesh_dims)
    if bias is not None:
        bias = sum_grad_over(bias, mesh_of(x), mesh_dims)
    if strips:
        return _strip_path(func, x, spatial, weight, bias, stride, dilation, pads, groups, global_shape)

    local = local_of(x)
    new_sizes: dict[int, list[int]] = {}
    adjust: dict[int, tuple[int, int]] = {}
    empty = False
    for d, layout in spatial.items():
        i = d - 2
        k = weight.shape[d]
        if transposed:
            plan = conv_transpose_row_plan(layout.sizes, k, stride[i], dilation[i], pads[i][0], global_shape[d])
        else:
            plan = conv_row_plan(layout.sizes, k, stride[i], dilation[i], pads[i][0], global_shape[d])
        local = _fetch_plan_rows(local, layout, plan.rows)
        me = layout.coord
        new_sizes[d] = plan.out_sizes()
        empty |= not plan.rows[me] if transposed else new_sizes[d][me] == 0
        adjust[d] = (plan.before[me], plan.after[me])

    shape = list(global_shape)
    shape[0] = local.shape[0]
    for d, sizes in new_sizes.items():
        shape[d] = sizes[layouts[d].coord]
    if empty or local.shape[0] == 0:
        out = local.new_zeros(shape, dtype=dtype or local.dtype)
        if bias is not None:
            out = out + bias.view([1, -1] + [1] * n).to(out.dtype)
        out = tie_to_graph(out, local, weight, bias)
    elif transposed:
        out = _local_conv_transpose(func, local, weight, bias, stride, pads, output_padding, groups, dilation, adjust)
    else:
        out = _local_conv(func, local, weight, bias, stride, pads, groups, dilation, adjust)
    assert list(out.shape) == shape, f"{op}: local result {tuple(out.shape)} != planned {tuple(shape)}"
    return from_local_like(out, x, sizes_by_tensor_dim=new_sizes)


def _fetch_plan_rows(local: torch.Tensor, layout: DimLayout, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """The plan's input rows; the block itself, not a copy, where every coordinate reads just its own rows.

    A transposed convolution with ``kernel == stride`` (a UNet's up-sampling) and a
    1x1 convolution need no halo: no rank would receive a row, so the exchange would
    only copy the block. The convolution's output is a new tensor either way.
    """
    own = all(
        tuple(rows[c]) == tuple(range(layout.offsets[c], layout.offsets[c] + layout.sizes[c]))
        for c in range(layout.parts)
    )
    return local if own else gather_global_indices(local, layout, rows)


def _strips_apply(spatial: dict[int, DimLayout], pads: list[tuple[int, int]]) -> bool:
    """Can the halo-strip path run: one sharded spatial dim, symmetric padding on the others?"""
    if len(spatial) != 1:
        return False  # several sharded dims: the general path fetches them one after another (corners)
    (d,) = spatial
    return all(left == right for i, (left, right) in enumerate(pads) if i + 2 != d)


def _strip_path(func, x, spatial, weight, bias, stride, dilation, pads, groups, global_shape) -> ShardTensor:
    """One sharded dim: fetch only the halo rows; interior from the block, edges from strips (`strip_conv`)."""
    ((d, layout),) = spatial.items()
    i = d - 2
    k = weight.shape[d]
    plan = conv_row_plan(layout.sizes, k, stride[i], dilation[i], pads[i][0], global_shape[d])
    geometries = [
        conv_strip_geometry(layout.sizes, c, plan.out_starts, k, stride[i], dilation[i], pads[i][0])
        for c in range(layout.parts)
    ]
    # A coordinate whose bands do not fit its block fetches all its rows, as the general path does.
    wanted = [g.halo_rows if g is not None else plan.rows[c] for c, g in enumerate(geometries)]
    local = local_of(x)
    me = layout.coord
    g = geometries[me]
    padding = [left for left, _ in pads]
    if all(geometries) and local.shape[0] > 0:  # every rank: one exchange inside one autograd Function
        adjust = {d: (plan.before[me], plan.after[me])}

        def haloed(local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            rows = gather_global_indices(local, layout, plan.rows)  # the general path, for create_graph
            return _local_conv(func, rows, weight, bias, stride, pads, groups, dilation, adjust)

        out = exchanging_strip_conv(
            func, local, layout, wanted, weight, bias, g, stride, padding, dilation, groups, recompute=haloed
        )
        return from_local_like(out, x, sizes_by_tensor_dim={d: plan.out_sizes()})
    fetched = gather_global_indices(local, layout, wanted)
    new_sizes = {d: plan.out_sizes()}
    shape = list(global_shape)
    shape[0] = local.shape[0]
    shape[d] = new_sizes[d][me]
    if shape[d] == 0 or local.shape[0] == 0:
        out = tie_to_graph(local.new_zeros(shape), fetched, local, weight, bias)
        if bias is not None:
            out = out + bias.view([1, -1] + [1] * (weight.ndim - 2))
    elif g is None:
        out = _local_conv(
            func, fetched, weight, bias, stride, pads, groups, dilation, {d: (plan.before[me], plan.after[me])}
        )
    else:
        out = strip_conv(func, local, fetched, weight, bias, g, d, stride, padding, dilation, groups)
    assert list(out.shape) == shape, (
        f"{describe_target(func)}: local result {tuple(out.shape)} != planned {tuple(shape)}"
    )
    return from_local_like(out, x, sizes_by_tensor_dim=new_sizes)


def _local_conv(func, local, weight, bias, stride, pads, groups, dilation, adjust) -> torch.Tensor:
    """Zero-pad global boundaries (sharded dims) and asymmetric pads, then convolve."""
    n = weight.ndim - 2
    extra = {d: adjust[d] for d in adjust}  # sharded: boundary zeros
    conv_padding = []
    for i in range(n):
        d = i + 2
        left, right = pads[i]
        if d in adjust:
            conv_padding.append(0)
        elif left == right:
            conv_padding.append(left)
        else:
            extra[d] = (left, right)
            conv_padding.append(0)
    if any(lr != (0, 0) for lr in extra.values()):
        flat: list[int] = []
        for d in range(local.ndim - 1, 1, -1):
            flat.extend(extra.get(d, (0, 0)))
        local = F.pad(local, flat)
    return func(local, weight, bias, stride, conv_padding, dilation, groups)


def _local_conv_transpose(
    func, local, weight, bias, stride, pads, output_padding, groups, dilation, adjust
) -> torch.Tensor:
    """conv_transpose with padding 0 on sharded dims, cropped/extended to this rank's rows, plus bias."""
    n = weight.ndim - 2
    padding = [0 if i + 2 in adjust else pads[i][0] for i in range(n)]
    out_pad = [0 if i + 2 in adjust else output_padding[i] for i in range(n)]
    out = func(local, weight, None, stride, padding, out_pad, groups, dilation)
    flat: list[int] = []
    for d in range(out.ndim - 1, 1, -1):
        flat.extend(adjust.get(d, (0, 0)))
    out = F.pad(out, flat)  # negative entries crop
    if bias is not None:  # in the conv's dtype, as autocast casts the bias of a fused conv
        out = out + bias.view([1, -1] + [1] * n).to(out.dtype)
    return out


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Replace PhysicsNeMo's conv patch on every target it registers; delegate where it is right."""
    for target in CONV_TARGETS + TRANSPOSED_TARGETS:
        patches.function(
            target,
            sharded_conv,
            override=True,
            description=f"{describe_target(target)} on uneven shards (any stride/dilation/padding); built-in for stride-1 'same'",
        )
