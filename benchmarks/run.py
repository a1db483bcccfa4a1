"""Benchmark every first-party patch family, and whole PhysicsNeMo models, on ranks it starts itself.

For each patch family, one representative op on a field sharded evenly over its
first spatial dim (``H``), forward and backward, at each ``--ranks`` count:

* **bytes**: the payload bytes each rank hands to collectives (``CommCounter``),
  forward and backward, against the *analytic minimum* derived for the op
  (``docs/benchmarks.md`` gives each derivation) and against the *fallback*: the
  same op inside ``physicsnemo_shardext.disabled(plugins=[family])`` (ShardTensor's
  DTensor fallback, or PhysicsNeMo's own handler where it has one), recorded as
  ``fails: <error>`` where that raises;
* **memory**: each rank's peak extra memory of one forward+backward over the
  single-process run's (the same op on the whole field, in the same process);
  goal ``1/N + 10%``.

Goals, checked per row: bytes within 1.1x of the bound (1.25x for the FFT, AFNO
and attention), at least 5x below the fallback at 4 ranks wherever the fallback
gathers, memory within ``1/N + 10%`` of single-process.

Whole models (PhysicsNeMo's FNO, UNet and Pix2Pix, and timm's VisionTransformer
when timm is installed), input sharded over ``H`` (UNet: ``D``), at 1 rank (the
plain model on the whole input) and at each ``--ranks`` count: per-rank peak
memory of one training step (forward+backward) and its median wall time.

Usage::

    python benchmarks/run.py                                   # every family and model, 2 and 4 gloo CPU ranks
    python benchmarks/run.py --families convolution,fft --ranks 2 --size 1x4x32x32 --models none --json out.json
    python benchmarks/run.py --json docs/benchmarks/results.json --plot docs/benchmarks
    torchrun --nproc-per-node 4 benchmarks/run.py --json out.json   # one world (NCCL on GPUs); models at 1 rank on rank 0

A progress bar goes to stderr; the tables (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    all_ranks_agree,
    counted,
    exit_without_teardown,
    first_line,
    fmt_bytes,
    heap_allocations,
    launch,
    launched_by_torchrun,
    median_ms,
    peak_memory,
    pin_mmap_threshold,
    sync,
)

FAMILIES = (
    "convolution", "padding", "pooling", "resampling", "normalization", "fft", "afno", "finite_differences",
    "roll_flip", "softmax_cumsum", "losses", "linear", "attention", "indexing_einsum", "layout_ops", "pointwise",
    "uneven_redistribute",
)
MODELS = ("fno", "unet", "pix2pix", "vit")
BYTES_GOAL, EXCHANGE_BYTES_GOAL = 1.1, 1.25  # the second for the all-to-all families (FFT, AFNO) and the ring
FALLBACK_GOAL = 5.0  # at 4 ranks, wherever the fallback gathers
MEMORY_SLACK = 0.10  # per-rank peak within 1/N + 10% of single-process
FLOAT, COMPLEX = 4, 8  # bytes of a float32 and a complex64 element
PROBE_TIMEOUT_S = 60  # collectives of a probe world: a hang becomes a timeout


# == the cases ====================================================================================
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


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
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
    return [(max(o * stride - padding, 0), min(o * stride - padding + dilation * (kernel - 1), length - 1))
            for o in range(out)]


def case_convolution(s: Shape) -> Setup:
    nd = len(s.spatial)
    conv = getattr(torch.nn, f"Conv{nd}d")(s.channels, s.channels, 3, stride=2, padding=1)
    windows = _conv_windows(s.height, 3, 2, 1)
    return Setup(
        op=f"Conv{nd}d({s.channels}, {s.channels}, 3, stride=2, padding=1)",
        fn=lambda m, x: m(x), inputs=[_randn(*s.size)], shard_dims=[2], grads=[True], module=conv,
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
        fn=lambda m, x: F.pad(x, pad, mode="circular"), inputs=[_randn(*s.size)], shard_dims=[2], grads=[True],
        bounds=bounds, bound_text="the wrapped rows: 1 row each way between rank 0 and rank N-1; bwd the same",
        targets=(F.pad,),
    )


def case_pooling(s: Shape) -> Setup:
    nd = len(s.spatial)
    windows = _conv_windows(s.height, 3, 2, 1)
    return Setup(
        op=f"F.max_pool{nd}d(x, 3, stride=2, padding=1)",
        fn=lambda m, x: getattr(F, f"max_pool{nd}d")(x, 3, stride=2, padding=1),
        inputs=[_randn(*s.size)], shard_dims=[2], grads=[True],
        bounds=_stencil_bounds(s, windows, s.row_bytes),
        bound_text="halo: fewest rows crossing each boundary x row bytes; bwd: those rows' gradients",
        targets=(getattr(F, f"max_pool{nd}d"),),
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
        inputs=[_randn(*s.size)], shard_dims=[2], grads=[True],
        bounds=_stencil_bounds(s, windows, s.row_bytes),
        bound_text="halo: 1 row per boundary (the output rows between two shards need both); bwd: its gradient",
        targets=(F.interpolate,),
    )


def case_batch_norm(s: Shape) -> Setup:
    nd = len(s.spatial)
    norm = getattr(torch.nn, f"BatchNorm{nd}d")(s.channels)
    stats = 2 * s.channels * FLOAT
    return Setup(
        op=f"BatchNorm{nd}d({s.channels}), training", fn=lambda m, x: m(x), inputs=[_randn(*s.size)],
        shard_dims=[2], grads=[True], module=norm, bounds=lambda r: (stats, stats),
        bound_text="fwd: sum and sum of squares per channel (2C floats); bwd: sum(dy), sum(dy*x_hat) per "
                   "channel, which are also the bias and weight gradients (2C floats)",
        targets=(F.batch_norm,),
    )


def case_group_norm(s: Shape) -> Setup:
    groups = 4 if s.channels % 4 == 0 else 1
    norm = torch.nn.GroupNorm(groups, s.channels)
    stats = 2 * s.batch * groups * FLOAT
    return Setup(
        op=f"GroupNorm({groups}, {s.channels})", fn=lambda m, x: m(x), inputs=[_randn(*s.size)], shard_dims=[2],
        grads=[True], module=norm, bounds=lambda r: (stats, stats + 2 * s.channels * FLOAT),
        bound_text="fwd: 2 statistics per sample and group (2BG floats); bwd: 2BG floats for dx + the "
                   "weight and bias gradients (2C floats)",
        targets=(F.group_norm,),
    )


def case_layer_norm(s: Shape) -> Setup:
    norm = torch.nn.LayerNorm(s.last)
    return Setup(
        op=f"LayerNorm({s.last}) over the last (unsharded) dim", fn=lambda m, x: m(x), inputs=[_randn(*s.size)],
        shard_dims=[2], grads=[True], module=norm, bounds=lambda r: (0, _param_bytes(norm)),
        bound_text="fwd: none (rows are local); bwd: the weight and bias gradient all-reduce",
        targets=(F.layer_norm,),
    )


def case_instance_norm(s: Shape) -> Setup:
    nd = len(s.spatial)
    norm = getattr(torch.nn, f"InstanceNorm{nd}d")(s.channels)
    stats = 2 * s.batch * s.channels * FLOAT
    return Setup(
        op=f"InstanceNorm{nd}d({s.channels})", fn=lambda m, x: m(x), inputs=[_randn(*s.size)], shard_dims=[2],
        grads=[True], module=norm, bounds=lambda r: (stats, stats),
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
        op=f"torch.fft.rfftn(x, dim={dims})", fn=lambda m, x: torch.fft.rfftn(x, dim=dims),
        inputs=[_randn(*s.size)], shard_dims=[2], grads=[True], bounds=bounds, exchange=True,
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
        fn=lambda m, x: m(x), inputs=[_randn(s.batch, height, width, s.channels)], shard_dims=[1], grads=[True],
        module=layer, bounds=bounds, exchange=True,
        bound_text="two all-to-alls (rfft2, irfft2) of the local half-spectrum block, (N-1)/N of each; bwd: "
                   "the reverse two + the w1, b1, w2, b2 gradient all-reduce",
    )


def case_finite_differences(s: Shape) -> Setup:
    windows = [(max(j - 1, 0), min(j + 1, s.height - 1)) for j in range(s.height)]
    return Setup(
        op="torch.gradient(x, dim=2)", fn=lambda m, x: torch.gradient(x, dim=2)[0],
        inputs=[_randn(*s.size)], shard_dims=[2], grads=[True],
        bounds=_stencil_bounds(s, windows, s.row_bytes),
        bound_text="halo: 1 row to each neighbour; bwd: those rows' gradients",
        targets=(torch.gradient,),
    )


def case_roll_flip(s: Shape) -> Setup:
    split = s.split()
    return Setup(
        op="torch.roll(x, 1, dims=2)", fn=lambda m, x: torch.roll(x, 1, dims=2),
        inputs=[_randn(*s.size)], shard_dims=[2], grads=[True],
        bounds=lambda r: (min(1, split[r]) * s.row_bytes,) * 2,
        bound_text="each rank's last row moves to the next rank (the last rank's to rank 0); bwd: the reverse",
        targets=(torch.roll,),
    )


def case_softmax_cumsum(s: Shape) -> Setup:
    stats = s.row_bytes  # one row of statistics: every entry but the H dim
    return Setup(
        op="F.softmax(x, dim=2) (over the sharded dim)", fn=lambda m, x: F.softmax(x, dim=2),
        inputs=[_randn(*s.size)], shard_dims=[2], grads=[True], bounds=lambda r: (2 * stats, stats),
        bound_text="fwd: max then sum of exponentials, one row of statistics each; bwd: sum(dy*y), one row",
        targets=(F.softmax,),
    )


def case_losses(s: Shape) -> Setup:
    return Setup(
        op="F.mse_loss(pred, target), both sharded", fn=lambda m, x, y: F.mse_loss(x, y),
        inputs=[_randn(*s.size), _randn(*s.size, seed=1)], shard_dims=[2, 2], grads=[True, False],
        bounds=lambda r: (FLOAT, 0),
        bound_text="fwd: one scalar all-reduce; bwd: none (the gradient is local)",
        targets=(F.mse_loss,),
    )


def case_linear(s: Shape) -> Setup:
    linear = torch.nn.Linear(s.last, s.last)
    return Setup(
        op=f"Linear({s.last}, {s.last}) over the last dim", fn=lambda m, x: m(x), inputs=[_randn(*s.size)],
        shard_dims=[2], grads=[True], module=linear, bounds=lambda r: (0, _param_bytes(linear)),
        bound_text="fwd: none; bwd: the weight and bias gradient all-reduce",
        targets=(F.linear,),
    )


def case_attention(s: Shape) -> Setup:
    shape = (1, s.heads, s.tokens, s.head_dim)
    kv_bytes = 2 * math.prod(shape) * FLOAT
    return Setup(
        op=f"F.scaled_dot_product_attention, q/k/v 1x{s.heads}x{s.tokens}x{s.head_dim} sharded over L",
        fn=lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v),
        inputs=[_randn(*shape, seed=i) for i in range(3)], shard_dims=[2, 2, 2], grads=[True] * 3,
        bounds=lambda r: ((s.ranks - 1) * kv_bytes // s.ranks, 2 * (s.ranks - 1) * kv_bytes // s.ranks),
        exchange=True, targets=(F.scaled_dot_product_attention,),
        bound_text="fwd: (N-1)/N of K+V (every block once around the ring); bwd: 2(N-1)/N of K+V (K/V again, "
                   "dK/dV partials home)",
    )


class _ChannelMix(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(_randn(channels, channels, seed=2) / channels**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bc...,cd->bd...", x, self.weight)


def case_indexing_einsum(s: Shape) -> Setup:
    mix = _ChannelMix(s.channels)
    return Setup(
        op="torch.einsum('bc...,cd->bd...', x, w), w replicated", fn=lambda m, x: m(x),
        inputs=[_randn(*s.size)], shard_dims=[2], grads=[True], module=mix,
        bounds=lambda r: (0, _param_bytes(mix)), bound_text="fwd: none; bwd: the weight gradient all-reduce",
        targets=(torch.einsum,),
    )


def case_layout_ops(s: Shape) -> Setup:
    nd = len(s.spatial)

    def tokens(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = torch.cat([x, y], dim=1).permute(0, *range(2, 2 + nd), 1)
        return z.reshape(s.batch, -1, 2 * s.channels)

    return Setup(
        op="torch.cat([x, y], 1), permuted channels-last, reshaped to B x tokens x 2C", fn=tokens,
        inputs=[_randn(*s.size), _randn(*s.size, seed=1)], shard_dims=[2, 2], grads=[True, True],
        bounds=lambda r: (0, 0), bound_text="none: every op is local on H-sharded rows",
        targets=(torch.cat, torch.Tensor.permute, torch.Tensor.reshape),
    )


def case_pointwise(s: Shape) -> Setup:
    return Setup(
        op="F.gelu(x)", fn=lambda m, x: F.gelu(x), inputs=[_randn(*s.size)], shard_dims=[2], grads=[True],
        bounds=lambda r: (0, 0), bound_text="none", targets=(F.gelu,),
    )


def case_uneven_redistribute(s: Shape) -> Setup:
    base = s.split()
    split = [base[0] + 1, *base[1:-1], base[-1] - 1] if s.ranks > 1 else base
    return Setup(
        op=f"torch.sort(x, dim=2) on H split {'/'.join(map(str, split))} (not torch.chunk's)",
        fn=lambda m, x: torch.sort(x, dim=2).values, inputs=[_randn(*s.size)], shard_dims=[2], grads=[True],
        split=split, bounds=lambda r: (split[r] * s.row_bytes, 0),
        may_abort=True,  # a collective whose sizes differ between ranks aborts in gloo
        bound_text="the op needs H whole (DTensor's strategy): one all-gather of each rank's true rows; bwd: "
                   "none (the replicated gradient is sliced locally)",
        targets=(torch.sort,),
    )


CASES: dict[str, list[Callable[[Shape], Setup]]] = {
    "convolution": [case_convolution],
    "padding": [case_padding],
    "pooling": [case_pooling],
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


# == measuring one case =============================================================================
@dataclass
class CaseResult:
    """What one rank measured for one case."""

    family: str
    op: str
    ranks: int
    rank: int
    bound_text: str
    exchange: bool
    forward_bytes: int | None = None
    backward_bytes: int | None = None
    forward_calls: int | None = None
    backward_calls: int | None = None
    forward_bound: int = 0
    backward_bound: int = 0
    peak_mib: float | None = None
    single_peak_mib: float | None = None
    max_error: float | None = None
    status: str = "ok"
    fallback_path: str = ""
    fallback_status: str = "ok"
    fallback_forward_bytes: int | None = None
    fallback_backward_bytes: int | None = None
    fallback_ops: dict[str, int] = field(default_factory=dict)
    fallback_peak_mib: float | None = None
    fallback_max_error: float | None = None
    fallback_partial_grads: bool = False


def _cotangent(output: torch.Tensor, full: torch.Tensor) -> torch.Tensor | None:
    """``full`` laid out like ``output`` (ShardTensor shards and split, Replicate, or plain); None for scalars."""
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from physicsnemo_shardext.testing import shard_tensor

    if output.dim() == 0:
        return None
    if not isinstance(output, (ShardTensor, DTensor)):
        return full
    placements = [Replicate() if isinstance(p, Partial) else p for p in output.placements]
    if isinstance(output, ShardTensor):
        shapes = output._spec.sharding_shapes()
        sizes = {m: [shape[p.dim] for shape in shapes[m]] for m, p in enumerate(placements) if isinstance(p, Shard)}
        return shard_tensor(full, output.device_mesh, placements, sizes or None)
    return distribute_tensor(full, output.device_mesh, placements)


def _full(t: torch.Tensor) -> torch.Tensor:
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, (ShardTensor, DTensor)) else t


def _fallback_path(targets: Sequence[Any]) -> str:
    """Who answers the op once its family is off: PhysicsNeMo's own handler, another plugin, or DTensor."""
    import physicsnemo_shardext
    from physicsnemo_shardext import shard_registries
    from physicsnemo_shardext.shard_registries import PatchLevel

    for target in targets:
        with contextlib.suppress(Exception):
            if shard_registries.current_handler(PatchLevel.FUNCTION, target) is not None:
                installed = physicsnemo_shardext.get_registry().provenance(target)
                return "PhysicsNeMo handler" if installed is None else f"plugin {installed.plugin.name}"
    return "DTensor fallback"


