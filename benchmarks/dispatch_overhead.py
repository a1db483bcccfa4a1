"""Host-side dispatch overhead: plain tensors vs ShardTensor on a one-rank mesh, per op and per model.

On one rank nothing is communicated, so every microsecond a ShardTensor step
costs beyond the plain step is Python dispatch: ShardTensor's own
``__torch_function__`` (registry lookup, spec bookkeeping, DTensor conversions)
plus what a handler of this package adds (argument binding, layout planning).
That time does not shrink with more GPUs, so it caps strong scaling.

**Per op** (a small ``1 x 8 x 32 x 32`` field, so the kernels themselves cost
little): the median time of one forward call

* ``plain``: the op on a plain tensor;
* ``noop``: the op on a ShardTensor whose handler slot holds a *do-nothing*
  handler (it returns a ShardTensor prepared beforehand): ShardTensor's own
  dispatch and nothing else, no kernel;
* ``ours``: the op on a ShardTensor with the installed handler (this package's,
  PhysicsNeMo's, or none: the DTensor fallback).

``noop`` is ShardTensor's own cost; ``ours - noop - plain`` is what the handler
adds beyond the kernel itself (``plain``); both in microseconds. ``without this
package`` is the same call with every plugin of this package switched off:
PhysicsNeMo's own handler, or the DTensor fallback, as before installing it (a
handler of ours that delegates a configuration costs at least that).

**Per model**: the median forward+backward step of PhysicsNeMo's FNO, Pix2Pix
and 3-D UNet on plain tensors and on a ShardTensor split over H on a one-rank
mesh, and their ratio; ``--compile`` adds the same under ``torch.compile``.

Usage::

    python benchmarks/dispatch_overhead.py                       # CPU, small sizes
    python benchmarks/dispatch_overhead.py --device cuda --size 512 --size 2048 --json overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _init(device: str) -> Any:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    from torch.distributed.device_mesh import init_device_mesh

    import physicsnemo_shardext

    physicsnemo_shardext.initialize()
    return init_device_mesh(device, (1,), mesh_dim_names=("domain",))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_time(step: Callable[[], Any], device: str, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``step`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- per op --------------------------------------------------------------------------------
def _ops(device: str) -> dict[str, tuple[Any, Callable[[torch.Tensor], Any]]]:
    """name -> (registry key the op dispatches on, call)."""
    weight = torch.randn(8, 8, 3, 3, device=device)
    linear = torch.randn(16, 32, device=device)
    return {
        "F.conv2d": (F.conv2d, lambda x: F.conv2d(x, weight, padding=1)),
        "F.gelu": (F.gelu, lambda x: F.gelu(x)),
        "torch.add": (torch.add, lambda x: torch.add(x, x)),
        "F.linear": (F.linear, lambda x: F.linear(x, linear)),
        "F.pad": (F.pad, lambda x: F.pad(x, (1, 1, 1, 1))),
        "F.layer_norm": (F.layer_norm, lambda x: F.layer_norm(x, (32,))),
        "F.group_norm": (F.group_norm, lambda x: F.group_norm(x, 2)),
        "F.max_pool2d": (F.max_pool2d, lambda x: F.max_pool2d(x, 2)),
        "F.interpolate": (F.interpolate, lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest")),
        "torch.fft.rfft2": (torch.fft.rfft2, lambda x: torch.fft.rfft2(x)),
        "Tensor.reshape": (torch.Tensor.reshape, lambda x: x.reshape(1, 8, 1024)),
        "torch.permute": (torch.permute, lambda x: torch.permute(x, (0, 2, 3, 1))),
        "torch.einsum": (torch.einsum, lambda x: torch.einsum("bchw,dc->bdhw", x, weight[:, :, 0, 0])),
    }


def _without_package(measure: Callable[[], float]) -> float | str:
    """``measure()`` with every plugin of this package switched off: PhysicsNeMo's own handler or the
    DTensor fallback (on CPU, PhysicsNeMo's built-ins stay present); the error text if that fails."""
    import physicsnemo_shardext

    names = [plugin.name for plugin in physicsnemo_shardext.get_registry().plugins()]
    try:
        with physicsnemo_shardext.disabled(plugins=names):
            return measure()
    except Exception as error:  # noqa: BLE001 - reported, not fatal
        return f"{type(error).__name__}: {str(error)[:80]}"


def per_op(mesh: Any, device: str, repeats: int) -> list[dict[str, Any]]:
    """The per-op table (see the module docstring)."""
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard

    from physicsnemo_shardext.testing import shard_tensor

    x = torch.randn(1, 8, 32, 32, device=device)
    xs = shard_tensor(x, mesh, [Shard(2)])
    rows = []
    table = ShardTensor._function_registry
    for name, (key, call) in _ops(device).items():
        plain = median_time(lambda: call(x), device, repeats)
        try:
            ours = median_time(lambda: call(xs), device, repeats)
            prepared = call(xs)
        except Exception as error:  # noqa: BLE001 - reported, not fatal
            rows.append({"op": name, "plain_us": plain * 1e6, "error": f"{type(error).__name__}: {error}"})
            continue
        without = _without_package(lambda: median_time(lambda: call(xs), device, repeats))
        held = table.get(key)
        table[key] = lambda func, types, args, kwargs: prepared  # ShardTensor's dispatch, then nothing
        try:
            noop = median_time(lambda: call(xs), device, repeats)
        finally:
            if held is None:
                table.pop(key, None)
            else:
                table[key] = held
        rows.append(
            {
                "op": name,
                "plain_us": plain * 1e6,
                "noop_us": noop * 1e6,
                "ours_us": ours * 1e6,
                "shardtensor_us": noop * 1e6,
                "handler_us": (ours - noop - plain) * 1e6,
                "handler": "installed" if held is not None else "DTensor fallback",
                **({"without_us": without * 1e6} if isinstance(without, float) else {"without_error": without}),
            }
        )
    return rows


# -- per model -------------------------------------------------------------------------------
def _models(size: int, device: str) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    from physicsnemo.models.fno import FNO
    from physicsnemo.models.pix2pix import Pix2Pix
    from physicsnemo.models.unet import UNet

    depth = max(16, size // 8)
    return {
        f"FNO 1x3x{size}x{size}": (
            FNO(
                in_channels=3,
                out_channels=1,
                decoder_layers=1,
                decoder_layer_size=32,
                dimension=2,
                latent_channels=32,
                num_fno_layers=4,
                num_fno_modes=16,
                padding=0,
            ).to(device),
            torch.randn(1, 3, size, size, device=device),
        ),
        f"Pix2Pix 1x1x{size}x{size}": (
            Pix2Pix(
                in_channels=1,
                out_channels=1,
                dimension=2,
                conv_layer_size=16,
                n_downsampling=2,
                n_upsampling=2,
                n_blocks=2,
                batch_norm=True,
                padding_type="reflect",
            ).to(device),
            torch.randn(1, 1, size, size, device=device),
        ),
        f"UNet3D 1x1x{depth}^3": (
            UNet(
                in_channels=1,
                out_channels=1,
                model_depth=3,
                feature_map_channels=[8, 8, 16, 16, 32, 32],
                gradient_checkpointing=False,
            ).to(device),
            torch.randn(1, 1, depth, depth, depth, device=device),
        ),
    }


def per_model(
    mesh: Any,
    device: str,
    sizes: list[int],
    repeats: int,
    compile_too: bool,
    only: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The per-model table: plain vs ShardTensor steps, eager (and compiled); ``only`` keeps the models
    whose name contains one of its words (case-insensitive)."""
    from torch.distributed.tensor import Shard

    from physicsnemo_shardext.testing import shard_tensor

    rows = []
    for size in sizes:
        for name, (model, x) in _models(size, device).items():
            if only and not any(word.lower() in name.lower() for word in only):
                continue
            # dynamic=False, as docs/training.md advises: one graph per shape, no symbolic shapes.
            modes = [("eager", model)] + ([("compile", torch.compile(model, dynamic=False))] if compile_too else [])
            for mode, runner in modes:
                xs = shard_tensor(x, mesh, [Shard(2)], requires_grad=True)
                xp = x.clone().requires_grad_()

                def step(inp: torch.Tensor) -> None:
                    runner(inp).sum().backward()

                row: dict[str, Any] = {"model": name, "mode": mode}
                try:
                    row["plain_ms"] = median_time(lambda: step(xp), device, repeats) * 1e3
                    row["shard_ms"] = median_time(lambda: step(xs), device, repeats) * 1e3
                    row["ratio"] = row["shard_ms"] / row["plain_ms"]
                except Exception as error:  # noqa: BLE001
                    row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def _print_table(title: str, header: list[str], lines: list[list[str]]) -> None:
    """One markdown table (the per-op and per-model results share this shape)."""
    print(title)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in lines:
        print("| " + " | ".join(cells) + " |")


def _op_cells(row: dict[str, Any]) -> list[str]:
    if "error" in row:
        return [row["op"], f"{row['plain_us']:.0f}", "-", "-", f"fails: {row['error'][:60]}", "-"]
    without = f"{row['without_us']:.0f}" if "without_us" in row else f"fails ({row['without_error'][:40]})"
    return [
        row["op"],
        f"{row['plain_us']:.0f}",
        f"{row['noop_us']:.0f}",
        without,
        f"{row['ours_us']:.0f}",
        f"{row['handler_us']:.0f}",
    ]


def _model_cells(row: dict[str, Any]) -> list[str]:
    if "error" in row:
        return [row["model"], row["mode"], "-", f"fails: {row['error'][:80]}", "-"]
    return [row["model"], row["mode"], f"{row['plain_ms']:.2f}", f"{row['shard_ms']:.2f}", f"{row['ratio']:.2f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, action="append", help="model field size (repeat); default 64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--op-repeats", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="also time the models under torch.compile")
    parser.add_argument("--skip-models", action="store_true")
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--model", action="append", help="only models whose name contains this (repeat)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    mesh = _init(args.device)
    ops = [] if args.skip_ops else per_op(mesh, args.device, args.op_repeats)
    if ops:
        _print_table(
            f"per op, {args.device}, 1x8x32x32 on a one-rank mesh (median us of {args.op_repeats}):",
            ["op", "plain", "ShardTensor, do-nothing handler", "without this package", "ours", "handler adds"],
            [_op_cells(row) for row in ops],
        )
    models = (
        []
        if args.skip_models
        else per_model(mesh, args.device, args.size or [64], args.repeats, args.compile, args.model)
    )
    if models:
        _print_table(
            f"\nper model, {args.device}, forward+backward on a one-rank mesh (median ms of {args.repeats}):",
            ["model", "mode", "plain", "ShardTensor", "ratio"],
            [_model_cells(row) for row in models],
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {"device": args.device, "torch": torch.__version__, "ops": ops, "models": models}, handle, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
