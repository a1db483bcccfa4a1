"""``ShardTensor.redistribute``: this package's reshard against PhysicsNeMo's, bytes and time, one run.

For each move (an uneven and an even ``Shard(H) -> Shard(W)``, ``Shard(H) ->
Replicate``, ``Replicate -> Shard(W)``) of a ``B x C x H x W`` field, every rank
counts the collectives and bytes of one call with the ``reshard`` plugin and
without it (PhysicsNeMo 2.2's own method), then times both, interleaved call by
call (median of ``--repeats``, every rank synchronized around each call), and
checks that both give the same local block. Rank 0 prints the busiest rank's
numbers and the analytic bound: for ``Shard -> Shard`` the rows that change owner,
``local * (1 - kept share)``; for ``Shard -> Replicate`` the padded all-gather
that one collective of uneven blocks needs, ``N * max(block)``.

    python benchmarks/reshard.py --ranks 2 --size 1x16x1024x1024 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import fmt_bytes, initialize, launch, sync


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", default="1x16x1024x1024", help="B x C x H x W, sharded over H (or W)")
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args(argv)


def _moves(shape: list[int], n: int) -> dict[str, tuple[list[Any], list[int] | None, list[Any]]]:
    from torch.distributed.tensor import Replicate, Shard

    h = shape[2]
    uneven = [h * 6 // (5 * n)] * (n - 1)  # the first ranks hold 1.2 / N of H each, the last the rest
    uneven.append(h - sum(uneven))
    return {
        "S(H)->S(W) uneven": ([Shard(2)], uneven, [Shard(3)]),
        "S(H)->S(W) even": ([Shard(2)], None, [Shard(3)]),
        "S(H)->R uneven": ([Shard(2)], uneven, [Replicate()]),
        "R->S(W)": ([Replicate()], None, [Shard(3)]),
    }


def _bound(
    full: torch.Tensor, source: list[Any], sizes: list[int] | None, target: list[Any], coord: int, n: int
) -> int:
    """Bytes this rank must hand to the collective at least (analytic)."""
    from torch.distributed.tensor import Replicate, Shard

    from physicsnemo_shardext.patches.reshard import chunk_sizes

    if not isinstance(source[0], Shard):
        return 0
    rows = sizes or list(chunk_sizes(full.shape[2], n))
    per_row = full.numel() // full.shape[2] * full.element_size()
    if isinstance(target[0], Replicate):
        return max(rows) * per_row  # one all-gather: every block padded to the largest
    kept = chunk_sizes(full.shape[3], len(rows))[coord] / full.shape[3]
    return int(rows[coord] * per_row * (1 - kept))


def _world(args: argparse.Namespace) -> None:
    """Every rank: count and time both methods per move; rank 0 prints the table."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import physicsnemo_shardext
    from physicsnemo_shardext.testing import CommCounter, shard_tensor

    initialize()
    n, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("domain",))
    shape = [int(v) for v in args.size.split("x")]
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device)
    methods = {"ours": [], "PhysicsNeMo": ["reshard"]}
    mine = {}
    for name, (source, sizes, target) in _moves(shape, n).items():
        x = shard_tensor(full, mesh, source, sizes)
        stats, results = {}, {}
        for method, off in methods.items():
            with physicsnemo_shardext.disabled(plugins=off), CommCounter() as counter:
                results[method] = x.redistribute(mesh, target).to_local()
            stats[method] = (counter.stats.total_calls, counter.stats.total_bytes)
        assert torch.equal(results["ours"], results["PhysicsNeMo"]), name
        times: dict[str, list[float]] = {m: [] for m in methods}
        for i in range(args.repeats + 2):
            for method, off in methods.items():
                with physicsnemo_shardext.disabled(plugins=off):
                    dist.barrier()
                    sync(device)
                    begin = time.perf_counter()
                    x.redistribute(mesh, target)
                    sync(device)
                    if i >= 2:  # warm-up
                        times[method].append(time.perf_counter() - begin)
        mine[name] = {
            "bound": _bound(full, source, sizes, target, rank, n),
            **{f"{m} calls": stats[m][0] for m in methods},
            **{f"{m} bytes": stats[m][1] for m in methods},
            **{f"{m} ms": statistics.median(times[m]) * 1e3 for m in methods},
        }
    rows: list[Any] = [None] * n
    dist.all_gather_object(rows, mine)
    if rank == 0:
        print(f"ShardTensor.redistribute of {args.size} on {n} ranks ({device.type}), median of {args.repeats}")
        print(
            "| move | rank | bound | ours: calls, bytes | PhysicsNeMo: calls, bytes | ours (ms) | PhysicsNeMo (ms) | ours / PhysicsNeMo |"
        )
        print("|---|---:|---:|---|---|---:|---:|---:|")
        for name in mine:
            for r, per_rank in enumerate(rows):
                m = per_rank[name]
                print(
                    f"| {name} | {r} | {fmt_bytes(m['bound'])} | {m['ours calls']}, {fmt_bytes(m['ours bytes'])} "
                    f"| {m['PhysicsNeMo calls']}, {fmt_bytes(m['PhysicsNeMo bytes'])} | {m['ours ms']:.2f} "
                    f"| {m['PhysicsNeMo ms']:.2f} | {m['ours ms'] / m['PhysicsNeMo ms']:.3f} |"
                )


def main(argv: list[str] | None = None) -> int:
    launch(_world, _parse(argv), _parse(argv).ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
