"""Does the halo exchange hide behind the block's convolution? Forward time with and without overlap.

The halo-strip convolution (`physicsnemo_shardext.primitives.exchanging_strip_conv`)
starts its halo exchange, convolves the block, then waits for the halo rows. This
script times one sharded forward of a convolution both ways in the same processes,
interleaved: as shipped (overlapped), and with the exchange waited for at once
(sequential), and prints the medians. On a backend whose collectives run in the
background the overlapped forward is shorter by up to the exchange's time; gloo on
a CPU shares the cores with the convolution, so there it shows little.

    python benchmarks/halo_overlap.py --ranks 2 --size 1x16x1024x1024 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import initialize, launch, sync


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", default="1x16x1024x1024", help="B x C x H x W, sharded over H")
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args(argv)


def _world(args: argparse.Namespace) -> None:
    """Every rank: time both variants; rank 0 prints the table."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import physicsnemo_shardext.primitives.conv_strips as conv_strips
    from physicsnemo_shardext.testing import shard_tensor

    initialize()
    torch.set_num_threads(1)
    n = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("domain",))
    shape = [int(v) for v in args.size.split("x")]
    torch.manual_seed(0)
    full = torch.randn(*shape, device=device)
    x = shard_tensor(full, mesh, [Shard(2)], None)
    weight = torch.randn(shape[1], shape[1], 3, 3, device=device)
    overlapped = conv_strips.start_fetch_rows

    def sequential(*a: Any) -> Any:
        rows = overlapped(*a)()
        return lambda: rows

    times: dict[str, list[float]] = {"overlapped": [], "sequential": []}
    with torch.no_grad():
        for i in range(args.repeats + 2):
            for name, start in (("overlapped", overlapped), ("sequential", sequential)):
                conv_strips.start_fetch_rows = start
                dist.barrier()
                sync(device)
                begin = time.perf_counter()
                F.conv2d(x, weight, padding=1)
                sync(device)
                if i >= 2:  # warm-up
                    times[name].append(time.perf_counter() - begin)
    conv_strips.start_fetch_rows = overlapped
    mine = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    rows: list[Any] = [None] * n
    dist.all_gather_object(rows, mine)
    if dist.get_rank() == 0:
        title = f"F.conv2d(x, w, padding=1), x {args.size} sharded over H on {n} ranks ({device.type}), forward"
        print(f"{title}, median of {args.repeats}")
        print("| rank | overlapped (ms) | sequential (ms) | overlapped / sequential |")
        print("|---:|---:|---:|---:|")
        for rank, r in enumerate(rows):
            ratio = r["overlapped"] / r["sequential"]
            print(f"| {rank} | {r['overlapped']:.1f} | {r['sequential']:.1f} | {ratio:.3f} |")


def main(argv: list[str] | None = None) -> int:
    launch(_world, _parse(argv), _parse(argv).ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
