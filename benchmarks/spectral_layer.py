"""Benchmark an FNO spectral convolution on a field sharded over H: first-party patches vs the DTensor fallback.

The layer is PhysicsNeMo's own ``SpectralConv2d`` (``rfft2`` -> keep the low
``modes`` x ``modes`` corner and its negative-frequency mirror -> complex
``einsum`` with replicated weights -> ``F.pad`` back to the full spectrum ->
``irfft2``), applied to a ``B x C x H x W`` field sharded evenly over H. Both
variants run in the same processes, one after the other:

* ``patched``: the first-party ``fft`` and ``indexing_einsum`` plugins (distributed
  FFTs by all-to-all transposes, mode slicing on the sharded spectrum);
* ``fallback``: the same code under ``physicsnemo_shardext.disabled(plugins=["fft", "indexing_einsum"])``,
  i.e. ShardTensor's DTensor fallback for those ops.

Per rank and variant it reports the collectives and payload bytes of one forward
and one backward (``CommCounter``: bytes this rank hands to collectives,
including those DTensor issues inside its own dispatch), the peak extra resident
memory of one forward+backward, and the median wall time of ``--repeats``
forward+backward steps. A variant whose backward raises is reported as
``crashes (<exception>)`` and timed on the forward only.

Memory on CPU: torch has no allocator statistics for CPU tensors, and
``tracemalloc`` does not see them. We reset the kernel's resident-set
high-water mark (``/proc/self/clear_refs``, ``VmHWM``) right before the step and
report ``VmHWM - VmRSS(before)``; glibc's mmap threshold is pinned to 128 KiB so
every large tensor is its own mapping, returned to the OS when freed (otherwise
freed buffers would be reused from the heap and hide later peaks). On CUDA the
allocator's ``max_memory_allocated`` is used instead.

Usage::

    python benchmarks/spectral_layer.py --nproc 2                # spawns 2 gloo CPU ranks itself
    torchrun --nproc-per-node 4 benchmarks/spectral_layer.py     # gloo on CPU, NCCL on GPUs
    python benchmarks/spectral_layer.py --nproc 2 --height 16 --width 16 --channels 2 --modes 2 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    counted_pass,
    fmt_bytes,
    initialize,
    launch,
    median_ms,
    peak_memory,
    pin_mmap_threshold,
    sync,
)

VARIANTS = ("patched", "fallback")
DEFAULT_FALLBACK_PLUGINS = "fft,spectral"


@dataclass
class RankResult:
    """What one rank measured for one variant."""

    variant: str
    rank: int
    local_rows: int
    forward_calls: int = 0
    forward_bytes: int = 0
    backward_calls: int | None = None
    backward_bytes: int | None = None
    peak_mib: float | None = None
    median_ms: float = float("nan")
    max_error: float = float("nan")
    status: str = "ok"


# -- one variant --------------------------------------------------------------------------------
def _step(layer: torch.nn.Module, x: torch.Tensor, cotangent: torch.Tensor, backward: bool) -> torch.Tensor:
    x.grad = None
    out = layer(x)
    if backward:
        out.backward(cotangent)
    return out


def measure_variant(variant: str, args: argparse.Namespace, mesh, device: torch.device) -> RankResult:
    """Run forward(+backward) of the spectral layer for one variant on this rank."""
    from physicsnemo.nn.module.spectral_layers import SpectralConv2d
    from torch.distributed.tensor import Shard, distribute_module

    import physicsnemo_shardext
    from physicsnemo_shardext.testing import shard_tensor

    torch.manual_seed(0)  # the same layer and field on every rank (the reference is computed locally)
    layer = SpectralConv2d(args.channels, args.channels, args.modes, args.modes).to(device)
    full = torch.randn(args.batch, args.channels, args.height, args.width, device=device)
    full_cotangent = torch.randn_like(full)
    reference = layer(full).detach()
    sharded_layer = distribute_module(copy.deepcopy(layer), mesh)
    x = shard_tensor(full, mesh, [Shard(2)], requires_grad=True)
    cotangent = shard_tensor(full_cotangent, mesh, [Shard(2)])
    result = RankResult(variant, dist.get_rank(), x.to_local().shape[2])

    context: Callable[[], contextlib.AbstractContextManager] = (
        (lambda: physicsnemo_shardext.disabled(plugins=args.fallback_plugins.split(",")))
        if variant == "fallback"
        else contextlib.nullcontext
    )
    with context():
        out, forward = counted_pass(sharded_layer, x)  # the counted pass is also the warm-up
        if not forward.ok:
            result.status = _crash("forward", forward.error)
            return result
        result.forward_calls, result.forward_bytes = forward.stats.total_calls, forward.stats.total_bytes
        result.max_error = (out.full_tensor() - reference).abs().max().item()
        # The fallback backward of PhysicsNeMo 2.2.2 may raise; every rank must agree before timing collectives.
        _, backward = counted_pass(out.backward, cotangent)
        backward_works = backward.ok
        if backward.stats is not None:  # this rank's backward ran (another rank's may not have)
            result.backward_calls, result.backward_bytes = backward.stats.total_calls, backward.stats.total_bytes
        if not backward_works:
            result.status = _crash("backward", backward.error)

        sync(device)
        with peak_memory(device) as peak:
            _step(sharded_layer, x, cotangent, backward_works)
        result.peak_mib = peak[0]
        result.median_ms = median_ms(lambda: _step(sharded_layer, x, cotangent, backward_works), args.repeats, device)
    return result


def _crash(stage: str, error: Exception | None) -> str:
    """``forward crashes (TypeError: ...)``, or ``... crashes on another rank``."""
    if error is None:
        return f"{stage} crashes on another rank"
    return f"{stage} crashes ({type(error).__name__}: {str(error)[:80]})"


# -- report ---------------------------------------------------------------------------------------
def markdown_table(results: list[RankResult]) -> str:
    """One row per (variant, rank)."""
    lines = [
        "| variant | rank | local H | fwd collectives | fwd bytes | bwd collectives | bwd bytes "
        "| peak extra mem | median fwd+bwd | max abs err | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(results, key=lambda r: (VARIANTS.index(r.variant), r.rank)):
        timed = "fwd+bwd" if r.backward_calls is not None else "fwd only"
        lines.append(
            f"| {r.variant} | {r.rank} | {r.local_rows} | {r.forward_calls} | {fmt_bytes(r.forward_bytes)} "
            f"| {'-' if r.backward_calls is None else r.backward_calls} | {fmt_bytes(r.backward_bytes)} "
            f"| {'n/a' if r.peak_mib is None else f'{r.peak_mib:.1f} MiB'} | {r.median_ms:.1f} ms ({timed}) "
            f"| {r.max_error:.1e} | {r.status} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    """Body of every rank: both variants, then rank 0 prints the table."""
    pin_mmap_threshold()
    import physicsnemo_shardext

    manager = initialize()  # the pool's or torchrun's process group: gloo on CPU, NCCL on GPU
    try:
        mesh = manager.initialize_mesh((-1,), ("domain",))
        results = [measure_variant(v, args, mesh, manager.device) for v in VARIANTS]
        gathered: list[list[RankResult] | None] = [None] * manager.world_size
        dist.all_gather_object(gathered, results)
        if manager.rank == 0:
            print(
                f"SpectralConv2d({args.channels}, {args.channels}, modes={args.modes}) on "
                f"{args.batch}x{args.channels}x{args.height}x{args.width} sharded over H, "
                f"{manager.world_size} ranks ({manager.device.type}, {dist.get_backend()}), "
                f"{args.repeats} timed repeats; fallback = plugins {args.fallback_plugins} disabled\n"
            )
            print(markdown_table([r for per_rank in gathered for r in per_rank]), flush=True)
    finally:
        physicsnemo_shardext.shutdown()


# -- launching ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--height", type=int, default=256, help="sharded dimension")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--modes", type=int, default=16, help="modes kept per dimension")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--fallback-plugins",
        default=DEFAULT_FALLBACK_PLUGINS,
        help="comma-separated plugins switched off for the fallback variant",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launch(run, args, args.nproc)  # inline under torchrun, else on --nproc ranks of a worker pool (gloo on CPU)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