class _Run:
    """The sharded op, its inputs and parameters on this rank: counted passes and a measured step."""

    def __init__(self, setup: Setup, mesh: Any, device: torch.device) -> None:
        from torch.distributed.tensor import Shard, distribute_module

        from physicsnemo_shardext.testing import shard_tensor

        self.setup = setup
        self.module = distribute_module(copy.deepcopy(setup.module).to(device), mesh) if setup.module else None
        self.inputs = [
            t.to(device) if d is None
            else shard_tensor(t.to(device), mesh, [Shard(d)], setup.split, requires_grad=g)
            for t, d, g in zip(setup.inputs, setup.shard_dims, setup.grads)
        ]
        self.cotangent: torch.Tensor | None = None

    def clear(self) -> None:
        for t in self.inputs:
            t.grad = None
        if self.module is not None:
            self.module.zero_grad(set_to_none=True)

    def forward(self) -> torch.Tensor:
        return self.setup.fn(self.module, *self.inputs)

    def backward(self, out: torch.Tensor) -> None:
        out.backward(self.cotangent)

    def step(self) -> None:
        self.clear()
        self.backward(self.forward())


@dataclass
class Reference:
    """The single-process run: output, input and parameter gradients, the cotangent, its peak memory."""

    output: torch.Tensor
    cotangent: torch.Tensor
    input_grads: list[torch.Tensor | None]
    param_grads: dict[str, torch.Tensor]
    peak_mib: float | None


