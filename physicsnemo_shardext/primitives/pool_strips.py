"""Max and average pooling along one sharded dim without a haloed copy of the block.

The general path of the first-party pooling family fetches every input row a rank's windows
read, its own included, pads the global boundary into yet another copy and pools
that. Here, as for the convolution (`conv_strips`), the block is
pooled as it is, padded by ``q`` rows so that its first output row is this rank's
first. The output rows whose window reaches past the block's edges are then
*replaced* (a maximum is not linear, and an average's divisor near the block's
edge counts the main pool's padding, so neither can be corrected by addition) by
the pool of a small strip: the halo rows and the block's edge rows.

Autograd saves the block (no copy), the halo rows and, for a max pool, the main
pool's indices (as a single-process max pool saves its indices). The backward first
forms the strips' gradients and starts sending the halo rows' back to their owners,
then runs the main pool's backward on the whole output gradient (one block-sized
buffer, no copy of the output gradient), takes the replaced rows' share back out
of the edge rows (recomputed on a sub-block of a few rows), adds the strips' edge
rows into it, and finally the returned halo gradients. It is built from
differentiable ops, so second-order gradients work as for a plain pool.

`pool_strip_geometry` decides per coordinate from global sizes only, so every rank
agrees on the exchange. It returns ``None`` (the general path) where a strip would
mix real rows with the global boundary's padding, reach past a narrow block, or
where the main pool would need more padding than torch allows (``kernel // 2``).

Examples:
    ``max_pool2d(x, 3, stride=2, padding=1)`` over rows split 10/7 (output rows 5/4):
    rank 1's main pool pads one row; its first output row's window (rows 9..11)
    replaces it from halo row 9 and block rows 10..11.

    >>> g = pool_strip_geometry(sizes=(10, 7), coord=1, out_range=(5, 9), kernel=3, stride=2, padding=1)
    >>> g.q, g.top_halo, g.top_outputs, g.top_edge, g.bottom_outputs
    (1, range(9, 10), 1, 2, 0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401 - the examples (doctests) use it

from physicsnemo_shardext.primitives.index_exchange import plan_exchange, start_fetch_rows, start_return_rows
from physicsnemo_shardext.primitives.layout import DimLayout

__all__ = [
    "AvgOptions",
    "PoolStrips",
    "exchanging_strip_avg_pool",
    "exchanging_strip_max_pool",
    "pool_strip_geometry",
    "strip_avg_pool",
    "strip_max_pool",
]


@dataclass(frozen=True)
class PoolStrips:
    """One coordinate's main pool and replaced edge rows, along the sharded dim.

    Attributes:
        q: rows of padding of the main pool, on both sides of the block.
        outputs: this coordinate's output rows (the main pool's first rows).
        top_halo: global rows fetched from the ranks before.
        top_outputs: the first output rows, replaced from the top strip.
        top_edge: the block's first rows in the top strip.
        bottom_start: the block row the bottom strip starts at.
        bottom_halo: global rows fetched from the ranks after.
        bottom_outputs: the last output rows, replaced from the bottom strip.
    """

    q: int
    outputs: int
    top_halo: range
    top_outputs: int
    top_edge: int
    bottom_start: int
    bottom_halo: range
    bottom_outputs: int

    @property
    def halo_rows(self) -> tuple[int, ...]:
        """The global rows this coordinate fetches: the top halo, then the bottom halo."""
        return tuple(self.top_halo) + tuple(self.bottom_halo)


def pool_strip_geometry(
    sizes: Sequence[int], coord: int, out_range: tuple[int, int], kernel: int, stride: int, padding: int
) -> PoolStrips | None:
    """Coordinate ``coord``'s geometry (output rows ``out_range``), or ``None`` for the general path.

    Examples:
        A 2-row block under a kernel-5 window: its strips would reach past it.

        >>> pool_strip_geometry((10, 2, 10), 1, (10, 12), kernel=5, stride=1, padding=2) is None
        True
    """
    return _geometry(
        tuple(int(s) for s in sizes),
        int(coord),
        (int(out_range[0]), int(out_range[1])),
        int(kernel),
        int(stride),
        int(padding),
    )


@functools.lru_cache(maxsize=4096)
def _geometry(
    sizes: tuple[int, ...], coord: int, out_range: tuple[int, int], kernel: int, stride: int, padding: int
) -> PoolStrips | None:
    total, size = sum(sizes), sizes[coord]
    b0 = sum(sizes[:coord])
    b1 = b0 + size
    o0, o1 = out_range
    outputs = o1 - o0
    if outputs <= 0 or size == 0:
        return None

    def start(o: int) -> int:
        return o * stride - padding

    q = b0 - start(o0)
    main_rows = (size + 2 * q - kernel) // stride + 1 if size + 2 * q >= kernel else 0
    if q < 0 or q > kernel // 2 or main_rows < outputs:
        return None
    if b0 == 0:  # the main pool's padding is the global padding: nothing to replace
        top_outputs, top_edge = 0, 0
    else:
        if b0 - q < 0:
            return None  # the window mixes rows of earlier ranks with the global padding
        top_outputs = min(max(0, -(-(b0 + padding) // stride) - o0), outputs)
        top_edge = start(o0 + top_outputs - 1) + kernel - b0 if top_outputs else 0
    last = start(o1 - 1) + kernel - 1
    if b1 == total or last < b1:
        bottom_outputs, bottom_start = 0, size
    else:
        if last > total - 1:
            return None
        first = min(max(o0, -(-(b1 + padding - kernel + 1) // stride)), o1)
        bottom_outputs, bottom_start = o1 - first, start(first) - b0
    if top_edge > size or bottom_start < 0:
        return None
    return PoolStrips(
        q=q,
        outputs=outputs,
        top_halo=range(b0 - q, b0) if top_outputs else range(b0, b0),
        top_outputs=top_outputs,
        top_edge=top_edge,
        bottom_start=bottom_start,
        bottom_halo=range(b1, last + 1) if bottom_outputs else range(b1, b1),
        bottom_outputs=bottom_outputs,
    )


_MAX_POOLS = {2: torch.ops.aten.max_pool2d_with_indices, 3: torch.ops.aten.max_pool3d_with_indices}
_MAX_POOL_BACKWARDS = {
    2: torch.ops.aten.max_pool2d_with_indices_backward,
    3: torch.ops.aten.max_pool3d_with_indices_backward,
}
_AVG_POOLS = {2: torch.ops.aten.avg_pool2d, 3: torch.ops.aten.avg_pool3d}
_AVG_POOL_BACKWARDS = {2: torch.ops.aten.avg_pool2d_backward, 3: torch.ops.aten.avg_pool3d_backward}


@dataclass(frozen=True)
class AvgOptions:
    """An average pool's divisor options (``None`` in `strip_max_pool`'s place: a max pool).

    Attributes:
        count_include_pad: whether the padding counts in the divisor.
        divisor_override: a fixed divisor, or ``None``.
    """

    count_include_pad: bool = True
    divisor_override: int | None = None


@dataclass(frozen=True)
class _PoolArgs:
    n: int
    dim: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]  # the main pool's: q along the sharded dim
    avg: AvgOptions | None = None  # None: a max pool

    @property
    def strip_padding(self) -> list[int]:
        return [0 if i + 2 == self.dim else p for i, p in enumerate(self.padding)]

    def pool(self, x: torch.Tensor, padding: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pool's values, and its indices for a max pool (``None`` for an average)."""
        kernel, stride = list(self.kernel), list(self.stride)
        if self.avg is not None:
            avg = self.avg
            values = _AVG_POOLS[self.n](
                x, kernel, stride, list(padding), False, avg.count_include_pad, avg.divisor_override
            )
            return values, None
        values, indices = _MAX_POOLS[self.n](x, kernel, stride, list(padding), [1] * self.n, False)
        return values, indices

    def pool_backward(
        self, grad: torch.Tensor, x: torch.Tensor, padding: Sequence[int], indices: torch.Tensor | None
    ) -> torch.Tensor:
        kernel, stride = list(self.kernel), list(self.stride)
        grad_input: torch.Tensor
        if self.avg is not None:
            avg = self.avg
            backward = _AVG_POOL_BACKWARDS[self.n]
            grad_input = backward(
                grad, x, kernel, stride, list(padding), False, avg.count_include_pad, avg.divisor_override
            )
            return grad_input
        grad_input = _MAX_POOL_BACKWARDS[self.n](grad, x, kernel, stride, list(padding), [1] * self.n, False, indices)
        return grad_input


