"""Benchmark ring scaled-dot-product attention on a sequence-sharded q/k/v: bytes and memory against their bounds.

``F.scaled_dot_product_attention(q, k, v)`` with ``q``, ``k``, ``v`` of shape
``B x H x L x E`` sharded evenly on the sequence dim ``L``, forward and backward.
Variants, run one after the other in the same processes:

* ``ring``: the first-party ``attention`` plugin (ring attention: K/V travel once
  around the ring forward; backward K/V travel again and the K/V gradient partials
  travel back to their owners);
* ``gather``: the naive reference, k and v all-gathered (``redistribute`` to
  ``Replicate``) and the local query block attended against the whole K/V (the
  same plugin's replicated-K/V path; backward all-reduces the K/V gradients);
* ``physicsnemo``: the same call as ``ring`` inside
  ``physicsnemo_shardext.disabled(plugins=["attention"])``, i.e. PhysicsNeMo's own
  handler (its ring attention needs CUDA: on CPU ranks it is reported as
  ``crashes (<exception>)``);
* ``single``: the reference, single-process ``F.scaled_dot_product_attention`` on
  the full sequence (computed on every rank: its memory and time are the baseline).

Per rank and variant: the collectives and payload bytes of one forward and one
backward (``CommCounter``: bytes this rank *hands to* collectives) and their ratio
to the analytic bounds, with ``G`` the bytes of the global K and V together and
``N`` the ranks:

* forward bound ``(N-1)/N * G``: each rank's K and V go once around the ring
  (goal: within 1.1x);
* backward bound ``2(N-1)/N * G``: K/V must reach every rank again, and the dK/dV
  partials must be reduced to their owners (goal: within 1.25x).

The peak extra memory of one forward+backward (on CPU the resident-set
high-water mark above the resident set before the step, as in
``spectral_layer.py``; gradients are cleared first, so the step allocates the
output and the q/k/v gradients like single-process does) and its ratio to the
``single`` row of the same rank (goal at 4 ranks: ``1/N + 10%``); the median wall
time of ``--repeats`` forward+backward steps; the largest error of the output and
of the q/k/v gradients against single-process.

Reading the bytes: an all-gather counts only this rank's shard although every
rank receives the other ``N-1`` shards, so the ``gather`` row's forward looks
cheap in bytes; its cost shows in the memory column (every rank holds the full
K and V) and in its backward (all-reduces of the full K/V gradients).

Usage::

    python benchmarks/attention.py --nproc 2                  # spawns 2 gloo CPU ranks itself
    torchrun --nproc-per-node 4 benchmarks/attention.py       # gloo on CPU, NCCL on GPUs
    python benchmarks/attention.py --nproc 4 --tokens 4096 --heads 8 --dim 64 --causal --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    counted_pass,
    first_line,
    fmt_bytes,
    heap_allocations,
    initialize,
    launch,
    median_ms,
    peak_memory,
    pin_mmap_threshold,
    sync,
)

VARIANTS = ("ring", "gather", "physicsnemo", "single")
FORWARD_GOAL, BACKWARD_GOAL, MEMORY_SLACK = 1.1, 1.25, 0.10


@dataclass
class RankResult:
    """What one rank measured for one variant."""

    variant: str
    rank: int
    ranks: int
    local_tokens: int
    forward_calls: int | None = None
    forward_bytes: int | None = None
    forward_bound: int = 0
    backward_calls: int | None = None
    backward_bytes: int | None = None
    backward_bound: int = 0
    peak_mib: float | None = None
    single_peak_mib: float | None = None
    median_ms: float = float("nan")
    max_error: float = float("nan")
    status: str = "ok"

    @property
    def forward_ratio(self) -> float | None:
        return None if self.forward_bytes is None or not self.forward_bound else self.forward_bytes / self.forward_bound

    @property
    def backward_ratio(self) -> float | None:
        if self.backward_bytes is None or not self.backward_bound:
            return None
        return self.backward_bytes / self.backward_bound

    @property
    def memory_ratio(self) -> float | None:
        if self.peak_mib is None or not self.single_peak_mib:
            return None
        return self.peak_mib / self.single_peak_mib


def memory_goal(ranks: int) -> float:
    """Per-rank peak memory goal as a fraction of single-process: ``1/N + 10%`` (of single-process)."""
    return 1.0 / ranks + MEMORY_SLACK


# -- one variant --------------------------------------------------------------------------------
def _full_inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """q, k, v and the output cotangent, identical on every rank."""
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.tokens, args.dim)
    return [torch.randn(shape, generator=g).to(device) for _ in range(4)]


def _attention(args: argparse.Namespace) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)


Timer = Callable[[], None]


def measure_single(args: argparse.Namespace, device: torch.device) -> tuple[RankResult, list[torch.Tensor], Timer]:
    """Single-process attention on the full sequence: the reference output/gradients, memory, and its step."""
    q, k, v, cotangent = _full_inputs(args, device)
    for t in (q, k, v):
        t.requires_grad_(True)
    attention = _attention(args)
    result = RankResult("single", dist.get_rank(), 1, args.tokens)

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        attention(q, k, v).backward(cotangent)

    reference = attention(q, k, v)  # also the warm-up
    reference.backward(cotangent)
    reference, grads = reference.detach(), [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None  # freed before the measured step (as in every variant), not inside it
    sync(device)
    with peak_memory(device) as peak:
        step()
    result.peak_mib = result.single_peak_mib = peak[0]
    result.max_error = 0.0
    return result, [reference, *grads], step


def measure_variant(
    variant: str, args: argparse.Namespace, mesh, device: torch.device, reference: list[torch.Tensor]
) -> tuple[RankResult, Timer | None]:
    """Forward and backward of the sharded attention for one variant on this rank, and its step (None: crashes)."""
    from torch.distributed.tensor import Replicate, Shard

    import physicsnemo_shardext
    from physicsnemo_shardext.testing import shard_tensor

    full_q, full_k, full_v, full_cotangent = _full_inputs(args, device)
    q, k, v = (shard_tensor(t, mesh, [Shard(2)], requires_grad=True) for t in (full_q, full_k, full_v))
    cotangent = shard_tensor(full_cotangent, mesh, [Shard(2)])
    del full_q, full_k, full_v, full_cotangent
    ranks = dist.get_world_size()
    kv_bytes = 2 * args.batch * args.heads * args.tokens * args.dim * q.element_size()
    result = RankResult(
        variant,
        dist.get_rank(),
        ranks,
        q.to_local().shape[2],
        forward_bound=(ranks - 1) * kv_bytes // ranks,
        backward_bound=2 * (ranks - 1) * kv_bytes // ranks,
    )
    attention = _attention(args)
    if variant == "gather":

        def call() -> torch.Tensor:
            return attention(q, k.redistribute(placements=[Replicate()]), v.redistribute(placements=[Replicate()]))
    else:

        def call() -> torch.Tensor:
            return attention(q, k, v)

    def step(backward: bool) -> None:
        for t in (q, k, v):
            t.grad = None
        out = call()
        if backward:
            out.backward(cotangent)

    context: Callable[[], contextlib.AbstractContextManager] = (
        (lambda: physicsnemo_shardext.disabled(plugins=["attention"]))
        if variant == "physicsnemo"
        else contextlib.nullcontext
    )
    with context():
        out, forward = counted_pass(call)  # the counted pass is also the warm-up
        if not forward.ok:
            result.status = _crash("", forward.error)
            return result, None
        result.forward_calls, result.forward_bytes = forward.stats.total_calls, forward.stats.total_bytes
        _, backward = counted_pass(out.backward, cotangent)
        backward_works = backward.ok  # every rank agrees: a rank-local crash would desynchronize the timing
        if backward.stats is not None:  # this rank's backward ran (another rank's may not have)
            result.backward_calls, result.backward_bytes = backward.stats.total_calls, backward.stats.total_bytes
        if not backward_works:
            result.status = _crash("backward ", backward.error)
        errors = [(out.full_tensor() - reference[0]).abs().max().item()]
        if backward_works:
            errors += [(t.grad.full_tensor() - ref).abs().max().item() for t, ref in zip((q, k, v), reference[1:])]
        result.max_error = max(errors)
        del out
        for t in (q, k, v):
            t.grad = None  # freed before the measured step, not inside it (that would hide their size)

        sync(device)
        with peak_memory(device) as peak:
            step(backward_works)
        result.peak_mib = peak[0]

    def timed_step() -> None:
        with context():
            step(backward_works)

    return result, timed_step


def _crash(stage: str, error: Exception | None) -> str:
    """``crashes (TypeError: ...)``, ``backward crashes (...)``, or ``... crashes on another rank``."""
    if error is None:
        return f"{stage}crashes on another rank"
    return f"{stage}crashes ({type(error).__name__}: {first_line(error)})"


# -- report ---------------------------------------------------------------------------------------
def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown_table(results: list[RankResult]) -> str:
    """One row per (variant, rank); ratios are bytes / analytic bound and memory / single-process."""
    lines = [
        "| variant | rank | local L | fwd calls | fwd bytes | fwd / bound | bwd calls | bwd bytes | bwd / bound "
        "| peak extra mem | mem / single | median fwd+bwd | max abs err | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(results, key=lambda r: (VARIANTS.index(r.variant), r.rank)):
        timed = "" if r.backward_calls is not None or r.variant == "single" else " (fwd only)"
        time_cell = "-" if r.forward_calls is None and r.variant != "single" else f"{r.median_ms:.1f} ms{timed}"
        lines.append(
            f"| {r.variant} | {r.rank} | {r.local_tokens} "
            f"| {'-' if r.forward_calls is None else r.forward_calls} | {fmt_bytes(r.forward_bytes)} "
            f"| {_fmt_ratio(r.forward_ratio)} "
            f"| {'-' if r.backward_calls is None else r.backward_calls} | {fmt_bytes(r.backward_bytes)} "
            f"| {_fmt_ratio(r.backward_ratio)} "
            f"| {'n/a' if r.peak_mib is None else f'{r.peak_mib:.1f} MiB'} | {_fmt_ratio(r.memory_ratio)} "
            f"| {time_cell} | {'-' if r.max_error != r.max_error else f'{r.max_error:.1e}'} | {r.status} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    """Body of every rank: every variant, then rank 0 prints the table (and writes the JSON)."""
    pin_mmap_threshold()
    warnings.filterwarnings("ignore", category=FutureWarning)  # PhysicsNeMo's redistribute uses deprecated funcol
    import physicsnemo_shardext

    manager = initialize()  # the pool's or torchrun's process group: gloo on CPU, NCCL on GPU
    try:
        mesh = manager.initialize_mesh((-1,), ("domain",))
        single, reference, single_step = measure_single(args, manager.device)
        measured = [measure_variant(v, args, mesh, manager.device, reference) for v in VARIANTS if v != "single"]
        measured.append((single, single_step))
        with heap_allocations():  # timed after every memory measurement
            for result, timer in measured:
                if timer is not None:
                    result.median_ms = median_ms(timer, args.repeats, manager.device)
        results = [result for result, _ in measured]
        for r in results:
            r.single_peak_mib = single.peak_mib
        gathered: list[list[RankResult] | None] = [None] * manager.world_size
        dist.all_gather_object(gathered, results)
        if manager.rank == 0:
            rows = [r for per_rank in gathered for r in per_rank]
            n = manager.world_size
            print(
                f"scaled_dot_product_attention(is_causal={args.causal}) on q, k, v of "
                f"{args.batch}x{args.heads}x{args.tokens}x{args.dim} (B x H x L x E, float32) sharded over L, "
                f"{n} ranks ({manager.device.type}, {dist.get_backend()}), {args.repeats} timed repeats; "
                f"goals: fwd / bound <= {FORWARD_GOAL}, bwd / bound <= {BACKWARD_GOAL}, "
                f"mem / single <= 1/N + {MEMORY_SLACK:.0%} = {memory_goal(n):.3f}\n"
            )
            print(markdown_table(rows), flush=True)
            if args.json:
                payload = {
                    "config": {k: v for k, v in vars(args).items() if k != "json"} | {"ranks": n},
                    "goals": {"forward": FORWARD_GOAL, "backward": BACKWARD_GOAL, "memory": memory_goal(n)},
                    "results": [
                        dataclasses.asdict(r)
                        | {
                            "forward_ratio": r.forward_ratio,
                            "backward_ratio": r.backward_ratio,
                            "memory_ratio": r.memory_ratio,
                        }
                        for r in rows
                    ],
                }
                Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    finally:
        physicsnemo_shardext.shutdown()


# -- launching ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096, help="sequence length L (the sharded dim)")
    parser.add_argument("--dim", type=int, default=64, help="head dim E")
    parser.add_argument("--causal", action="store_true", help="is_causal=True")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write every row (and the goals) to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launch(run, args, args.nproc)  # inline under torchrun, else on --nproc ranks of a worker pool (gloo on CPU)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