def _single(setup: Setup, device: torch.device) -> Reference:
    """Single-process run on the whole field (also the warm-up), then one measured step."""
    module = copy.deepcopy(setup.module).to(device) if setup.module else None
    inputs = [t.to(device).detach().requires_grad_(g) for t, g in zip(setup.inputs, setup.grads)]
    out = setup.fn(module, *inputs)
    generator = torch.Generator().manual_seed(7)
    cotangent = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(device)
    out.backward(cotangent if out.dim() else None)
    params = {} if module is None else {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    reference = Reference(out.detach(), cotangent, [t.grad for t in inputs], params, None)
    del out

    def clear() -> None:
        for t in inputs:
            t.grad = None
        if module is not None:
            module.zero_grad(set_to_none=True)

    clear()
    with peak_memory(device) as peak:
        result = setup.fn(module, *inputs)
        result.backward(cotangent if result.dim() else None)
        del result
    reference.peak_mib = peak[0]
    return reference


def _difference(what: str, actual: torch.Tensor | None, expected: torch.Tensor | None) -> tuple[float, str]:
    """Max abs difference, and a note when it is beyond round-off.

    By the package's one comparison rule (`physicsnemo_shardext.comparison`): every element within
    ``atol + rtol * |r|``, with ``rtol = 1e-3`` and ``atol = 1e-3`` of the values' scale (at least 1).
    """
    if expected is None:
        return 0.0, ""
    if actual is None:
        return math.inf, f"no {what}"
    full = _full(actual).detach()
    if full.shape != expected.shape:
        return math.inf, f"{what} of shape {tuple(full.shape)}, not {tuple(expected.shape)}"
    if not full.numel():
        return 0.0, ""
    from physicsnemo_shardext.comparison import Tolerance, compare

    scale = max(expected.abs().max().item(), 1.0)
    result = compare(full, expected, Tolerance(rtol=1e-3, atol=1e-3 * scale), check_dtype=False)
    return result.max_abs_error, ("" if result.passed else f"{what} off: {result.describe()}")


def _compare(run: _Run, out: torch.Tensor | None, reference: Reference, backward: bool) -> tuple[float, str]:
    """The largest difference from single-process (output, then every gradient) and the first wrong one."""
    checks = [("output", out, reference.output)]
    if backward:
        checks += [(f"gradient of input {i}", t.grad, g)
                   for i, (t, g) in enumerate(zip(run.inputs, reference.input_grads)) if g is not None]
        if run.module is not None:
            params = dict(run.module.named_parameters())
            checks += [(f"gradient of {n}", params[n].grad if n in params else None, g)
                       for n, g in reference.param_grads.items()]
    worst, wrong = 0.0, ""
    for what, actual, expected in checks:
        error, note = _difference(what, actual, expected)
        worst = max(worst, error)
        wrong = wrong or note
    return worst, wrong


@dataclass
class Measured:
    """One variant on one rank: status (``ok``, ``fails: ...``, ``wrong: ...``), collectives, memory, error."""

    status: str = "ok"
    forward: Any = None  # CommStats
    backward: Any = None
    peak_mib: float | None = None
    error: float = math.nan
    partial_grads: bool = False  # a parameter gradient came back Partial: its reduction is left to the caller


def _partial_grads(run: _Run) -> bool:
    from torch.distributed.tensor import Partial

    if run.module is None:
        return False
    return any(isinstance(pl, Partial) for p in run.module.parameters() if p.grad is not None
               for pl in getattr(p.grad, "placements", ()))


def _measure(run: _Run, reference: Reference, device: torch.device) -> Measured:
    """Counted forward and backward, checked against single-process, then one measured step."""
    m = Measured()
    out = None
    try:
        with counted() as m.forward:
            out = run.forward()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        m.status, m.forward = f"fails: {type(exc).__name__}: {first_line(exc)}", None
    if not all_ranks_agree(m.status == "ok"):
        m.status, m.forward = (m.status if m.status != "ok" else "fails on another rank"), None
        return m
    run.cotangent = _cotangent(out, reference.cotangent)
    try:
        with counted() as m.backward:
            run.backward(out)
    except Exception as exc:  # noqa: BLE001
        m.status, m.backward = f"backward fails: {type(exc).__name__}: {first_line(exc)}", None
    backward_ok = all_ranks_agree(m.status == "ok")
    m.partial_grads = backward_ok and _partial_grads(run)
    m.error, wrong = _compare(run, out, reference, backward_ok)
    del out
    if not backward_ok:
        m.status, m.backward = (m.status if m.status != "ok" else "backward fails on another rank"), None
        return m
    if wrong:
        m.status = f"wrong: {wrong}"
    run.clear()
    sync(device)
    with peak_memory(device) as peak:
        run.step()
    sync(device)
    m.peak_mib = peak[0]
    return m


def measure_case(family: str, build: Callable[[Shape], Setup], shape: Shape, mesh: Any, device: torch.device
                 ) -> CaseResult:
    """Single-process, sharded with the family, sharded with the family off: bytes, memory, errors."""
    import physicsnemo_shardext

    rank = dist.get_rank()
    torch.manual_seed(0)  # module parameters: the same on every rank and in the single-process run
    setup = build(shape)
    fwd_bound, bwd_bound = setup.bounds(rank)
    result = CaseResult(family, setup.op, shape.ranks, rank, setup.bound_text, setup.exchange,
                        forward_bound=fwd_bound, backward_bound=bwd_bound)
    reference = _single(setup, device)
    result.single_peak_mib = reference.peak_mib

    aborted = dict(_measure_case_context.aborted)
    key = f"{family}|{setup.op}"
    if setup.may_abort and _measure_case_context.unprobed:
        for variant in ("ours", "fallback"):
            aborted[f"{key}|{variant}"] = "may abort the process: not run under torchrun, where no probe world can be spawned first"
    if f"{key}|ours" in aborted:
        ours = Measured(status=f"fails: {_kills(aborted[f'{key}|ours'])}; not run")
    else:
        run = _Run(setup, mesh, device)
        ours = _measure(run, reference, device)
        del run
    result.status, result.peak_mib, result.max_error = ours.status, ours.peak_mib, ours.error
    if ours.forward is not None:
        result.forward_bytes, result.forward_calls = ours.forward.total_bytes, ours.forward.total_calls
    if ours.backward is not None:
        result.backward_bytes, result.backward_calls = ours.backward.total_bytes, ours.backward.total_calls

    with physicsnemo_shardext.disabled(plugins=[family]):
        result.fallback_path = _fallback_path(setup.targets)
        if f"{key}|fallback" in aborted:
            fallback = Measured(status=f"fails: {_kills(aborted[f'{key}|fallback'])}; not run")
        else:
            run = _Run(setup, mesh, device)
            fallback = _measure(run, reference, device)
            del run
    result.fallback_status, result.fallback_peak_mib = fallback.status, fallback.peak_mib
    result.fallback_max_error, result.fallback_partial_grads = fallback.error, fallback.partial_grads
    for stats in (fallback.forward, fallback.backward):
        if stats is not None:
            for key, n in stats.bytes.items():
                result.fallback_ops[key] = result.fallback_ops.get(key, 0) + n
    if fallback.forward is not None:
        result.fallback_forward_bytes = fallback.forward.total_bytes
    if fallback.backward is not None:
        result.fallback_backward_bytes = fallback.backward.total_bytes
    return result


class _measure_case_context:  # noqa: N801 - a namespace: what the probes found, set per world
    aborted: dict[str, str] = {}
    unprobed: bool = False  # under torchrun no probe world can be spawned: may_abort cases are not run


def probe_world(args: argparse.Namespace) -> None:
    """Run the ``may_abort`` cases once, each variant announced before and after, stderr to a file.

    A variant announced but never finished killed the process; the gloo message (``what(): ...``) is in
    the captured stderr. Python exceptions are fine here (the real run reports them).
    """
    import physicsnemo_shardext

    rank = int(os.environ["RANK"])
    base = Path(args.probe_file)
    err = open(f"{base}.{rank}.err", "w")  # noqa: SIM115 - open until the process ends
    os.dup2(err.fileno(), 2)
    warnings.filterwarnings("ignore")
    manager = _init_process_group(timeout_s=PROBE_TIMEOUT_S)  # a hang shows as a timeout, soon
    mesh = manager.initialize_mesh((-1,), ("domain",))
    shape = Shape(tuple(args.size), dist.get_world_size(), args.tokens, args.heads, args.head_dim)
    with open(f"{base}.{rank}", "w") as log:
        for family in args.family_list:
            for build in CASES[family]:
                torch.manual_seed(0)
                setup = build(shape)
                if not setup.may_abort:
                    continue
                for variant in ("ours", "fallback"):
                    key = f"{family}|{setup.op}|{variant}"
                    if key in args.probe_skip:
                        continue
                    log.write(f"start {key}\n")
                    log.flush()
                    context = physicsnemo_shardext.disabled(plugins=[family]) if variant == "fallback" \
                        else contextlib.nullcontext()
                    try:
                        with context:
                            run = _Run(setup, mesh, manager.device)
                            out = run.forward()
                            run.cotangent = _cotangent(out, _randn(*out.shape, seed=7).to(out.dtype))
                            run.backward(out)
                    except Exception as exc:  # noqa: BLE001 - exceptions are the real run's to report ...
                        text = f"{type(exc).__name__}: {str(exc)}".lower()
                        if any(w in text for w in ("timed out", "timeout", "connection closed", "connection reset")):
                            log.write(f"hang {key}\n")  # ... but not a collective that never completes:
                            log.flush()
                            exit_without_teardown(1)  # the group is broken now
                    dist.barrier()
                    log.write(f"done {key}\n")
                    log.flush()
    physicsnemo_shardext.shutdown()


def _kills(reason: str) -> str:
    """How a probed variant failed, as a phrase: it hangs, or it aborts the process."""
    return reason if reason.startswith(("hangs", "may")) else f"the process aborts ({reason})"


def _abort_reason(what: str) -> str:
    """gloo's enforce message in a few words (``... 1152 vs 1024. Received data size doesn't match ...``)."""
    import re

    sizes = re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)", what)
    if sizes:
        return f"gloo: a rank received {sizes.group(1)} B where it expected {sizes.group(2)} B"
    return what.split("] ", 1)[-1]