def _strips(
    local: torch.Tensor, top: torch.Tensor, bottom: torch.Tensor, g: PoolStrips, d: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The top and bottom strips (halo rows and the block's edge rows), ``None`` where no row is replaced."""
    size = local.shape[d]
    top_strip = torch.cat([top, local.narrow(d, 0, g.top_edge)], d) if g.top_outputs else None
    bottom_strip = (
        torch.cat([local.narrow(d, g.bottom_start, size - g.bottom_start), bottom], d) if g.bottom_outputs else None
    )
    return top_strip, bottom_strip


def _pool_forward(
    local: torch.Tensor, top: torch.Tensor, bottom: torch.Tensor, g: PoolStrips, args: _PoolArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The main pool of the block with its edge rows replaced from the strips; its values and indices."""
    values, indices = _main_pool(local, g, args)
    _replace_edges(values, local, top, bottom, g, args)
    return values, indices


def _main_pool(local: torch.Tensor, g: PoolStrips, args: _PoolArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block pooled as it is, padded by ``g.q`` rows: this rank's rows (edge rows still wrong), and a max pool's indices of every main row."""
    d = args.dim
    values, indices = args.pool(local, args.padding)
    if values.shape[d] != g.outputs:  # the indices keep every main row: the backward's shape, no copy
        values = values.narrow(d, 0, g.outputs).contiguous()
    return values, indices


def _replace_edges(
    values: torch.Tensor, local: torch.Tensor, top: torch.Tensor, bottom: torch.Tensor, g: PoolStrips, args: _PoolArgs
) -> None:
    """Replace the output rows whose windows reach past the block by the pools of the strips, in place."""
    d = args.dim
    top_strip, bottom_strip = _strips(local, top, bottom, g, d)
    if top_strip is not None:
        values.narrow(d, 0, g.top_outputs).copy_(args.pool(top_strip, args.strip_padding)[0])
    if bottom_strip is not None:
        values.narrow(d, g.outputs - g.bottom_outputs, g.bottom_outputs).copy_(
            args.pool(bottom_strip, args.strip_padding)[0]
        )


def _pool_backward(
    grad: torch.Tensor,
    saved: tuple[torch.Tensor | None, ...],
    g: PoolStrips,
    args: _PoolArgs,
    halo_grads_ready: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the block and of the top and bottom halo rows.

    The strips' gradients come first and the halo rows' are handed to ``halo_grads_ready``
    (which may start sending them) before the block's own is computed.
    """
    local, top, bottom, indices = saved
    assert local is not None and top is not None and bottom is not None
    d = args.dim
    size = local.shape[d]
    top_strip, bottom_strip = _strips(local, top, bottom, g, d)
    grad_top, grad_bottom = torch.zeros_like(top), torch.zeros_like(bottom)
    top_edge = bottom_edge = None
    if top_strip is not None:
        strip_indices = args.pool(top_strip.detach(), args.strip_padding)[1]
        strip_grad = args.pool_backward(grad.narrow(d, 0, g.top_outputs), top_strip, args.strip_padding, strip_indices)
        grad_top, top_edge = strip_grad.narrow(d, 0, top.shape[d]), strip_grad.narrow(d, top.shape[d], g.top_edge)
    if bottom_strip is not None:
        strip_indices = args.pool(bottom_strip.detach(), args.strip_padding)[1]
        rows = grad.narrow(d, g.outputs - g.bottom_outputs, g.bottom_outputs)
        strip_grad = args.pool_backward(rows, bottom_strip, args.strip_padding, strip_indices)
        edge_rows = size - g.bottom_start
        bottom_edge, grad_bottom = strip_grad.narrow(d, 0, edge_rows), strip_grad.narrow(d, edge_rows, bottom.shape[d])
    if halo_grads_ready is not None:
        halo_grads_ready(grad_top, grad_bottom)
    main_rows = (size + 2 * g.q - args.kernel[d - 2]) // args.stride[d - 2] + 1
    bottom_sub = _bottom_sub_start(g, args)
    if main_rows == g.outputs and bottom_sub is not None:
        # The main pool's backward of the whole output gradient, then the replaced rows'
        # share taken back out of the edge rows: no output-sized buffer.
        grad_local = args.pool_backward(grad, local, args.padding, indices)
        if g.top_outputs:
            rows = grad.narrow(d, 0, g.top_outputs)
            grad_local.narrow(d, 0, g.top_edge).sub_(_main_rows_backward(rows, local, 0, g.top_edge, 0, args))
        if g.bottom_outputs:
            rows = grad.narrow(d, g.outputs - g.bottom_outputs, g.bottom_outputs)
            first = (g.outputs - g.bottom_outputs) * args.stride[d - 2] - g.q - (bottom_sub - g.q)
            wrong = _main_rows_backward(rows, local, bottom_sub, size, first // args.stride[d - 2], args)
            grad_local.narrow(d, bottom_sub, size - bottom_sub).sub_(wrong)
    else:
        # The replaced rows take no gradient through the main pool, nor do the main pool's
        # rows past this rank's last: one zeroed buffer with the kept rows copied in.
        shape = list(grad.shape)
        shape[d] = main_rows
        main_grad = grad.new_zeros(shape)
        kept = g.outputs - g.top_outputs - g.bottom_outputs
        main_grad.narrow(d, g.top_outputs, kept).copy_(grad.narrow(d, g.top_outputs, kept))
        grad_local = args.pool_backward(main_grad, local, args.padding, indices)
    if top_edge is not None:
        grad_local.narrow(d, 0, g.top_edge).add_(top_edge)
    if bottom_edge is not None:
        grad_local.narrow(d, g.bottom_start, size - g.bottom_start).add_(bottom_edge)
    return grad_local, grad_top, grad_bottom


def _bottom_sub_start(g: PoolStrips, args: _PoolArgs) -> int | None:
    """The block row a sub-block for the bottom replaced rows starts at, or ``None`` where none fits.

    The sub-block is pooled with the main pool's padding ``q``, which masks its own first
    ``q`` rows; it starts a whole number of strides early enough that the replaced rows'
    windows (from ``first``) lie past that mask and keep the main pool's alignment.
    """
    if not g.bottom_outputs:
        return 0
    s = args.stride[args.dim - 2]
    first = (g.outputs - g.bottom_outputs) * s - g.q  # the first replaced window's start, in block rows
    start = first + g.q - -(-g.q // s) * s
    return start if start >= 0 else None


def _main_rows_backward(
    rows_grad: torch.Tensor, local: torch.Tensor, start: int, stop: int, first_row: int, args: _PoolArgs
) -> torch.Tensor:
    """What the main pool's output rows (``rows_grad``, from the sub-block's output row ``first_row``) give block rows ``start:stop``.

    The main pool's backward restricted to a few rows: the sub-block ``local[start:stop]``
    pooled with the main pool's padding has the main pool's windows for those rows.
    """
    d = args.dim
    sub = local.narrow(d, start, stop - start)
    values, indices = args.pool(sub.detach(), args.padding)
    shape = list(values.shape)
    sub_grad = rows_grad.new_zeros(shape)
    sub_grad.narrow(d, first_row, rows_grad.shape[d]).copy_(rows_grad)
    return args.pool_backward(sub_grad, sub, args.padding, indices)


class _StripPool(torch.autograd.Function):
    """Main (max or average) pool of the block with its edge rows replaced from the strips."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, top: torch.Tensor, bottom: torch.Tensor, g: PoolStrips, args: _PoolArgs
    ) -> torch.Tensor:
        values, indices = _pool_forward(local, top, bottom, g, args)
        ctx.g, ctx.args = g, args
        ctx.save_for_backward(local, top, bottom, indices)
        return values

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (*_pool_backward(grad, ctx.saved_tensors, ctx.g, ctx.args), None, None)


class _ExchangingStripPool(torch.autograd.Function):
    """`_StripPool` that fetches its halo rows itself (see `exchanging_strip_max_pool`)."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        g: PoolStrips,
        args: _PoolArgs,
        layout: DimLayout,
        wanted: tuple[tuple[int, ...], ...],
        recompute: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        finish = start_fetch_rows(local, layout, plan_exchange(layout, wanted))  # travels while the block pools
        values, indices = _main_pool(local, g, args)
        halo = finish()
        top = halo.narrow(args.dim, 0, len(g.top_halo))
        bottom = halo.narrow(args.dim, len(g.top_halo), len(g.bottom_halo))
        _replace_edges(values, local, top, bottom, g, args)
        ctx.g, ctx.args, ctx.layout, ctx.wanted, ctx.recompute = g, args, layout, wanted, recompute
        ctx.save_for_backward(local, top, bottom, indices)
        return values

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        local, top, bottom, indices = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiate the caller's recomputation
            with torch.enable_grad():
                out = ctx.recompute(local)
            (grad_local,) = torch.autograd.grad(out, local, grad, create_graph=True)
            return grad_local, None, None, None, None, None
        finish: list[Callable[[torch.Tensor], None]] = []

        def send_halo_grads(grad_top: torch.Tensor, grad_bottom: torch.Tensor) -> None:
            # They travel back to their owners while the block's gradient is computed.
            halo_grad = torch.cat([grad_top, grad_bottom], ctx.args.dim)
            finish.append(start_return_rows(halo_grad, ctx.layout, plan_exchange(ctx.layout, ctx.wanted)))

        grad_local, _, _ = _pool_backward(grad, (local, top, bottom, indices), ctx.g, ctx.args, send_halo_grads)
        finish[0](grad_local)
        return grad_local, None, None, None, None, None


# Bound once, typed loosely: Function.apply is untyped before torch 2.14 (mypy --strict on every lane).
_strip_pool_apply: Callable[..., Any] = _StripPool.apply
_exchanging_strip_pool_apply: Callable[..., Any] = _ExchangingStripPool.apply


def strip_max_pool(
    local: torch.Tensor,
    halo: torch.Tensor,
    g: PoolStrips,
    dim: int,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
) -> torch.Tensor:
    """This rank's output rows of a 2-D/3-D max pool (dilation 1, floor mode) from its block and ``halo`` rows.

    Examples:
        One process standing in for rank 1 of the module example:

        >>> full = torch.randn(1, 2, 17, 4)
        >>> g = pool_strip_geometry((10, 7), 1, (5, 9), kernel=3, stride=2, padding=1)
        >>> y = strip_max_pool(full[:, :, 10:], full[:, :, list(g.halo_rows)], g, 2, (3, 3), (2, 2), (1, 1))
        >>> torch.equal(y, F.max_pool2d(full, 3, stride=2, padding=1)[:, :, 5:9])
        True
    """
    return _strip_pool(local, halo, g, _pool_args(local, g, dim, kernel, stride, padding, None))


def strip_avg_pool(
    local: torch.Tensor,
    halo: torch.Tensor,
    g: PoolStrips,
    dim: int,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """`strip_max_pool` for a 2-D/3-D average pool (floor mode): the edge rows are replaced likewise.

    The strips hold real rows only (`pool_strip_geometry` sees to it), so their
    divisors are the whole pool's under either ``count_include_pad``.

    Examples:
        >>> full = torch.randn(1, 2, 17, 4)
        >>> g = pool_strip_geometry((10, 7), 1, (5, 9), kernel=3, stride=2, padding=1)
        >>> y = strip_avg_pool(full[:, :, 10:], full[:, :, list(g.halo_rows)], g, 2, (3, 3), (2, 2), (1, 1), False)
        >>> torch.allclose(y, F.avg_pool2d(full, 3, 2, 1, count_include_pad=False)[:, :, 5:9])
        True
    """
    avg = AvgOptions(bool(count_include_pad), divisor_override)
    return _strip_pool(local, halo, g, _pool_args(local, g, dim, kernel, stride, padding, avg))


def _pool_args(
    local: torch.Tensor,
    g: PoolStrips,
    dim: int,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    avg: AvgOptions | None,
) -> _PoolArgs:
    main_padding = tuple(g.q if i + 2 == dim else int(p) for i, p in enumerate(padding))
    ints = (tuple(int(k) for k in kernel), tuple(int(s) for s in stride))
    return _PoolArgs(local.ndim - 2, dim, *ints, main_padding, avg)


def _strip_pool(local: torch.Tensor, halo: torch.Tensor, g: PoolStrips, args: _PoolArgs) -> torch.Tensor:
    top = halo.narrow(args.dim, 0, len(g.top_halo))
    bottom = halo.narrow(args.dim, len(g.top_halo), len(g.bottom_halo))
    out: torch.Tensor = _strip_pool_apply(local, top, bottom, g, args)
    return out


def exchanging_strip_max_pool(
    local: torch.Tensor,
    layout: DimLayout,
    wanted: Sequence[Sequence[int]],
    g: PoolStrips,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    recompute: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`strip_max_pool` that fetches its halo rows itself: the rows ``wanted[c]`` of every coordinate ``c``.

    A collective along ``layout``'s mesh dim. The block gets one gradient, formed in one
    buffer (the halo rows' gradients are returned into it in place). Under
    ``create_graph`` the backward differentiates ``recompute(local)``, this rank's
    output rows by a path whose autograd graph has the same shape on every rank (the
    haloed copy of the general path), so that collectives keep their order.

    Examples:
        On 2 ranks (``mesh``, ``rank``), rows split 10/7:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.linspace(-1, 1, 2 * 17 * 4).reshape(1, 2, 17, 4).sin()
        >>> x = shard_tensor(full, mesh, [Shard(2)], [10, 7])
        >>> gs = [pool_strip_geometry((10, 7), c, r, kernel=3, stride=2, padding=1) for c, r in ((0, (0, 5)), (1, (5, 9)))]
        >>> whole = lambda t: F.max_pool2d(t, 3, 2, 1)  # a stand-in: recompute is only run under create_graph
        >>> y = exchanging_strip_max_pool(x.to_local(), dim_layout(x, 2), [g.halo_rows for g in gs], gs[rank], (3, 3), (2, 2), (1, 1), whole)
        >>> torch.equal(y, F.max_pool2d(full, 3, stride=2, padding=1)[:, :, [slice(0, 5), slice(5, 9)][rank]])
        True
    """
    args = _pool_args(local, g, layout.tensor_dim, kernel, stride, padding, None)
    return _exchanging_strip_pool(local, layout, wanted, g, args, recompute)


def exchanging_strip_avg_pool(
    local: torch.Tensor,
    layout: DimLayout,
    wanted: Sequence[Sequence[int]],
    g: PoolStrips,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    recompute: Callable[[torch.Tensor], torch.Tensor],
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """`exchanging_strip_max_pool` for an average pool (see `strip_avg_pool`).

    Examples:
        On 2 ranks (``mesh``, ``rank``), rows split 10/7:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.linspace(-1, 1, 2 * 17 * 4).reshape(1, 2, 17, 4).sin()
        >>> x = shard_tensor(full, mesh, [Shard(2)], [10, 7])
        >>> gs = [pool_strip_geometry((10, 7), c, r, kernel=3, stride=2, padding=1) for c, r in ((0, (0, 5)), (1, (5, 9)))]
        >>> whole = lambda t: F.avg_pool2d(t, 3, 2, 1)  # a stand-in: recompute is only run under create_graph
        >>> y = exchanging_strip_avg_pool(x.to_local(), dim_layout(x, 2), [g.halo_rows for g in gs], gs[rank], (3, 3), (2, 2), (1, 1), whole)
        >>> torch.allclose(y, F.avg_pool2d(full, 3, stride=2, padding=1)[:, :, [slice(0, 5), slice(5, 9)][rank]])
        True
    """
    avg = AvgOptions(bool(count_include_pad), divisor_override)
    args = _pool_args(local, g, layout.tensor_dim, kernel, stride, padding, avg)
    return _exchanging_strip_pool(local, layout, wanted, g, args, recompute)


def _exchanging_strip_pool(
    local: torch.Tensor,
    layout: DimLayout,
    wanted: Sequence[Sequence[int]],
    g: PoolStrips,
    args: _PoolArgs,
    recompute: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    frozen = tuple(tuple(int(r) for r in rows) for rows in wanted)
    out: torch.Tensor = _exchanging_strip_pool_apply(local, g, args, layout, frozen, recompute)
    return out
