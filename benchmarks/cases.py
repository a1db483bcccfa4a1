"""The benchmark runner's cases: one representative op per patch family, with its analytic bound.

A case (``case_<name>(shape) -> Setup``) builds the op on the benchmark field
(`Shape`: ``B x C x H x ...`` split over ``H``) and states the fewest bytes each
rank must hand to collectives, forward and backward (``docs/benchmarks.md``
derives each bound). `CASES` maps every family to its cases; `FAMILIES` is their
order in the tables. Nothing here runs a collective: `measure.measure_case`
runs a case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CASES", "COMPLEX", "FAMILIES", "FLOAT", "Setup", "Shape", "randn"]

FAMILIES = (
    "convolution",
    "padding",
    "pooling",
    "resampling",
    "normalization",
    "fft",
    "afno",
    "finite_differences",
    "roll_flip",
    "softmax_cumsum",
    "losses",
    "linear",
    "attention",
    "indexing_einsum",
    "layout_ops",
    "pointwise",
    "uneven_redistribute",
)
FLOAT, COMPLEX = 4, 8  # bytes of a float32 and a complex64 element


@dataclass
class Shape:
    """The benchmark field ``B x C x H x ...`` on ``ranks`` ranks, split over ``H`` (dim 2)."""

    size: tuple[int, ...]
    ranks: int
    tokens: int
    heads: int
    head_dim: int

    @property
    def batch(self) -> int:
        return self.size[0]

    @property
    def channels(self) -> int:
        return self.size[1]

    @property
    def spatial(self) -> tuple[int, ...]:
        return self.size[2:]

    @property
    def height(self) -> int:
        return self.size[2]

    @property
    def last(self) -> int:
        return self.size[-1]

    @property
    def row_bytes(self) -> int:
        """Bytes of one H row of the field (all batch, channel and other spatial entries), float32."""
        return math.prod(self.size) // self.height * FLOAT

    def split(self) -> list[int]:
        """torch.chunk's split of H (the even split every case but ``uneven_redistribute`` uses)."""
        sizes = [len(c) for c in torch.arange(self.height).chunk(self.ranks)]
        return sizes + [0] * (self.ranks - len(sizes))


@dataclass
class Setup:
    """One representative op, ready to run single-process and sharded.

    ``fn(module, *inputs)`` computes the op; ``inputs`` are the full tensors (the same on every
    rank), ``shard_dims[i]`` the dim input ``i`` is sharded on (``None``: passed as a plain,
    replicated tensor), ``grads[i]`` whether it requires grad. ``bounds(rank)`` gives the
    analytic minimum ``(forward, backward)`` bytes that rank hands to collectives.
    """

    op: str
    fn: Callable[..., torch.Tensor]
    inputs: list[torch.Tensor]
    shard_dims: list[int | None]
    grads: list[bool]
    bounds: Callable[[int], tuple[int, int]]
    bound_text: str
    module: torch.nn.Module | None = None
    split: list[int] | None = None
    targets: tuple[Any, ...] = ()  # function-level targets, to name the fallback's path
    exchange: bool = False  # an all-to-all family: bytes goal 1.25x
    may_abort: bool = False  # may kill the process (a gloo size mismatch is not an exception): probed first


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A seeded standard-normal tensor: the same on every rank and in the single-process run."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _windows_bound(windows: Sequence[tuple[int, int]], split: Sequence[int]) -> tuple[list[int], list[int]]:
    """Fewest rows each rank must send (and receive) so that every output row is computed on one rank.

    ``windows[o] = (first, last)`` input rows read by output row ``o`` (clipped to the field). Output
    rows stay in order, each rank computing a contiguous run of them; at every shard boundary the
    windows that straddle it are cut between the two ranks where the fewest rows cross (rows the left
    rank's windows need from the right, plus rows the right rank's windows need from the left).
    Returns rows sent and rows received per rank.
    """
    sent, received = [0] * len(split), [0] * len(split)
    start = 0
    for r in range(len(split) - 1):
        start += split[r]
        boundary = start  # rows < boundary live on rank r, rows >= boundary on rank r+1
        straddling = [w for w in windows if w[0] < boundary <= w[1]]
        best = None
        for cut in range(len(straddling) + 1):  # straddling[:cut] computed on the left rank
            from_right = max((w[1] - boundary + 1 for w in straddling[:cut]), default=0)
            from_left = max((boundary - w[0] for w in straddling[cut:]), default=0)
            if best is None or from_left + from_right < sum(best):
                best = (from_left, from_right)
        from_left, from_right = best or (0, 0)
        sent[r] += from_left
        received[r + 1] += from_left
        sent[r + 1] += from_right
        received[r] += from_right
    return sent, received