def run_probes(args: argparse.Namespace, ranks: int, tmp: str) -> dict[str, str]:
    """Spawn one world of ``ranks`` that runs the ``may_abort`` cases; return what aborted and why."""
    shape = Shape(tuple(args.size), ranks, args.tokens, args.heads, args.head_dim)
    if not any(build(shape).may_abort for family in args.family_list for build in CASES[family]):
        return {}
    aborted: dict[str, str] = {}
    for attempt in range(8):  # one more world after each abort, skipping what is known
        probe_args = copy.copy(args)
        probe_args.probe_file = str(Path(tmp) / f"probe-{ranks}-{attempt}")
        probe_args.probe_skip = set(aborted)
        try:
            launch(probe_world, probe_args, ranks)
            return aborted
        except Exception:  # noqa: BLE001 - an aborted rank ends the spawn with an exception
            pass
        unfinished, hung, reason = set(), set(), "unknown"
        for rank in range(ranks):
            started, done = set(), set()
            with contextlib.suppress(OSError):
                for line in Path(f"{probe_args.probe_file}.{rank}").read_text().splitlines():
                    state, key = line.split(" ", 1)
                    {"start": started, "done": done, "hang": hung}[state].add(key)
            unfinished |= started - done
            with contextlib.suppress(OSError):
                for line in Path(f"{probe_args.probe_file}.{rank}.err").read_text().splitlines():
                    if "what():" in line:
                        reason = _abort_reason(line.split("what():", 1)[1].strip())
        if not unfinished:
            break  # died outside a variant: nothing more to learn
        if hung:
            reason = f"hangs: a collective timed out after {PROBE_TIMEOUT_S} s (ranks issue different collectives)"
        elif reason == "unknown":
            reason = "hangs or dies: the probe world ended in this variant without a gloo message"
        aborted.update({key: reason[:160] for key in unfinished})
    return aborted


