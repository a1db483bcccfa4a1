"""Does the halo exchange hide behind the block's convolution? Forward and backward time with and without overlap.

The halo-strip convolution (`physicsnemo_shardext.primitives.exchanging_strip_conv`)
starts its halo exchange, convolves the block, then waits for the halo rows; its
backward forms the halo rows' gradients first (from the small strips), starts
sending them back, computes the block's gradient, then adds what came back. This
script times one sharded forward and its backward both ways in the same processes,
interleaved: as shipped (overlapped), and with each exchange done before
(forward) or after (backward) the block's compute (sequential), and prints the
medians. On a backend whose collectives run in the background the overlapped pass
is shorter by up to the exchange's time; gloo on a CPU shares the cores with the
convolution, so there it shows less.

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
    weight.requires_grad_(True)
    x = x.detach().requires_grad_(True)
    cotangent: list[Any] = []
    fetch, give_back = conv_strips.start_fetch_rows, conv_strips.start_return_rows

    def fetch_at_once(*a: Any) -> Any:
        rows = fetch(*a)()
        return lambda: rows

    def give_back_after(grad_rows: torch.Tensor, layout: Any, plan: Any) -> Any:
        # The whole exchange once the block's gradient exists: the backward without overlap.
        return lambda grad_local: give_back(grad_rows, layout, plan)(grad_local)

    variants = {"overlapped": (fetch, give_back), "sequential": (fetch_at_once, give_back_after)}
    times: dict[tuple[str, str], list[float]] = {(v, p): [] for v in variants for p in ("forward", "backward")}
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(args.repeats + 2):
        for name, (start, start_back) in variants.items():
            conv_strips.start_fetch_rows, conv_strips.start_return_rows = start, start_back
            x.grad = weight.grad = None
            dist.barrier()
            sync(device)
            begin = time.perf_counter()
            out = F.conv2d(x, weight, padding=1)
            sync(device)
            middle = time.perf_counter()
            if not cotangent:
                cotangent.append(torch.ones_like(out))
            out.backward(cotangent[0])
            sync(device)
            end = time.perf_counter()
            if i == 0:  # both variants compute the same gradients
                grads.setdefault(name, (x.grad.to_local().clone(), weight.grad.clone()))
            if i >= 2:  # warm-up
                times[name, "forward"].append(middle - begin)
                times[name, "backward"].append(end - middle)
            del out
    conv_strips.start_fetch_rows, conv_strips.start_return_rows = fetch, give_back
    for a, b in zip(grads["overlapped"], grads["sequential"]):
        torch.testing.assert_close(a, b)
    mine = {f"{v} {p}": statistics.median(t) * 1e3 for (v, p), t in times.items()}
    rows: list[Any] = [None] * n
    dist.all_gather_object(rows, mine)
    if dist.get_rank() == 0:
        title = f"F.conv2d(x, w, padding=1), x {args.size} sharded over H on {n} ranks ({device.type})"
        print(f"{title}, median of {args.repeats}")
        print("| rank | pass | overlapped (ms) | sequential (ms) | overlapped / sequential |")
        print("|---:|---|---:|---:|---:|")
        for rank, r in enumerate(rows):
            for p in ("forward", "backward"):
                over, seq = r[f"overlapped {p}"], r[f"sequential {p}"]
                print(f"| {rank} | {p} | {over:.1f} | {seq:.1f} | {over / seq:.3f} |")


def main(argv: list[str] | None = None) -> int:
    launch(_world, _parse(argv), _parse(argv).ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
