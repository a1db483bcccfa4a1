"""The wrapper's own cost: one training step on a ONE-rank mesh, ShardTensor against plain tensors.

`run_wrapper_world` is the body of a world of one rank (spawned through
``_common.launch``, fresh processes like every world of the runner): it builds
``--wrapper``'s model (``models.build_model`` at ``--model-res``) and measures,
in the same process, the peak extra memory of one forward+backward

* **plain**: the model on the whole input, plain tensors;
* **sharded**: a copy of the model through ``distribute_module`` on a mesh of one
  rank, its input a ShardTensor ``Shard(2)`` of that mesh (every plugin loaded).

Nothing is split, so every byte the sharded step needs beyond the plain one is
the wrapper's: ShardTensor/DTensor metadata, handlers' copies, the dispatch.
Goal: ``sharded / plain <= 1.05``. On CPU the peak is ``VmHWM`` (``_common.peak_memory``),
on CUDA ``max_memory_allocated``; both steps come after a warm-up step of each,
the plain one first. Rank 0 writes the row to ``args.world_out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import first_line, heap_allocations, initialize, peak_memory, pin_mmap_threshold, sync
from cases import randn
from measure import cotangent_like
from models import build_model

__all__ = ["WRAPPER_GOAL", "run_wrapper_world", "wrapper_table"]

WRAPPER_GOAL = 1.05  # sharded step on one rank / plain step: peak memory


def _step(model: torch.nn.Module, x: torch.Tensor, cotangent: list[Any], sharded: bool, device: torch.device) -> None:
    x.grad = None
    model.zero_grad(set_to_none=True)
    out = model(x)
    if cotangent[0] is None:
        full = randn(*out.shape, seed=7).to(device)
        cotangent[0] = cotangent_like(out, full) if sharded else full
    out.backward(cotangent[0])
    del out


def run_wrapper_world(args: argparse.Namespace) -> None:
    """Body of the one-rank world: plain and one-rank-mesh steps of ``args.wrapper``; writes ``args.world_out``."""
    import physicsnemo_shardext

    pin_mmap_threshold()
    warnings.filterwarnings("ignore")
    manager = initialize()
    row: dict[str, Any] = {"model": args.wrapper, "res": args.model_res, "status": "ok"}
    try:
        from torch.distributed.tensor import Shard, distribute_module

        from physicsnemo_shardext.testing import shard_tensor

        device = manager.device
        mesh = manager.initialize_mesh((-1,), ("domain",))
        model, full, config = build_model(args.wrapper, args.model_res)
        row.update(config=config, input_shape=list(full.shape), device=device.type)
        plain = model.to(device)
        sharded = distribute_module(copy.deepcopy(plain), mesh)
        x_plain = full.to(device).requires_grad_(True)
        x_sharded = shard_tensor(full.to(device), mesh, [Shard(2)], requires_grad=True)
        variants = {
            "plain": (plain, x_plain, [None], False),
            "sharded": (sharded, x_sharded, [None], True),
        }
        peaks: dict[str, float | None] = {}
        try:
            for m, x, cot, is_sharded in variants.values():
                _step(m, x, cot, is_sharded, device)  # warm-up: caches, plans, the cotangent
            for name, (m, x, cot, is_sharded) in variants.items():
                x.grad = None
                m.zero_grad(set_to_none=True)
                sync(device)
                with peak_memory(device) as peak:
                    _step(m, x, cot, is_sharded, device)
                peaks[name] = peak[0]
            times: dict[str, float] = {}
            with heap_allocations():  # after every memory measurement
                for name, (m, x, cot, is_sharded) in variants.items():
                    samples = []
                    for _ in range(max(1, args.repeats)):
                        sync(device)
                        start = time.perf_counter()
                        _step(m, x, cot, is_sharded, device)
                        sync(device)
                        samples.append(time.perf_counter() - start)
                    times[name] = statistics.median(samples) * 1e3
            row.update(
                plain_peak_mib=peaks["plain"],
                sharded_peak_mib=peaks["sharded"],
                plain_ms=times["plain"],
                sharded_ms=times["sharded"],
            )
        except Exception as exc:  # noqa: BLE001 - reported in the row
            row["status"] = f"fails: {type(exc).__name__}: {first_line(exc)}"
        plain_peak, sharded_peak = row.get("plain_peak_mib"), row.get("sharded_peak_mib")
        row["ratio"] = sharded_peak / plain_peak if plain_peak and sharded_peak is not None else None
        row["time_ratio"] = row["sharded_ms"] / row["plain_ms"] if row.get("plain_ms") else None
        row["goal"] = WRAPPER_GOAL
        row["met"] = row["ratio"] is not None and row["ratio"] <= WRAPPER_GOAL
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.world_out).write_text(json.dumps(row))
    finally:
        physicsnemo_shardext.shutdown()


def wrapper_table(row: dict) -> str:
    """Markdown: the one-rank case's plain and sharded peaks, their ratio and the goal."""

    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} MiB"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f} ms"

    ratio = "-" if row.get("ratio") is None else f"{row['ratio']:.3f}"
    goal = "met" if row.get("met") else "**not met**"
    return "\n".join(
        [
            f"The wrapper's own cost: {row['model']} ({row.get('config', '')}), input "
            f"{'x'.join(map(str, row.get('input_shape', [])))}, one training step on a mesh of ONE rank "
            f"({row.get('device', 'cpu')}), ShardTensor vs plain tensors in the same process",
            "",
            f"| model | plain peak | sharded (1-rank mesh) peak | sharded / plain | goal <= {WRAPPER_GOAL:.2f} "
            "| plain step | sharded step | status |",
            "|---|---:|---:|---:|---|---:|---:|---|",
            f"| {row['model']} | {mib(row.get('plain_peak_mib'))} | {mib(row.get('sharded_peak_mib'))} | {ratio} "
            f"| {goal} | {ms(row.get('plain_ms'))} | {ms(row.get('sharded_ms'))} | {row['status']} |",
        ]
    )
