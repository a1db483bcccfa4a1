"""The benchmark runner's worlds: what every rank of a world runs, and the driver that starts the worlds.

`run_world` is the body of every rank of one world: the families' cases
(``measure.measure_case``), then the models (``models.measure_model``), whose
timers run after every memory measurement; rank 0 gathers every rank's rows
and writes them to ``args.world_out``. `measure` runs the worlds and builds the
report: spawned through ``_common.launch`` (a world of 1 for the models'
baseline, then for each ``--ranks`` count a probe world, ``probes.py``, and the
measured world, then a world of one rank for the wrapper's own cost,
``wrapper_cost.py``), or, under ``torchrun``, the one world this process belongs
to (no wrapper case there: it needs a world of its own).

Progress: rank 0 counts the finished tasks (one family, or one model, at one
rank count) and hands them to the one progress bar
(``physicsnemo_shardext.tools.progress``): through a record file that this
process follows while a spawned world runs, or directly under ``torchrun``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import heap_allocations, initialize, launch, launched_by_torchrun, pin_mmap_threshold
from cases import CASES, Shape
from measure import measure_case
from models import ModelResult, Timer, measure_model
from probes import run_probes
from report import build_report
from wrapper_cost import run_wrapper_world

from physicsnemo_shardext.tools.progress import ProgressBar, ProgressFeed, bar_text, write_record

__all__ = ["GROUP_TIMEOUT_S", "measure", "run_world"]

#: Collectives of a measured world time out after this long (a rank-local failure does not hang for half an hour).
GROUP_TIMEOUT_S = 600

Draw = Callable[[str, int, int], None]


def _drawer(bar: ProgressBar) -> Draw:
    """Rank 0's task records on the bar: the count of finished tasks, and in a log one line per finished task."""
    finished = [0]

    def draw(label: str, done: int, total: int) -> None:
        text = bar_text(label, done, total, width=30)
        if done > finished[0]:  # the task ``label`` finished
            finished[0] = done
            bar.update(text, log=f"[{done}/{total}] {label} done")
        else:  # the task ``label`` started
            bar.update(text)

    return draw


class _Tasks:
    """Rank 0's progress: a record when a task starts and when it finishes (other ranks record nothing)."""

    def __init__(self, args: argparse.Namespace, rank: int, draw: Draw | None) -> None:
        self.done, self.total = args.progress_done, max(args.progress_total, 1)
        self.enabled = rank == 0 and not args.no_progress
        self.path = getattr(args, "progress_file", None)
        self.draw = draw

    def show(self, label: str) -> None:
        self._record(label)

    def advance(self, label: str) -> None:
        self.done += 1
        self._record(label)

    def _record(self, label: str) -> None:
        if not self.enabled:
            return
        if self.draw is not None:  # under torchrun: this is rank 0 of the launch
            self.draw(label, self.done, self.total)
        elif self.path:  # a spawned world: the parent follows the file
            write_record(self.path, label, self.done, self.total)


def run_world(args: argparse.Namespace, draw: Draw | None = None) -> None:
    """Body of every rank of one world: the families, then the models; rank 0 writes ``args.world_out``.

    ``draw``: where rank 0 shows progress when it runs in the launching process (torchrun);
    a spawned rank 0 appends it to ``args.progress_file`` instead.
    """
    pin_mmap_threshold()
    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    families: list[dict] = []
    models: list[dict] = []
    progress = _Tasks(args, rank, draw)
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

    aborted, unprobed = getattr(args, "aborted", {}), getattr(args, "unprobed", False)
    manager = initialize(timeout_s=GROUP_TIMEOUT_S)
    try:
        device = manager.device
        mesh = manager.initialize_mesh((-1,), ("domain",))
        shape = Shape(tuple(args.size), world, args.tokens, args.heads, args.head_dim)
        rows: list[Any] = []
        for family in args.family_list:
            for build in CASES[family]:
                progress.show(f"{world} ranks: {family}")
                rows.append(measure_case(family, build, shape, mesh, device, aborted=aborted, unprobed=unprobed))
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
        dist.all_gather_object(
            gathered, ([dataclasses.asdict(r) for r in rows], [dataclasses.asdict(r) for r in model_rows])
        )
        if rank == 0:
            for case_rows, model_rows_of_rank in gathered:
                families.extend(case_rows)
                models.extend(model_rows_of_rank)
            _write_world(args, world, families, models)
    finally:
        physicsnemo_shardext.shutdown()


def _write_world(args: argparse.Namespace, world: int, families: list[dict], models: list[dict]) -> None:
    # A world of 1 measures plain models only (a spawned one has a process group of 1 all the same).
    meta = {
        "backend": dist.get_backend() if world > 1 and dist.is_initialized() else "none",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    Path(args.world_out).write_text(json.dumps({"world": world, "meta": meta, "families": families, "models": models}))


def measure(args: argparse.Namespace) -> dict:
    """Run every world (spawned, or this torchrun one) and build the report (rank 0 under torchrun)."""
    import physicsnemo_shardext

    torchrun = launched_by_torchrun()
    rank = int(os.environ.get("RANK", "0")) if torchrun else 0
    bar = ProgressBar(sys.stderr, enabled=rank == 0 and not args.no_progress)
    draw = _drawer(bar)
    wrapper = None
    with tempfile.TemporaryDirectory(prefix="shardext-bench-") as tmp:
        if torchrun:
            args.world_out = str(Path(tmp) / "world.json") if rank == 0 else os.devnull
            args.single_models = True
            args.aborted, args.unprobed = {}, True
            args.progress_done = 0
            args.progress_total = len(args.family_list) + 2 * len(args.model_list)
            run_world(args, draw)
            if rank != 0:
                physicsnemo_shardext.exit_rank(0)
            worlds = [json.loads(Path(args.world_out).read_text())]
        else:
            plan = ([1] if args.model_list else []) + args.rank_list
            tasks = {n: len(args.model_list) + (len(args.family_list) if n > 1 else 0) for n in plan}
            args.single_models, args.progress_total, done, worlds = False, sum(tasks.values()), 0, []
            args.progress_total += getattr(args, "wrapper", "none") != "none"
            args.progress_file = str(Path(tmp) / "progress")
            feed = ProgressFeed(args.progress_file, draw)
            for n in plan:
                args.aborted = run_probes(args, n, tmp) if n > 1 else {}
                args.world_out = str(Path(tmp) / f"world-{n}.json")
                args.progress_done = done
                launch(run_world, args, n, progress=feed)
                done += tasks[n]
                worlds.append(json.loads(Path(args.world_out).read_text()))
            if getattr(args, "wrapper", "none") != "none":
                args.world_out = str(Path(tmp) / "wrapper.json")
                draw(f"1-rank mesh: {args.wrapper} (wrapper cost)", done, args.progress_total)
                launch(run_wrapper_world, args, 1)
                done += 1
                draw(f"1-rank mesh: {args.wrapper} (wrapper cost)", done, args.progress_total)
                wrapper = json.loads(Path(args.world_out).read_text())
        bar.close()
    return build_report(args, worlds, wrapper)