def _stencil_bounds(
    s: Shape, windows: Sequence[tuple[int, int]], row_bytes: int, extra_backward: int = 0
) -> Callable[[int], tuple[int, int]]:
    """Forward: the halo rows a rank sends; backward: the gradients of the rows it received, plus ``extra``."""
    sent, received = _windows_bound(windows, s.split())
    return lambda r: (sent[r] * row_bytes, received[r] * row_bytes + extra_backward)


def _conv_windows(length: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> list[tuple[int, int]]:
    out = (length + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return [
        (max(o * stride - padding, 0), min(o * stride - padding + dilation * (kernel - 1), length - 1))
        for o in range(out)
    ]


def case_convolution(s: Shape) -> Setup:
    nd = len(s.spatial)
    conv = getattr(torch.nn, f"Conv{nd}d")(s.channels, s.channels, 3, stride=2, padding=1)
    windows = _conv_windows(s.height, 3, 2, 1)
    return Setup(
        op=f"Conv{nd}d({s.channels}, {s.channels}, 3, stride=2, padding=1)",
        fn=lambda m, x: m(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        module=conv,
        bounds=_stencil_bounds(s, windows, s.row_bytes, _param_bytes(conv)),
        bound_text="halo: fewest rows crossing each boundary x row bytes; bwd: those rows' gradients + "
        "weight/bias gradient all-reduce",
        targets=(getattr(F, f"conv{nd}d"),),
    )


def case_padding(s: Shape) -> Setup:
    nd = len(s.spatial)
    pad = [0, 0] * (nd - 1) + [1, 1]  # F.pad lists the last dim first: (1, 1) on H only

    def bounds(r: int) -> tuple[int, int]:
        # output row 0 of rank 0 is input row H-1 (rank N-1's), the last output row is input row 0
        rows = (r == 0) + (r == s.ranks - 1)
        return rows * s.row_bytes, rows * s.row_bytes

    return Setup(
        op="F.pad(x, (0, 0, 1, 1), mode='circular') (periodic H)",
        fn=lambda m, x: F.pad(x, pad, mode="circular"),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=bounds,
        bound_text="the wrapped rows: 1 row each way between rank 0 and rank N-1; bwd the same",
        targets=(F.pad,),
    )


def case_pooling(s: Shape) -> Setup:
    nd = len(s.spatial)
    windows = _conv_windows(s.height, 3, 2, 1)
    return Setup(
        op=f"F.max_pool{nd}d(x, 3, stride=2, padding=1)",
        fn=lambda m, x: getattr(F, f"max_pool{nd}d")(x, 3, stride=2, padding=1),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=_stencil_bounds(s, windows, s.row_bytes),
        bound_text="halo: fewest rows crossing each boundary x row bytes; bwd: those rows' gradients",
        targets=(getattr(F, f"max_pool{nd}d"),),
    )


def case_avg_pooling(s: Shape) -> Setup:
    nd = len(s.spatial)
    windows = _conv_windows(s.height, 3, 2, 1)
    return Setup(
        op=f"F.avg_pool{nd}d(x, 3, stride=2, padding=1, count_include_pad=False)",
        fn=lambda m, x: getattr(F, f"avg_pool{nd}d")(x, 3, stride=2, padding=1, count_include_pad=False),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=_stencil_bounds(s, windows, s.row_bytes),
        bound_text="halo: fewest rows crossing each boundary x row bytes; bwd: those rows' gradients",
        targets=(getattr(F, f"avg_pool{nd}d"),),
    )


def case_resampling(s: Shape) -> Setup:
    nd = len(s.spatial)
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[nd]
    windows = []
    for j in range(2 * s.height):  # PyTorch's source index for align_corners=False, scale 2
        src = max((j + 0.5) / 2 - 0.5, 0.0)
        i0 = min(int(src), s.height - 1)
        windows.append((i0, min(i0 + 1, s.height - 1)))
    return Setup(
        op=f"F.interpolate(x, scale_factor=2, mode='{mode}')",
        fn=lambda m, x: F.interpolate(x, scale_factor=2, mode=mode),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=_stencil_bounds(s, windows, s.row_bytes),
        bound_text="halo: 1 row per boundary (the output rows between two shards need both); bwd: its gradient",
        targets=(F.interpolate,),
    )


def case_batch_norm(s: Shape) -> Setup:
    nd = len(s.spatial)
    norm = getattr(torch.nn, f"BatchNorm{nd}d")(s.channels)
    stats = 2 * s.channels * FLOAT
    return Setup(
        op=f"BatchNorm{nd}d({s.channels}), training",
        fn=lambda m, x: m(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        module=norm,
        bounds=lambda r: (stats, stats),
        bound_text="fwd: sum and sum of squares per channel (2C floats); bwd: sum(dy), sum(dy*x_hat) per "
        "channel, which are also the bias and weight gradients (2C floats)",
        targets=(F.batch_norm,),
    )


def case_group_norm(s: Shape) -> Setup:
    groups = 4 if s.channels % 4 == 0 else 1
    norm = torch.nn.GroupNorm(groups, s.channels)
    stats = 2 * s.batch * groups * FLOAT
    return Setup(
        op=f"GroupNorm({groups}, {s.channels})",
        fn=lambda m, x: m(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        module=norm,
        bounds=lambda r: (stats, stats + 2 * s.channels * FLOAT),
        bound_text="fwd: 2 statistics per sample and group (2BG floats); bwd: 2BG floats for dx + the "
        "weight and bias gradients (2C floats)",
        targets=(F.group_norm,),
    )


def case_layer_norm(s: Shape) -> Setup:
    norm = torch.nn.LayerNorm(s.last)
    return Setup(
        op=f"LayerNorm({s.last}) over the last (unsharded) dim",
        fn=lambda m, x: m(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        module=norm,
        bounds=lambda r: (0, _param_bytes(norm)),
        bound_text="fwd: none (rows are local); bwd: the weight and bias gradient all-reduce",
        targets=(F.layer_norm,),
    )


def case_instance_norm(s: Shape) -> Setup:
    nd = len(s.spatial)
    norm = getattr(torch.nn, f"InstanceNorm{nd}d")(s.channels)
    stats = 2 * s.batch * s.channels * FLOAT
    return Setup(
        op=f"InstanceNorm{nd}d({s.channels})",
        fn=lambda m, x: m(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        module=norm,
        bounds=lambda r: (stats, stats),
        bound_text="2 statistics per sample and channel (2BC floats), forward and backward",
        targets=(F.instance_norm,),
    )


def _spectrum_block_bytes(s: Shape, rows: int) -> int:
    """Bytes of a rank's half-spectrum block after the local transforms (rows of H, last dim W//2+1)."""
    others = math.prod(s.spatial[1:-1]) if len(s.spatial) > 2 else 1
    return s.batch * s.channels * rows * others * (s.last // 2 + 1) * COMPLEX


def case_fft(s: Shape) -> Setup:
    dims = tuple(range(2, 2 + len(s.spatial)))
    split = s.split()

    def bounds(r: int) -> tuple[int, int]:
        moved = _spectrum_block_bytes(s, split[r]) * (s.ranks - 1) // s.ranks
        return moved, moved

    return Setup(
        op=f"torch.fft.rfftn(x, dim={dims})",
        fn=lambda m, x: torch.fft.rfftn(x, dim=dims),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=bounds,
        exchange=True,
        bound_text="one all-to-all of the local half-spectrum block, (N-1)/N of it leaves the rank; bwd: the "
        "reverse all-to-all",
        targets=(torch.fft.rfftn,),
    )


def case_afno(s: Shape) -> Setup:
    from physicsnemo.nn.module.afno_layers import AFNO2DLayer

    height, width = s.spatial[0], s.spatial[-1]
    blocks = 8 if s.channels % 8 == 0 else 1
    layer = AFNO2DLayer(hidden_size=s.channels, num_blocks=blocks)
    split = s.split()

    def bounds(r: int) -> tuple[int, int]:
        moved = s.batch * split[r] * (width // 2 + 1) * s.channels * COMPLEX * (s.ranks - 1) // s.ranks
        return 2 * moved, 2 * moved + _param_bytes(layer)

    return Setup(
        op=f"AFNO2DLayer({s.channels}, num_blocks={blocks}) on B x H x W x C",
        fn=lambda m, x: m(x),
        inputs=[randn(s.batch, height, width, s.channels)],
        shard_dims=[1],
        grads=[True],
        module=layer,
        bounds=bounds,
        exchange=True,
        bound_text="two all-to-alls (rfft2, irfft2) of the local half-spectrum block, (N-1)/N of each; bwd: "
        "the reverse two + the w1, b1, w2, b2 gradient all-reduce",
    )


def case_finite_differences(s: Shape) -> Setup:
    windows = [(max(j - 1, 0), min(j + 1, s.height - 1)) for j in range(s.height)]
    return Setup(
        op="torch.gradient(x, dim=2)",
        fn=lambda m, x: torch.gradient(x, dim=2)[0],
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=_stencil_bounds(s, windows, s.row_bytes),
        bound_text="halo: 1 row to each neighbour; bwd: those rows' gradients",
        targets=(torch.gradient,),
    )


def case_roll_flip(s: Shape) -> Setup:
    split = s.split()
    return Setup(
        op="torch.roll(x, 1, dims=2)",
        fn=lambda m, x: torch.roll(x, 1, dims=2),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=lambda r: (min(1, split[r]) * s.row_bytes,) * 2,
        bound_text="each rank's last row moves to the next rank (the last rank's to rank 0); bwd: the reverse",
        targets=(torch.roll,),
    )


def case_softmax_cumsum(s: Shape) -> Setup:
    stats = s.row_bytes  # one row of statistics: every entry but the H dim
    return Setup(
        op="F.softmax(x, dim=2) (over the sharded dim)",
        fn=lambda m, x: F.softmax(x, dim=2),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=lambda r: (2 * stats, stats),
        bound_text="fwd: max then sum of exponentials, one row of statistics each; bwd: sum(dy*y), one row",
        targets=(F.softmax,),
    )


def case_losses(s: Shape) -> Setup:
    return Setup(
        op="F.mse_loss(pred, target), both sharded",
        fn=lambda m, x, y: F.mse_loss(x, y),
        inputs=[randn(*s.size), randn(*s.size, seed=1)],
        shard_dims=[2, 2],
        grads=[True, False],
        bounds=lambda r: (FLOAT, 0),
        bound_text="fwd: one scalar all-reduce; bwd: none (the gradient is local)",
        targets=(F.mse_loss,),
    )


def case_linear(s: Shape) -> Setup:
    linear = torch.nn.Linear(s.last, s.last)
    return Setup(
        op=f"Linear({s.last}, {s.last}) over the last dim",
        fn=lambda m, x: m(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        module=linear,
        bounds=lambda r: (0, _param_bytes(linear)),
        bound_text="fwd: none; bwd: the weight and bias gradient all-reduce",
        targets=(F.linear,),
    )


def case_attention(s: Shape) -> Setup:
    shape = (1, s.heads, s.tokens, s.head_dim)
    kv_bytes = 2 * math.prod(shape) * FLOAT
    return Setup(
        op=f"F.scaled_dot_product_attention, q/k/v 1x{s.heads}x{s.tokens}x{s.head_dim} sharded over L",
        fn=lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v),
        inputs=[randn(*shape, seed=i) for i in range(3)],
        shard_dims=[2, 2, 2],
        grads=[True] * 3,
        bounds=lambda r: ((s.ranks - 1) * kv_bytes // s.ranks, 2 * (s.ranks - 1) * kv_bytes // s.ranks),
        exchange=True,
        targets=(F.scaled_dot_product_attention,),
        bound_text="fwd: (N-1)/N of K+V (every block once around the ring); bwd: 2(N-1)/N of K+V (K/V again, "
        "dK/dV partials home)",
    )


class _ChannelMix(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(randn(channels, channels, seed=2) / channels**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bc...,cd->bd...", x, self.weight)


def case_indexing_einsum(s: Shape) -> Setup:
    mix = _ChannelMix(s.channels)
    return Setup(
        op="torch.einsum('bc...,cd->bd...', x, w), w replicated",
        fn=lambda m, x: m(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        module=mix,
        bounds=lambda r: (0, _param_bytes(mix)),
        bound_text="fwd: none; bwd: the weight gradient all-reduce",
        targets=(torch.einsum,),
    )


def case_layout_ops(s: Shape) -> Setup:
    nd = len(s.spatial)

    def tokens(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = torch.cat([x, y], dim=1).permute(0, *range(2, 2 + nd), 1)
        return z.reshape(s.batch, -1, 2 * s.channels)

    return Setup(
        op="torch.cat([x, y], 1), permuted channels-last, reshaped to B x tokens x 2C",
        fn=tokens,
        inputs=[randn(*s.size), randn(*s.size, seed=1)],
        shard_dims=[2, 2],
        grads=[True, True],
        bounds=lambda r: (0, 0),
        bound_text="none: every op is local on H-sharded rows",
        targets=(torch.cat, torch.Tensor.permute, torch.Tensor.reshape),
    )


def case_pointwise(s: Shape) -> Setup:
    return Setup(
        op="F.gelu(x)",
        fn=lambda m, x: F.gelu(x),
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        bounds=lambda r: (0, 0),
        bound_text="none",
        targets=(F.gelu,),
    )


def case_uneven_redistribute(s: Shape) -> Setup:
    base = s.split()
    split = [base[0] + 1, *base[1:-1], base[-1] - 1] if s.ranks > 1 else base
    return Setup(
        op=f"torch.sort(x, dim=2) on H split {'/'.join(map(str, split))} (not torch.chunk's)",
        fn=lambda m, x: torch.sort(x, dim=2).values,
        inputs=[randn(*s.size)],
        shard_dims=[2],
        grads=[True],
        split=split,
        bounds=lambda r: (split[r] * s.row_bytes, 0),
        may_abort=True,  # a collective whose sizes differ between ranks aborts in gloo
        bound_text="the op needs H whole (DTensor's strategy): one all-gather of each rank's true rows; bwd: "
        "none (the replicated gradient is sliced locally)",
        targets=(torch.sort,),
    )


CASES: dict[str, list[Callable[[Shape], Setup]]] = {
    "convolution": [case_convolution],
    "padding": [case_padding],
    "pooling": [case_pooling, case_avg_pooling],
    "resampling": [case_resampling],
    "normalization": [case_batch_norm, case_group_norm, case_layer_norm, case_instance_norm],
    "fft": [case_fft],
    "afno": [case_afno],
    "finite_differences": [case_finite_differences],
    "roll_flip": [case_roll_flip],
    "softmax_cumsum": [case_softmax_cumsum],
    "losses": [case_losses],
    "linear": [case_linear],
    "attention": [case_attention],
    "indexing_einsum": [case_indexing_einsum],
    "layout_ops": [case_layout_ops],
    "pointwise": [case_pointwise],
    "uneven_redistribute": [case_uneven_redistribute],
}
