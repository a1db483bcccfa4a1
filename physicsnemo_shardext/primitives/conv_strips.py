"""A convolution along one sharded dim without a haloed copy of the block.

The general path of the first-party convolution family fetches every input row a rank's output
rows read, its own included, into one haloed tensor, and convolves that. The
haloed tensor is a second copy of the block; the convolution saves it for the
backward, so it lives from the forward to the backward of every layer, and the
backward builds a haloed gradient before folding it back into the block's.

A convolution is linear in its input, and the haloed input is the block plus the
halo rows, each zero where the other is. So:

* the **main** convolution runs on the block as it is, with ``q`` zero rows of
  padding along the sharded dim, ``q`` chosen so that its first output row is this
  rank's first (``q = block start - field start of the first output row``; for a
  stride-1 "same" convolution, the caller's own padding). Rows whose field reaches
  past the block's edges come out as if the neighbours' rows were zero;
* two small **boundary corrections** add what the halo rows contribute: each is a
  convolution (no bias) of a strip made of the halo rows and zero rows, a few rows
  wide, added in place into the first and last output rows.

Nothing block-sized is built besides the output: autograd saves the block itself
(no copy) and the two strips. Only the halo rows cross ranks (the rows, and the
single exchange, of the general path). The backward is one autograd Function: the
main convolution's input gradient is the block's gradient, whole, and the
corrections' input gradients are the halo rows' (sent back to their owners by the
exchange). It is built from differentiable ops (``aten.convolution_backward``), so
second-order gradients work as for a plain convolution.

`conv_strip_geometry` decides per coordinate from global sizes only, so every rank
agrees on what every other rank fetches. It returns ``None`` (the general path)
where the main convolution cannot start on this rank's first output row (that
would need negative padding) or yields too few rows.

Examples:
    A stride-2, kernel-3 convolution (padding 1) over rows split 10/7 gives output
    rows 5/4. Rank 1's first output row reads global rows 9..11, so its main
    convolution pads one row (``q = 1``) and its top correction takes global row 9;
    its last output row reads rows 15..17, row 17 being the global padding.

    >>> g = conv_strip_geometry(sizes=(10, 7), coord=1, out_starts=(0, 5, 9), k=3, stride=2, dilation=1, pad_left=1)
    >>> g.q, g.top_halo, g.top_outputs, g.top_fill, g.bottom_outputs, g.bottom_zeros
    (1, range(9, 10), 1, 2, 0, 0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from physicsnemo_shardext.primitives.index_exchange import (
    gather_global_indices,
    plan_exchange,
    start_fetch_rows,
    start_return_rows,
)
from physicsnemo_shardext.primitives.layout import DimLayout

#: ``recompute(local, weight, bias)``: this rank's output rows, differentiable (for ``create_graph``).
Recompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

__all__ = ["ConvStrips", "conv_strip_geometry", "exchanging_strip_conv", "strip_conv"]


@dataclass(frozen=True)
class ConvStrips:
    """One coordinate's main convolution and boundary corrections, along the sharded dim.

    Attributes:
        q: zero rows of padding of the main convolution, on both sides of the block.
        outputs: this coordinate's output rows (the main convolution's first rows).
        top_zeros: rows of the top strip before the global start (zeros).
        top_halo: global rows fetched from the ranks before.
        top_outputs: output rows the top correction adds to (0: no correction).
        top_fill: zero rows after the top halo in the top strip (the block's rows).
        bottom_lead: zero rows before the bottom halo in the bottom strip.
        bottom_halo: global rows fetched from the ranks after.
        bottom_zeros: rows of the bottom strip past the global end (zeros).
        bottom_outputs: output rows the bottom correction adds to (the last ones).
    """

    q: int
    outputs: int
    top_zeros: int
    top_halo: range
    top_outputs: int
    top_fill: int
    bottom_lead: int
    bottom_halo: range
    bottom_zeros: int
    bottom_outputs: int

    @property
    def halo_rows(self) -> tuple[int, ...]:
        """The global rows this coordinate fetches: the top halo, then the bottom halo."""
        return tuple(self.top_halo) + tuple(self.bottom_halo)


def conv_strip_geometry(
    sizes: Sequence[int], coord: int, out_starts: Sequence[int], k: int, stride: int, dilation: int, pad_left: int
) -> ConvStrips | None:
    """Coordinate ``coord``'s geometry, or ``None`` where the main convolution cannot produce its rows.

    ``out_starts`` are the output row starts of `conv_row_plan` (the owner of an
    output row holds the centre of its field).

    Examples:
        A kernel-2 stride-2 convolution over rows split 3/3: rank 1's first output row
        reads rows 2..3; starting there would need padding -1.

        >>> conv_strip_geometry((3, 3), 1, (0, 2, 3), k=2, stride=2, dilation=1, pad_left=0) is None
        True
    """
    return _geometry(
        tuple(int(s) for s in sizes),
        int(coord),
        tuple(int(o) for o in out_starts),
        int(k),
        int(stride),
        int(dilation),
        int(pad_left),
    )


@functools.lru_cache(maxsize=4096)
def _geometry(
    sizes: tuple[int, ...], coord: int, out_starts: tuple[int, ...], k: int, stride: int, dilation: int, pad_left: int
) -> ConvStrips | None:
    total, reach, size = sum(sizes), dilation * (k - 1), sizes[coord]
    b0 = sum(sizes[:coord])
    b1 = b0 + size
    o0, o1 = out_starts[coord], out_starts[coord + 1]
    outputs = o1 - o0
    if outputs <= 0 or size == 0:
        return None  # nothing to compute here, or nothing to compute it from: the general path

    def field_start(o: int) -> int:
        return o * stride - pad_left

    q = b0 - field_start(o0)
    main_rows = (size + 2 * q - reach - 1) // stride + 1 if size + 2 * q > reach else 0
    if q < 0 or main_rows < outputs:
        return None
    # Top: outputs whose field starts before the block; only real rows (not the global padding) correct.
    top_halo = range(max(b0 - q, 0), b0)
    top_outputs = min(max(0, -(-(b0 + pad_left) // stride) - o0), outputs) if top_halo else 0
    top_fill = field_start(o0 + top_outputs - 1) + reach - b0 + 1 if top_outputs else 0
    # Bottom: outputs whose field ends past the block.
    last = field_start(o1 - 1) + reach
    bottom_halo = range(b1, min(last, total - 1) + 1)
    first_bottom = min(max(o0, -(-(b1 + pad_left - reach) // stride)), o1) if bottom_halo else o1
    return ConvStrips(
        q=q,
        outputs=outputs,
        top_zeros=len(range(b0 - q, min(0, b0))) if top_outputs else 0,
        top_halo=top_halo if top_outputs else range(b0, b0),
        top_outputs=top_outputs,
        top_fill=top_fill,
        bottom_lead=b1 - field_start(first_bottom) if bottom_halo else 0,
        bottom_halo=bottom_halo,
        bottom_zeros=max(0, last - (total - 1)) if bottom_halo else 0,
        bottom_outputs=o1 - first_bottom,
    )


def _pad_along(t: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
    """``t`` with ``before``/``after`` zero rows along ``dim``; ``t`` itself when both are 0."""
    if before == 0 and after == 0:
        return t
    flat = [0, 0] * (t.ndim - 1 - dim) + [before, after]
    return F.pad(t, flat)


@dataclass(frozen=True)
class _ConvArgs:
    func: Callable[..., torch.Tensor]
    dim: int
    stride: tuple[int, ...]
    padding: tuple[int, ...]  # the main convolution's: q along the sharded dim
    dilation: tuple[int, ...]
    groups: int

    @property
    def strip_padding(self) -> tuple[int, ...]:
        """The corrections' padding: none along the sharded dim (their strips carry their zeros)."""
        return tuple(0 if i + 2 == self.dim else p for i, p in enumerate(self.padding))


def _strip_input(halo: torch.Tensor, g: ConvStrips, dim: int, top: bool) -> torch.Tensor:
    """A correction's input: the halo rows and the zero rows standing for the block (and the global padding)."""
    if top:
        return _pad_along(halo, dim, g.top_zeros, g.top_fill)
    return _pad_along(halo, dim, g.bottom_lead, g.bottom_zeros)


def _conv_forward(
    local: torch.Tensor,
    top: torch.Tensor,
    bottom: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    g: ConvStrips,
    args: _ConvArgs,
) -> torch.Tensor:
    """The main convolution of the block, with the halo corrections added in place into its edge rows."""
    return _add_corrections(_main_conv(local, weight, bias, g, args), top, bottom, weight, g, args)


def _main_conv(
    local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, g: ConvStrips, args: _ConvArgs
) -> torch.Tensor:
    """The block convolved as it is, padded by ``g.q`` rows: this rank's rows, halo contributions missing."""
    out = args.func(local, weight, bias, args.stride, args.padding, args.dilation, args.groups)
    if out.shape[args.dim] != g.outputs:  # symmetric padding may give rows past this rank's last
        out = out.narrow(args.dim, 0, g.outputs).contiguous()
    return out


def _add_corrections(
    out: torch.Tensor, top: torch.Tensor, bottom: torch.Tensor, weight: torch.Tensor, g: ConvStrips, args: _ConvArgs
) -> torch.Tensor:
    """Add the halo rows' contributions into ``out``'s first and last rows, in place."""
    d = args.dim
    for halo, rows, first, is_top in (
        (top, g.top_outputs, 0, True),
        (bottom, g.bottom_outputs, g.outputs - g.bottom_outputs, False),
    ):
        if rows:
            strip = _strip_input(halo, g, d, is_top)
            correction = args.func(strip, weight, None, args.stride, args.strip_padding, args.dilation, args.groups)
            out.narrow(d, first, rows).add_(correction)
    return out


def _conv_backward(
    grad: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    has_bias: bool,
    needs: tuple[bool, bool, bool],
    g: ConvStrips,
    args: _ConvArgs,
    halo_grads_ready: Callable[[torch.Tensor | None, torch.Tensor | None], None] | None = None,
) -> tuple[Any, Any, Any, Any, Any]:
    """Gradients of the block, the top and bottom halo rows, the weight and the bias (``needs``: input, weight, bias).

    The halo rows' gradients come from the small strips, so they are computed first and
    handed to ``halo_grads_ready`` (which may start sending them) before the block's.
    """
    local, top, bottom, weight = saved
    d, n = args.dim, weight.ndim - 2
    need_input, need_weight, need_bias = needs
    convolution_backward = torch.ops.aten.convolution_backward
    halo_grads: list[torch.Tensor | None] = []
    strip_weight_grads = []
    for halo, rows, first, is_top in (
        (top, g.top_outputs, 0, True),
        (bottom, g.bottom_outputs, g.outputs - g.bottom_outputs, False),
    ):
        if not rows:
            halo_grads.append(None)
            continue
        strip = _strip_input(halo, g, d, is_top)
        strip_grad, strip_weight_grad, _ = convolution_backward(
            grad.narrow(d, first, rows),
            strip,
            weight,
            None,
            args.stride,
            args.strip_padding,
            args.dilation,
            False,
            [0] * n,
            args.groups,
            [need_input, need_weight, False],
        )
        if need_weight:
            strip_weight_grads.append(strip_weight_grad)
        if need_input:
            offset = g.top_zeros if is_top else g.bottom_lead
            strip_grad = strip_grad.narrow(d, offset, halo.shape[d])
        halo_grads.append(strip_grad if need_input else None)
    if halo_grads_ready is not None:
        halo_grads_ready(halo_grads[0], halo_grads[1])
    main_grad = grad
    reach = args.dilation[d - 2] * (weight.shape[d] - 1)
    main_rows = (local.shape[d] + 2 * g.q - reach - 1) // args.stride[d - 2] + 1
    if main_rows != g.outputs:
        main_grad = _pad_along(grad, d, 0, main_rows - g.outputs)
    grad_local, grad_weight, grad_bias = convolution_backward(
        main_grad,
        local,
        weight,
        [weight.shape[0]] if has_bias else None,
        args.stride,
        args.padding,
        args.dilation,
        False,
        [0] * n,
        args.groups,
        [need_input, need_weight, need_bias],
    )
    for strip_weight_grad in strip_weight_grads:
        grad_weight = grad_weight + strip_weight_grad
    # No rows: a view of the block's gradient keeps the exchange in a second-order graph.
    empty = grad_local.narrow(d, 0, 0) if need_input else None
    top_grad, bottom_grad = (h if h is not None else empty for h in halo_grads)
    return grad_local, top_grad, bottom_grad, grad_weight, grad_bias


class _StripConv(torch.autograd.Function):
    """Main convolution of the block plus the halo corrections; saves the block (no copy) and the halo rows."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        top: torch.Tensor,
        bottom: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        g: ConvStrips,
        args: _ConvArgs,
    ) -> torch.Tensor:
        ctx.g, ctx.args, ctx.has_bias = g, args, bias is not None
        ctx.save_for_backward(local, top, bottom, weight)
        return _conv_forward(local, top, bottom, weight, bias, g, args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        need = ctx.needs_input_grad
        needs = (any(need[:3]), need[3], ctx.has_bias and need[4])
        grads = _conv_backward(grad, ctx.saved_tensors, ctx.has_bias, needs, ctx.g, ctx.args)
        return (*grads, None, None)


class _ExchangingStripConv(torch.autograd.Function):
    """`_StripConv` that fetches the halo rows itself and returns their gradients into the block's gradient.

    Fetching them outside (`gather_global_indices`) would give the block a second gradient,
    block-sized, and autograd would add the two: two more block-sized buffers at the
    backward's peak. Under ``create_graph`` the backward recomputes the exchanging
    forward with autograd (`gather_global_indices` and `_StripConv`) and differentiates
    that, so second-order gradients work.
    """

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        g: ConvStrips,
        args: _ConvArgs,
        layout: DimLayout,
        wanted: tuple[tuple[int, ...], ...],
        recompute: Recompute | None,
    ) -> torch.Tensor:
        plan = plan_exchange(layout, wanted)
        ctx.recompute = recompute
        finish = start_fetch_rows(local, layout, plan)  # the halo travels while the block is convolved
        out = _main_conv(local, weight, bias, g, args)
        top, bottom = _split_halo(finish(), g, args.dim)
        ctx.g, ctx.args, ctx.has_bias, ctx.layout, ctx.wanted = g, args, bias is not None, layout, wanted
        ctx.save_for_backward(local, top, bottom, weight, bias)
        return _add_corrections(out, top, bottom, weight, g, args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        local, top, bottom, weight, bias = ctx.saved_tensors
        g, args, layout, wanted = ctx.g, ctx.args, ctx.layout, ctx.wanted
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: differentiate a recomputation built from differentiable pieces
            with torch.enable_grad():
                if ctx.recompute is not None:
                    out = ctx.recompute(local, weight, bias)
                else:
                    halo = gather_global_indices(local, layout, wanted)
                    top_rows, bottom_rows = _split_halo(halo, g, args.dim)
                    out = _strip_conv_apply(local, top_rows, bottom_rows, weight, bias, g, args)
            wanted = [t for t, n in zip((local, weight, bias), need[:3]) if n and t is not None]
            found = iter(torch.autograd.grad(out, wanted, grad, create_graph=True, allow_unused=True))
            grads = [next(found) if n and t is not None else None for t, n in zip((local, weight, bias), need[:3])]
            return (*grads, None, None, None, None, None)
        needs = (need[0], need[1], ctx.has_bias and need[2])
        finish: list[Callable[[torch.Tensor], None]] = []

        def send_halo_grads(grad_top: torch.Tensor | None, grad_bottom: torch.Tensor | None) -> None:
            # They travel back to their owners while the block's gradient is computed.
            if needs[0]:
                rows = [
                    r if r is not None else torch.zeros_like(h) for r, h in ((grad_top, top), (grad_bottom, bottom))
                ]
                halo_grad = torch.cat(rows, args.dim)
                finish.append(start_return_rows(halo_grad, layout, plan_exchange(layout, wanted)))

        grad_local, _, _, grad_weight, grad_bias = _conv_backward(
            grad, (local, top, bottom, weight), ctx.has_bias, needs, g, args, send_halo_grads
        )
        if finish:
            finish[0](grad_local)
        return grad_local, grad_weight, grad_bias, None, None, None, None, None


# Bound once, typed loosely: Function.apply is untyped before torch 2.14 (mypy --strict on every lane).
_strip_conv_apply: Callable[..., Any] = _StripConv.apply
_exchanging_strip_conv_apply: Callable[..., Any] = _ExchangingStripConv.apply


def _split_halo(halo: torch.Tensor, g: ConvStrips, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return halo.narrow(dim, 0, len(g.top_halo)), halo.narrow(dim, len(g.top_halo), len(g.bottom_halo))


def strip_conv(
    func: Callable[..., torch.Tensor],
    local: torch.Tensor,
    halo: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    g: ConvStrips,
    dim: int,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """This rank's output rows of ``func`` (``F.conv1d/2d/3d``) from its block and its fetched ``halo`` rows.

    Args:
        func: the convolution.
        local: the block.
        halo: the rows of ``g.halo_rows``, fetched (`gather_global_indices`), along ``dim``.
        weight: a plain tensor (its gradient is this rank's partial sum).
        bias: a plain tensor or ``None`` (likewise).
        g: this coordinate's geometry (`conv_strip_geometry`).
        dim: the sharded tensor dim.
        stride: the convolution's stride, one per spatial dim.
        padding: the convolution's padding; ``padding[dim - 2]`` is replaced by ``g.q``.
        dilation: the convolution's dilation.
        groups: the convolution's groups.

    Examples:
        One process standing in for rank 1 of the module example: the result equals rows
        5..8 of the whole convolution.

        >>> full, w = torch.randn(1, 2, 17, 4), torch.randn(3, 2, 3, 3)
        >>> g = conv_strip_geometry((10, 7), 1, (0, 5, 9), k=3, stride=2, dilation=1, pad_left=1)
        >>> halo = full[:, :, list(g.halo_rows)]
        >>> y = strip_conv(F.conv2d, full[:, :, 10:], halo, w, None, g, 2, (2, 2), (1, 1), (1, 1), 1)
        >>> torch.allclose(y, F.conv2d(full, w, stride=2, padding=1)[:, :, 5:9], atol=1e-6)
        True
    """
    top = halo.narrow(dim, 0, len(g.top_halo))
    bottom = halo.narrow(dim, len(g.top_halo), len(g.bottom_halo))
    main_padding = tuple(g.q if i + 2 == dim else int(p) for i, p in enumerate(padding))
    args = _ConvArgs(func, dim, tuple(stride), main_padding, tuple(dilation), int(groups))
    out: torch.Tensor = _strip_conv_apply(local, top, bottom, weight, bias, g, args)
    return out


def exchanging_strip_conv(
    func: Callable[..., torch.Tensor],
    local: torch.Tensor,
    layout: DimLayout,
    wanted: Sequence[Sequence[int]],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    g: ConvStrips,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    recompute: Recompute | None = None,
) -> torch.Tensor:
    """`strip_conv` that fetches its halo rows itself: the rows ``wanted[c]`` of every coordinate ``c``.

    Every rank along ``layout``'s mesh dim calls it (or `gather_global_indices` with the
    same ``wanted``): the exchange is a collective. The block then gets one gradient,
    formed in one buffer: the halo rows' gradients come back from their users and are
    added into it in place.

    Under ``create_graph`` the backward differentiates a recomputation:
    ``recompute(local, weight, bias)`` if given, else the strips with
    `gather_global_indices`. Give one whose autograd graph has the same shape on every
    rank (e.g. a haloed copy and a plain convolution): the second backward then runs
    its collectives in the same order everywhere; the strips' graph differs between a
    rank with corrections and one without.

    Examples:
        On 2 ranks (``mesh``, ``rank``), rows split 10/7, a stride-2 convolution:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.linspace(-1, 1, 2 * 17 * 4).reshape(1, 2, 17, 4)
        >>> w = torch.linspace(-1, 1, 54).reshape(3, 2, 3, 3)
        >>> x = shard_tensor(full, mesh, [Shard(2)], [10, 7])
        >>> gs = [conv_strip_geometry((10, 7), c, (0, 5, 9), k=3, stride=2, dilation=1, pad_left=1) for c in (0, 1)]
        >>> wanted = [g.halo_rows for g in gs]
        >>> args = (w, None, gs[rank], (2, 2), (1, 1), (1, 1), 1)
        >>> y = exchanging_strip_conv(F.conv2d, x.to_local(), dim_layout(x, 2), wanted, *args)
        >>> rows = [slice(0, 5), slice(5, 9)][rank]
        >>> torch.allclose(y, F.conv2d(full, w, stride=2, padding=1)[:, :, rows], atol=1e-6)
        True
    """
    main_padding = tuple(g.q if i + 2 == layout.tensor_dim else int(p) for i, p in enumerate(padding))
    args = _ConvArgs(func, layout.tensor_dim, tuple(stride), main_padding, tuple(dilation), int(groups))
    frozen = tuple(tuple(int(r) for r in rows) for rows in wanted)
    out: torch.Tensor = _exchanging_strip_conv_apply(local, weight, bias, g, args, layout, frozen, recompute)
    return out