# == whole models ===================================================================================
@dataclass
class ModelResult:
    """One rank's measurement of one model at one rank count (1: the plain model on the whole input)."""

    model: str
    config: str
    ranks: int
    rank: int
    input_shape: list[int]
    peak_mib: float | None = None
    median_ms: float | None = None
    status: str = "ok"


def build_model(name: str, res: int) -> tuple[torch.nn.Module, torch.Tensor, str]:
    """The model, its full input (sharded over dim 2) and a one-line description, at resolution ``res``."""
    torch.manual_seed(0)
    if name == "fno":
        from physicsnemo.models.fno import FNO

        modes = max(2, min(16, res // 8))
        model = FNO(in_channels=3, out_channels=1, dimension=2, latent_channels=32, num_fno_layers=4,
                    num_fno_modes=modes)
        return model, _randn(1, 3, res, res), f"FNO 2-D, latent 32, 4 layers, {modes} modes, padding 8, coords"
    if name == "unet":
        from physicsnemo.models.unet import UNet

        side = max(4, res // 8)
        model = UNet(in_channels=1, out_channels=1, model_depth=3, feature_map_channels=[8, 8, 16, 16, 32, 32],
                     gradient_checkpointing=False)
        return model, _randn(1, 1, side, side, side), "UNet 3-D, depth 3, channels 8-32, GroupNorm, MaxPool3d(2)"
    if name == "pix2pix":
        from physicsnemo.models.pix2pix import Pix2Pix

        model = Pix2Pix(in_channels=1, out_channels=1, dimension=2, conv_layer_size=32, n_downsampling=2,
                        n_upsampling=2, n_blocks=2, batch_norm=True, padding_type="reflect")
        return model, _randn(1, 1, res, res), "Pix2Pix 2-D, 32 channels, 2 down/up, 2 blocks, BatchNorm, reflect"
    if name == "vit":
        from timm.models.vision_transformer import VisionTransformer

        patch = max(2, res // 32)
        model = VisionTransformer(img_size=res, patch_size=patch, in_chans=3, num_classes=10, embed_dim=256, depth=4,
                                  num_heads=8, mlp_ratio=2.0, class_token=False, global_pool="avg")
        return model, _randn(1, 3, res, res), (f"timm ViT, patch {patch}, {(res // patch) ** 2} tokens, width 256, "
                                               "depth 4, 8 heads, no class token")
    raise ValueError(name)


Timer = Callable[[], None]


def measure_model(name: str, args: argparse.Namespace, mesh: Any, device: torch.device, ranks: int
                  ) -> tuple[ModelResult, Timer | None]:
    """One training step (forward+backward) of ``name``: sharded over dim 2 on ``mesh``, or plain (``ranks=1``).

    Measures the peak memory now and returns a timer that fills in the median step time: call the
    timers only after every memory measurement of the process, inside ``heap_allocations()`` (memory
    freed to glibc's heap while timing would hide later peaks: a Pix2Pix step measured after an FNO
    was timed read 17 MiB instead of 106).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        model, full, config = build_model(name, args.model_res)
    except ImportError as exc:
        return ModelResult(name, "", ranks, rank, [], status=f"skipped: {first_line(exc)}"), None
    result = ModelResult(name, config, ranks, rank, list(full.shape))
    model = model.to(device)
    if ranks == 1:
        x = full.to(device).requires_grad_(True)
        local_sync: Callable[[], None] = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    else:
        from torch.distributed.tensor import Shard, distribute_module

        from physicsnemo_shardext.testing import shard_tensor

        model = distribute_module(model, mesh)
        x = shard_tensor(full.to(device), mesh, [Shard(2)], requires_grad=True)
        local_sync = lambda: sync(device)  # noqa: E731
    cotangent: list[torch.Tensor | None] = [None]

    def step() -> None:
        x.grad = None
        model.zero_grad(set_to_none=True)
        out = model(x)
        if cotangent[0] is None:
            full_cotangent = _randn(*out.shape, seed=7).to(device)
            cotangent[0] = full_cotangent if ranks == 1 else _cotangent(out, full_cotangent)
        out.backward(cotangent[0])

    ok = True
    try:
        step()  # warm-up
    except Exception as exc:  # noqa: BLE001
        ok, result.status = False, f"fails: {type(exc).__name__}: {first_line(exc)}"
    if ranks > 1 and not all_ranks_agree(ok):
        result.status = result.status if not ok else "fails on another rank"
        return result, None
    if not ok:
        return result, None
    x.grad = None
    model.zero_grad(set_to_none=True)
    local_sync()
    with peak_memory(device) as peak:
        step()
    result.peak_mib = peak[0]

    def timer() -> None:
        if ranks == 1:  # this process alone (under torchrun the other ranks wait at a barrier)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                step()
                local_sync()
                times.append(time.perf_counter() - start)
            result.median_ms = statistics.median(times) * 1e3
        else:
            result.median_ms = median_ms(step, args.repeats, device)

    return result, timer


# == one world of ranks ===============================================================================
class Progress:
    """A progress bar on stderr (rank 0 only): ``[#####.....] 7/40 2 ranks: softmax_cumsum``."""

    def __init__(self, done: int, total: int, enabled: bool) -> None:
        self.done, self.total, self.enabled = done, max(total, 1), enabled
        self.tty = sys.stderr.isatty()

    def show(self, label: str) -> None:
        if not (self.enabled and self.tty):
            return
        width = 30
        filled = width * self.done // self.total
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
        sys.stderr.write("\r" + line.ljust(90))
        sys.stderr.flush()

    def advance(self, label: str) -> None:
        self.done += 1
        if self.tty:
            self.show(label)
        elif self.enabled:  # a log file: one line per finished task
            sys.stderr.write(f"[{self.done}/{self.total}] {label} done\n")
            sys.stderr.flush()


def _init_process_group(timeout_s: float = 600) -> Any:
    """Gloo on CPU, with a timeout (10 minutes: a rank-local failure does not hang for half an hour)."""
    import physicsnemo_shardext

    if not torch.cuda.is_available() and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return physicsnemo_shardext.initialize()


def run_world(args: argparse.Namespace) -> None:
    """Body of every rank of one world: the families, then the models; rank 0 writes ``args.world_out``."""
    pin_mmap_threshold()
    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    families: list[dict] = []
    models: list[dict] = []
    progress = Progress(args.progress_done, args.progress_total, rank == 0 and not args.no_progress)
    if world == 1:  # the models' single-process baseline (spawned on its own)
        measured = []
        for name in args.model_list:
            progress.show(f"1 rank: {name}")
            measured.append(measure_model(name, args, None, device, 1))
            progress.advance(f"1 rank: {name}")
        with heap_allocations():  # after every memory measurement
            for _, timer in measured:
                if timer is not None:
                    timer()
        models.extend(dataclasses.asdict(result) for result, _ in measured)
        _write_world(args, 1, families, models)
        return

    import physicsnemo_shardext

    _measure_case_context.aborted = getattr(args, "aborted", {})
    _measure_case_context.unprobed = getattr(args, "unprobed", False)
    manager = _init_process_group()
    try:
        device = manager.device
        mesh = manager.initialize_mesh((-1,), ("domain",))
        shape = Shape(tuple(args.size), world, args.tokens, args.heads, args.head_dim)
        rows: list[Any] = []
        for family in args.family_list:
            for build in CASES[family]:
                progress.show(f"{world} ranks: {family}")
                rows.append(measure_case(family, build, shape, mesh, device))
            progress.advance(f"{world} ranks: {family}")
        measured: list[tuple[ModelResult, Timer | None]] = []
        for name in args.model_list:
            if args.single_models:  # under torchrun: the 1-rank baseline on rank 0, the others waiting
                progress.show(f"1 rank: {name}")
                if rank == 0:
                    measured.append(measure_model(name, args, None, device, 1))
                dist.barrier()
                progress.advance(f"1 rank: {name}")
            progress.show(f"{world} ranks: {name}")
            measured.append(measure_model(name, args, mesh, device, world))
            progress.advance(f"{world} ranks: {name}")
        with heap_allocations():  # after every memory measurement
            single_timers = [t for r, t in measured if r.ranks == 1 and t is not None]
            for _ in range(len(args.model_list) if args.single_models else 0):
                if rank == 0 and single_timers:
                    single_timers.pop(0)()
                dist.barrier()
            for result, timer in measured:
                if result.ranks > 1 and timer is not None:
                    timer()
        model_rows = [result for result, _ in measured]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, ([dataclasses.asdict(r) for r in rows],
                                          [dataclasses.asdict(r) for r in model_rows]))
        if rank == 0:
            for case_rows, model_rows_of_rank in gathered:
                families.extend(case_rows)
                models.extend(model_rows_of_rank)
            _write_world(args, world, families, models)
    finally:
        physicsnemo_shardext.shutdown()


def _write_world(args: argparse.Namespace, world: int, families: list[dict], models: list[dict]) -> None:
    meta = {"backend": dist.get_backend() if dist.is_initialized() else "none",
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    Path(args.world_out).write_text(json.dumps({"world": world, "meta": meta, "families": families,
                                                "models": models}))


# == the report =====================================================================================
def _ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``; 0/0 is 1 (both at the bound), x/0 is None (unbounded)."""
    if denominator:
        return numerator / denominator
    return 1.0 if not numerator else None


def summarize_cases(rows: list[dict]) -> list[dict]:
    """One entry per (case, ranks): per-rank lists, ratios and the goals."""
    grouped: dict[tuple[str, str, int], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["family"], row["op"], row["ranks"]), []).append(row)
    summaries = []
    for (family, op, ranks), per_rank in grouped.items():
        per_rank.sort(key=lambda r: r["rank"])
        first = per_rank[0]

        def column(key: str) -> list:
            return [r[key] for r in per_rank]

        def total(key: str) -> int | None:
            values = column(key)
            return None if any(v is None for v in values) else sum(values)

        status = next((r["status"] for r in per_rank if r["status"] != "ok"), "ok")
        fallback_status = next((r["fallback_status"] for r in per_rank if r["fallback_status"] != "ok"), "ok")
        fwd, bwd = total("forward_bytes"), total("backward_bytes")
        fwd_bound, bwd_bound = total("forward_bound"), total("backward_bound")
        fb_fwd, fb_bwd = total("fallback_forward_bytes"), total("fallback_backward_bytes")
        ours = None if fwd is None or bwd is None else fwd + bwd
        fallback_bytes = None if fb_fwd is None else fb_fwd + (fb_bwd or 0)
        gathers = any("gather" in key for r in per_rank for key in r["fallback_ops"])
        fwd_ratio = None if fwd is None else _ratio(fwd, fwd_bound)
        bwd_ratio = None if bwd is None else _ratio(bwd, bwd_bound)
        fallback_ran = fallback_status == "ok" or fallback_status.startswith("wrong")
        fallback_ratio = None
        if fallback_bytes is not None and ours is not None and fallback_ran:
            fallback_ratio = _ratio(fallback_bytes, ours)
        memory_ratios = [None if not r["single_peak_mib"] or r["peak_mib"] is None else r["peak_mib"] / r["single_peak_mib"]
                         for r in per_rank]
        memory_ratio = None if any(m is None for m in memory_ratios) else max(memory_ratios)
        bytes_goal = EXCHANGE_BYTES_GOAL if first["exchange"] else BYTES_GOAL
        memory_goal = 1 / ranks + MEMORY_SLACK
        goals = {
            "bytes": status == "ok" and fwd_ratio is not None and bwd_ratio is not None
            and fwd_ratio <= bytes_goal and bwd_ratio <= bytes_goal,
            # at 4 ranks, where the fallback runs (right or wrong) and gathers
            "fallback": (None if ranks != 4 or not gathers or fallback_bytes is None or ours is None
                         or not fallback_ran else fallback_bytes >= FALLBACK_GOAL * ours),
            "memory": memory_ratio is not None and memory_ratio <= memory_goal,
        }
        summaries.append({
            "family": family, "op": op, "ranks": ranks, "status": status, "bound": first["bound_text"],
            "max_error": max((r["max_error"] for r in per_rank if r["max_error"] is not None
                              and not math.isnan(r["max_error"])), default=None),
            "forward": {"bytes": column("forward_bytes"), "bound": column("forward_bound"),
                        "calls": column("forward_calls"), "ratio": fwd_ratio},
            "backward": {"bytes": column("backward_bytes"), "bound": column("backward_bound"),
                         "calls": column("backward_calls"), "ratio": bwd_ratio},
            "fallback": {"path": first["fallback_path"], "status": fallback_status, "gathers": gathers,
                         "partial_grads": any(r["fallback_partial_grads"] for r in per_rank),
                         "forward_bytes": column("fallback_forward_bytes"),
                         "backward_bytes": column("fallback_backward_bytes"),
                         "ops": sorted({k for r in per_rank for k in r["fallback_ops"]}),
                         "peak_mib": column("fallback_peak_mib"), "ratio": fallback_ratio},
            "memory": {"peak_mib": column("peak_mib"), "single_peak_mib": column("single_peak_mib"),
                       "ratio": memory_ratio, "goal": memory_goal},
            "goals": goals,
            "goal_values": {"bytes": bytes_goal, "fallback": FALLBACK_GOAL, "memory": memory_goal},
        })
    order = {f: i for i, f in enumerate(FAMILIES)}
    summaries.sort(key=lambda s: (order.get(s["family"], 99), s["ranks"]))
    return summaries


def summarize_models(rows: list[dict]) -> list[dict]:
    """One entry per (model, ranks): the busiest rank's peak memory, the step time, and ratios to 1 rank."""
    grouped: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["model"], row["ranks"]), []).append(row)
    summaries = []
    for (model, ranks), per_rank in grouped.items():
        status = next((r["status"] for r in per_rank if r["status"] != "ok"), "ok")
        peaks = [r["peak_mib"] for r in per_rank]
        times = [r["median_ms"] for r in per_rank if r["median_ms"] is not None]
        summaries.append({
            "model": model, "config": per_rank[0]["config"], "ranks": ranks, "input": per_rank[0]["input_shape"],
            "status": status, "peak_mib": peaks, "max_peak_mib": max((p for p in peaks if p is not None), default=None),
            "median_ms": max(times) if times else None,
        })
    single = {s["model"]: s for s in summaries if s["ranks"] == 1}
    for s in summaries:
        base = single.get(s["model"])
        s["memory_vs_1_rank"] = (None if not base or not base["max_peak_mib"] or s["max_peak_mib"] is None
                                 else s["max_peak_mib"] / base["max_peak_mib"])
        s["time_vs_1_rank"] = (None if not base or not base["median_ms"] or s["median_ms"] is None
                               else s["median_ms"] / base["median_ms"])
    order = {m: i for i, m in enumerate(MODELS)}
    summaries.sort(key=lambda s: (order.get(s["model"], 99), s["ranks"]))
    return summaries


def _r(x: float | None, digits: int = 2) -> str:
    return "∞" if x is None else f"{x:.{digits}f}"


def _yes(flag: bool | None) -> str:
    return "n/a" if flag is None else "met" if flag else "**not met**"


def _mean(values: list) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)


def _memory_cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def family_tables(summaries: list[dict]) -> str:
    """Markdown: the ratios and goals, then the bytes behind them and what the fallback did."""
    lines = [
        "| family | op | N | fwd / bound | bwd / bound | fallback / ours | mem / single | goal 1/N+10% "
        "| bytes goal | fallback goal | memory goal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    notes = []
    for s in summaries:
        fb = s["fallback"]
        if fb["status"] == "ok":
            fb_cell = _r(fb["ratio"], 1)
        elif fb["status"].startswith("wrong"):
            fb_cell = f"{_r(fb['ratio'], 1)} (wrong)"
        else:
            fb_cell = "fails"
        fwd_cell, bwd_cell = _r(s["forward"]["ratio"], 3), _r(s["backward"]["ratio"], 3)
        if s["forward"]["ratio"] is None and any(b is None for b in s["forward"]["bytes"]):
            fwd_cell = bwd_cell = "fails"
        if s["status"] != "ok":
            notes.append(f"* {s['family']}, {s['ranks']} ranks: {s['status']}")
        lines.append(
            f"| {s['family']} | {s['op']} | {s['ranks']} | {fwd_cell} | {bwd_cell} | {fb_cell} "
            f"| {_memory_cell(s['memory']['ratio'])} | {s['memory']['goal']:.2f} | {_yes(s['goals']['bytes'])} "
            f"| {_yes(s['goals']['fallback'])} | {_yes(s['goals']['memory'])} |"
        )
    if notes:
        lines += ["", *notes]
    lines += [
        "",
        "| family | N | fwd bytes / rank | fwd bound / rank | bwd bytes / rank | bwd bound / rank "
        "| fallback fwd+bwd / rank | fallback (family off) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in summaries:
        fb = s["fallback"]
        fb_bytes = None if _mean(fb["forward_bytes"]) is None else _mean(fb["forward_bytes"]) + (
            _mean(fb["backward_bytes"]) or 0)
        what = fb["path"] + ("" if fb["status"] == "ok" else f": {fb['status']}")
        if fb["gathers"]:
            what += " (all-gathers)"
        if fb["partial_grads"]:
            what += " (parameter gradients left Partial: their reduction is left to the caller)"
        lines.append(
            f"| {s['family']} | {s['ranks']} | {fmt_bytes(_mean(s['forward']['bytes']))} "
            f"| {fmt_bytes(_mean(s['forward']['bound']))} | {fmt_bytes(_mean(s['backward']['bytes']))} "
            f"| {fmt_bytes(_mean(s['backward']['bound']))} | {fmt_bytes(fb_bytes)} | {what} |"
        )
    return "\n".join(lines)


def model_table(summaries: list[dict]) -> str:
    lines = [
        "| model | configuration | input | N | peak mem / rank | vs 1 rank | step (fwd+bwd) | vs 1 rank | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in summaries:
        peak = "-" if s["max_peak_mib"] is None else f"{s['max_peak_mib']:.1f} MiB"
        step = "-" if s["median_ms"] is None else f"{s['median_ms']:.0f} ms"
        lines.append(
            f"| {s['model']} | {s['config']} | {'x'.join(map(str, s['input']))} | {s['ranks']} | {peak} "
            f"| {_r(s['memory_vs_1_rank'])} | {step} | {_r(s['time_vs_1_rank'])} | {s['status']} |"
        )
    return "\n".join(lines)


# == plots ============================================================================================
def write_plots(report: dict, directory: Path, fmt: str = "svg") -> list[Path]:
    """Figures (SVG by default): bytes per family vs bound vs fallback, memory ratio per family, models vs ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "physicsnemo-shardext"  # stable ids: diffs show data changes only
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    cases = report["families"]
    rank_counts = sorted({c["ranks"] for c in cases})

    def label(c: dict) -> str:
        return c["family"] if sum(1 for d in cases if d["family"] == c["family"] and d["ranks"] == c["ranks"]) == 1 \
            else f"{c['family']}: {c['op'].split('(')[0]}"

    if cases:
        fig, axes = plt.subplots(len(rank_counts), 1, figsize=(12, 4.2 * len(rank_counts)), squeeze=False)
        for ax, n in zip(axes[:, 0], rank_counts):
            rows = [c for c in cases if c["ranks"] == n]
            xs = range(len(rows))
            def total(fwd: list, bwd: list) -> float | None:  # None: did not run (fails)
                return None if _mean(fwd) is None else _mean(fwd) + (_mean(bwd) or 0)

            ran = [c["fallback"]["status"] == "ok" or c["fallback"]["status"].startswith("wrong") for c in rows]
            series = [
                ("analytic bound", "#bbbbbb", [total(c["forward"]["bound"], c["backward"]["bound"]) for c in rows]),
                ("first-party", "#1f77b4", [total(c["forward"]["bytes"], c["backward"]["bytes"]) for c in rows]),
                ("family off (fallback)", "#d62728",
                 [total(c["fallback"]["forward_bytes"], c["fallback"]["backward_bytes"]) if ok else None
                  for c, ok in zip(rows, ran)]),
            ]
            floor, width = 1.0, 0.27  # log scale: zero bytes drawn at 1 B
            for offset, (name, color, values) in zip((-width, 0.0, width), series):
                ax.bar([x + offset for x in xs], [math.nan if v is None else max(v, floor) for v in values], width,
                       label=name, color=color)
                for x, v in zip(xs, values):
                    if v is None:
                        ax.text(x + offset, floor * 1.3, "fails", rotation=90, ha="center", va="bottom",
                                fontsize=7, color=color)
            ax.set_yscale("log")
            ax.set_ylabel("bytes / rank (fwd+bwd)")
            ax.set_title(f"{n} ranks: bytes each rank hands to collectives (zero drawn at 1 B)")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([label(c) for c in rows], rotation=40, ha="right", fontsize=8)
            ax.legend(fontsize=8, ncols=3)
        fig.tight_layout()
        written.append(directory / f"family-bytes.{fmt}")
        fig.savefig(written[-1])
        plt.close(fig)

        fig, axes = plt.subplots(len(rank_counts), 1, figsize=(12, 3.8 * len(rank_counts)), squeeze=False)
        for ax, n in zip(axes[:, 0], rank_counts):
            rows = [c for c in cases if c["ranks"] == n]
            xs = list(range(len(rows)))
            values = [c["memory"]["ratio"] or 0 for c in rows]
            colors = ["#2ca02c" if c["goals"]["memory"] else "#ff7f0e" for c in rows]
            ax.bar(xs, values, 0.6, color=colors)
            ax.axhline(1 / n, color="black", linestyle="--", linewidth=1, label=f"1/N = {1 / n:.2f}")
            ax.axhline(1 / n + MEMORY_SLACK, color="black", linestyle=":", linewidth=1,
                       label=f"goal 1/N + 10% = {1 / n + MEMORY_SLACK:.2f}")
            ax.set_ylabel("peak mem / single-process")
            ax.set_title(f"{n} ranks: per-rank peak memory of forward+backward (busiest rank)")
            ax.set_xticks(xs)
            ax.set_xticklabels([label(c) for c in rows], rotation=40, ha="right", fontsize=8)
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(directory / f"family-memory.{fmt}")
        fig.savefig(written[-1])
        plt.close(fig)

    models = [m for m in report["models"] if m["status"] == "ok"]
    if models:
        fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4))
        for name in MODELS:
            rows = sorted((m for m in models if m["model"] == name), key=lambda m: m["ranks"])
            if not rows:
                continue
            ns = [m["ranks"] for m in rows]
            mem_ax.plot(ns, [m["memory_vs_1_rank"] for m in rows], marker="o", label=name)
            time_ax.plot(ns, [m["median_ms"] / 1e3 for m in rows], marker="o", label=name)
        all_ns = sorted({m["ranks"] for m in models})
        mem_ax.plot(all_ns, [1 / n for n in all_ns], color="black", linestyle="--", linewidth=1, label="1/N")
        for ax in (mem_ax, time_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_ns)
            ax.set_xticklabels([str(n) for n in all_ns])
            ax.set_xlabel("ranks")
            ax.legend(fontsize=8)
        mem_ax.set_yscale("log", base=2)
        mem_ax.set_ylabel("peak memory / rank, over 1 rank's")
        mem_ax.set_title("training step: per-rank peak memory (busiest rank)")
        time_ax.set_yscale("log")
        time_ax.set_ylabel("step time (s)")
        time_ax.set_title(f"training step time ({report['config']['machine']})", fontsize=9)
        fig.tight_layout()
        written.append(directory / f"models.{fmt}")
        fig.savefig(written[-1])
        plt.close(fig)
    return written


# == the command ======================================================================================
def _names(value: str, known: Sequence[str], what: str) -> list[str]:
    if value in ("all", ""):
        return list(known)
    if value == "none":
        return []
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="all", help=f"comma-separated, 'all' or 'none' ({', '.join(FAMILIES)})")
    parser.add_argument("--models", default="all", help=f"comma-separated, 'all' or 'none' ({', '.join(MODELS)})")
    parser.add_argument("--ranks", default="2,4", help="rank counts to spawn (ignored under torchrun)")
    parser.add_argument("--size", default="1x16x256x256",
                        help="B x C x H x W (or x D x H x W for 3-D) of the field, sharded over the first spatial dim")
    parser.add_argument("--tokens", type=int, default=4096, help="attention: sequence length L (sharded)")
    parser.add_argument("--heads", type=int, default=8, help="attention: heads")
    parser.add_argument("--head-dim", type=int, default=64, help="attention: head dim E")
    parser.add_argument("--model-res", type=int, default=256,
                        help="models: image side (UNet: a cube of side res/8)")
    parser.add_argument("--repeats", type=int, default=3, help="models: timed steps (median)")
    parser.add_argument("--json", default=None, help="write the whole report (every rank's numbers) to this file")
    parser.add_argument("--plot", default=None, help="write the figures to this directory (needs matplotlib)")
    parser.add_argument("--plot-format", default="svg", choices=("svg", "png", "pdf"), help="figure format")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="measure nothing: print the tables (and --plot) of a report written by --json")
    args = parser.parse_args(argv)
    args.family_list = _names(args.families, FAMILIES, "families")
    args.model_list = _names(args.models, MODELS, "models")
    args.rank_list = sorted({int(n) for n in args.ranks.split(",")})
    if any(n < 2 for n in args.rank_list):
        parser.error("--ranks: at least 2 (models are measured at 1 rank anyway)")
    args.size = [int(n) for n in args.size.lower().split("x")]
    if len(args.size) < 3:
        parser.error("--size: B x C x at least one spatial dim")
    return args


def _machine(meta: dict) -> str:
    cores = os.cpu_count()
    if meta["device"] == "cuda":
        return f"{torch.cuda.get_device_name(0)}, {meta['backend']}"
    return f"{cores} CPU cores, {meta['backend']}"


def build_report(args: argparse.Namespace, worlds: list[dict]) -> dict:
    import physicsnemo

    meta = next((w["meta"] for w in worlds if w["world"] > 1), worlds[0]["meta"] if worlds else
                {"backend": "none", "device": "cpu"})
    cases = [row for w in worlds for row in w["families"]]
    models = [row for w in worlds for row in w["models"]]
    return {
        "schema": 1,
        "config": {
            "size": args.size, "ranks": sorted({w["world"] for w in worlds if w["world"] > 1}),
            "families": args.family_list, "models": args.model_list, "model_res": args.model_res,
            "attention": {"tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim},
            "dtype": "float32", "backend": meta["backend"], "device": meta["device"], "machine": _machine(meta),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "physicsnemo": physicsnemo.__version__, "python": platform.python_version(),
        },
        "goals": {"bytes": BYTES_GOAL, "bytes_exchange": EXCHANGE_BYTES_GOAL, "fallback_at_4_ranks": FALLBACK_GOAL,
                  "memory_slack": MEMORY_SLACK},
        "families": summarize_cases(cases),
        "models": summarize_models(models),
    }


def _finite(value: Any) -> Any:
    """The report with every non-finite float as None (JSON has no infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def measure(args: argparse.Namespace) -> dict:
    """Run every world (spawned, or this torchrun one) and build the report (rank 0 under torchrun)."""
    with tempfile.TemporaryDirectory(prefix="shardext-bench-") as tmp:
        if launched_by_torchrun():
            rank = int(os.environ.get("RANK", "0"))
            args.world_out = str(Path(tmp) / "world.json") if rank == 0 else os.devnull
            args.single_models = True
            args.aborted, args.unprobed = {}, True
            args.progress_done = 0
            args.progress_total = len(args.family_list) + 2 * len(args.model_list)
            run_world(args)
            if rank != 0:
                exit_without_teardown()
            worlds = [json.loads(Path(args.world_out).read_text())]
        else:
            plan = ([1] if args.model_list else []) + args.rank_list
            tasks = {n: len(args.model_list) + (len(args.family_list) if n > 1 else 0) for n in plan}
            args.single_models, args.progress_total, done, worlds = False, sum(tasks.values()), 0, []
            for n in plan:
                args.aborted = run_probes(args, n, tmp) if n > 1 else {}
                args.world_out = str(Path(tmp) / f"world-{n}.json")
                args.progress_done = done
                launch(run_world, args, n)
                done += tasks[n]
                worlds.append(json.loads(Path(args.world_out).read_text()))
        if not args.no_progress:
            sys.stderr.write("\n")
    return build_report(args, worlds)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = json.loads(Path(args.from_json).read_text()) if args.from_json else measure(args)
    if report["families"]:
        config = report["config"]
        print(f"Field {'x'.join(map(str, config['size']))} float32 sharded over the first spatial dim; ranks "
              f"{', '.join(map(str, config['ranks']))}; {config['machine']}; torch {config['torch']}, PhysicsNeMo "
              f"{config['physicsnemo']}; {config['date']}\n")
        print(family_tables(report["families"]) + "\n")
    if report["models"]:
        print(model_table(report["models"]) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
    if args.plot:
        for path in write_plots(report, Path(args.plot), args.plot_format):
            print(f"wrote {path}")
    if launched_by_torchrun():
        exit_without_teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
