"""The largest field that fits: per model and rank count, the largest side whose training step fits a budget.

For each model (PhysicsNeMo's FNO 2-D, UNet 3-D and SongUNet, as ``models.py``
builds them) and each rank count N, find the largest side ``S`` (``H = W = S``;
UNet: a cube ``D = H = W = S``, sharded over ``D``) whose one training step
(forward+backward, after a warm-up step, as ``run.py`` measures models) peaks
below ``--budget-mib`` per rank on the busiest rank. The peak is the step's
peak extra memory (``_common.peak_memory``: ``VmHWM`` on CPU,
``max_memory_allocated`` on CUDA), the parameters and the input already held.
``S`` is a multiple of the model's granularity (FNO: 16; UNet and SongUNet,
which halve the field 3 times: 8 per rank, i.e. 8N), searched by doubling
(or halving) from a start, then bisection. Every trial is a fresh world of N
ranks started through ``_common.launch`` (the runner's ``WorkerPool``).

Variants:

* **shardext**: the model sharded over dim 2 on N ranks with every plugin of
  physicsnemo-shardext loaded;
* **physicsnemo**: the same inside ``physicsnemo_shardext.disabled(plugins=<every
  loaded plugin>)``, i.e. PhysicsNeMo's ShardTensor alone; where its step raises,
  recorded as ``fails: <first error line>``.

At 1 rank both are the plain model on the whole input (one search).

**Ideal**: memory linear in the field's points and the field sharded over one
dim, so N ranks hold N times the points of one rank: ``S_1 * N^(1/2)`` for the
2-D models (``S^2`` points), ``S_1 * N^(1/3)`` for the 3-D UNet (``S^3`` points).

Usage::

    python benchmarks/largest_field.py                          # fno, unet, songunet at 1, 2, 4 ranks, 512 MiB
    python benchmarks/largest_field.py --budget-mib 256,512 --json lf.json --plot docs/benchmarks
    python benchmarks/largest_field.py --quick                  # smoke: fno at 1 and 2 ranks, tiny budgets
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the runner's modules, when run as a script
from _common import RanksFailed, first_line, initialize, launch, pin_mmap_threshold  # noqa: E402

__all__ = ["MODEL_SPECS", "search", "trial_world"]

#: model -> (granularity of the side: fixed, or per rank (times N); spatial dims of the field; start side)
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "fno": {"step": 16, "per_rank": False, "dims": 2, "start": 128},
    "unet": {"step": 8, "per_rank": True, "dims": 3, "start": 32},
    "songunet": {"step": 8, "per_rank": True, "dims": 2, "start": 128},
}
TRIAL_TIMEOUT_S = 600.0


def granularity(model: str, ranks: int) -> int:
    spec = MODEL_SPECS[model]
    return spec["step"] * (ranks if spec["per_rank"] else 1)


# -- one trial: a fresh world ----------------------------------------------------------------------
def trial_world(args: SimpleNamespace) -> None:
    """Body of every rank of a trial: one measured training step of ``args.model`` at side ``args.side``."""
    import torch
    import torch.distributed as dist
    from models import measure_model

    pin_mmap_threshold()
    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # models.build_model: the UNet's cube side is res/8
    res = args.side * 8 if args.model == "unet" else args.side
    margs = SimpleNamespace(model_res=res, repeats=0)
    if world == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        result, _ = measure_model(args.model, margs, None, device, 1)
        Path(args.world_out).write_text(json.dumps({"peaks": [result.peak_mib], "status": result.status}))
        return
    import physicsnemo_shardext

    manager = initialize(timeout_s=300)
    try:
        mesh = manager.initialize_mesh((-1,), ("domain",))
        off = contextlib.nullcontext()
        if args.variant == "physicsnemo":
            names = [p.name for p in physicsnemo_shardext.get_registry().plugins()]
            off = physicsnemo_shardext.disabled(plugins=names)
        with off:
            result, _ = measure_model(args.model, margs, mesh, manager.device, world)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (result.peak_mib, result.status))
        if rank == 0:
            status = next((s for _, s in gathered if s != "ok"), "ok")
            Path(args.world_out).write_text(json.dumps({"peaks": [p for p, _ in gathered], "status": status}))
    finally:
        physicsnemo_shardext.shutdown()


def run_trial(model: str, ranks: int, variant: str, side: int, log: Any) -> dict:
    """One trial in fresh processes: ``{"peak": busiest rank's MiB or None, "status": ..., "seconds": ...}``."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardext-lf-") as tmp:
        out = Path(tmp) / "trial.json"
        args = SimpleNamespace(model=model, side=side, variant=variant, world_out=str(out))
        try:
            launch(trial_world, args, ranks, timeout_s=TRIAL_TIMEOUT_S, grace_s=5.0)
            row = json.loads(out.read_text())
        except (RanksFailed, OSError, ValueError) as exc:
            row = {"peaks": [], "status": f"fails: {_died(str(exc))}"}
    peaks = [p for p in row["peaks"] if p is not None]
    trial = {
        "side": side,
        "peak": max(peaks) if peaks and row["status"] == "ok" else None,
        "status": row["status"],
        "seconds": time.perf_counter() - start,
    }
    peak = "-" if trial["peak"] is None else f"{trial['peak']:.1f} MiB"
    log(f"  {model} {variant} N={ranks} side {side}: {peak} ({trial['status']}, {trial['seconds']:.0f} s)")
    return trial


def _died(report: str) -> str:
    """A dead world in a few words: which rank, its exit code, and the deepest PhysicsNeMo frame it was in."""
    died = re.search(r"rank (\d+): DIED with exit code (-?\d+)", report)
    if not died:
        return first_line(RuntimeError(report), 100)
    frames = re.findall(r'site-packages/(physicsnemo/[\w/]+\.py)", line (\d+) in (\w+)', report)
    frames = [f for f in frames if "domain_parallel" not in f[0]]
    where = f" in {frames[0][0]}:{frames[0][1]} {frames[0][2]}" if frames else ""
    code = int(died.group(2))
    what = "aborts (SIGABRT, e.g. a gloo size mismatch)" if code == -6 else f"dies (exit code {code})"
    return f"rank {died.group(1)} {what}{where}"


# -- the search ----------------------------------------------------------------------------------
def search(measure: Any, budget: float, step: int, start: int, limit: int = 1 << 16) -> tuple[int | None, str]:
    """The largest multiple of ``step`` whose ``measure(side)`` fits ``budget``: doubling or halving, then bisection.

    ``measure(side) -> (peak_mib | None, status)``; a side fits when the status is ``ok`` and the peak
    is at most ``budget``. Returns ``(side, "ok")``, ``(None, "fails: ...")`` when the smallest side tried
    raises (an error, not the budget: the search stops there), or ``(None, "none fits")`` when even
    ``step`` is over the budget. Where doubling reaches ``limit``, the status says so.
    """

    def fits(side: int) -> tuple[bool, str]:
        peak, status = measure(side)
        return status == "ok" and peak is not None and peak <= budget, status

    side = min(max(step, start // step * step), max(step, limit // step * step))
    ok, status = fits(side)
    if status != "ok":
        return None, status
    if ok:
        lo, hi = side, None
        while hi is None and lo * 2 <= limit:
            ok, _ = fits(lo * 2)
            lo, hi = (lo * 2, None) if ok else (lo, lo * 2)
        if hi is None:
            return lo, "ok" if lo * 2 <= limit or lo < step else f"ok (search limit {limit})"
    else:
        hi, lo = side, None
        while lo is None and hi > step:
            smaller = max(step, hi // 2 // step * step)
            ok, status = fits(smaller)
            if status != "ok":
                return None, status
            lo, hi = (smaller, hi) if ok else (None, smaller)
        if lo is None:
            return None, "none fits"
    while hi - lo > step:
        mid = lo + (hi - lo) // step // 2 * step
        ok, _ = fits(mid)
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, "ok"


def ideal(side_1: int | None, ranks: int, dims: int) -> float | None:
    """``S_1 * N^(1/dims)``: N ranks hold N times one rank's points (memory linear in points, one dim sharded)."""
    return None if side_1 is None else side_1 * ranks ** (1 / dims)


def measure_all(models: list[str], rank_list: list[int], budgets: list[float], log: Any, limit: int = 1 << 16) -> dict:
    """Every search; trials are cached by (model, ranks, variant, side), so several budgets share them.

    A variant that raised (not over the budget) is not searched again for the next budget: its error is reused.
    """
    cache: dict[tuple[str, int, str, int], dict] = {}
    errors: dict[tuple[str, int, str], str] = {}
    results = []
    for model in models:
        spec = MODEL_SPECS[model]
        for budget in budgets:
            found: dict[tuple[int, str], tuple[int | None, str]] = {}
            for ranks in rank_list:
                for variant in ("shardext", "physicsnemo"):
                    if ranks == 1 and variant == "physicsnemo":
                        found[(1, variant)] = found[(1, "shardext")]  # the plain model: one search
                        continue
                    step = granularity(model, ranks)
                    key_variant = "plain" if ranks == 1 else variant

                    def measure(side: int, ranks: int = ranks, key_variant: str = key_variant) -> tuple:
                        key = (model, ranks, key_variant, side)
                        if key not in cache:
                            cache[key] = run_trial(model, ranks, key_variant, side, log)
                        return cache[key]["peak"], cache[key]["status"]

                    previous = found.get((1, "shardext"), (None, ""))[0] if ranks > 1 else None
                    start = previous if previous else spec["start"]
                    error = errors.get((model, ranks, key_variant))
                    if error:
                        found[(ranks, variant)] = (None, error)
                        continue
                    found[(ranks, variant)] = search(measure, budget, step, max(step, start // step * step), limit)
                    if found[(ranks, variant)][1].startswith("fails"):
                        errors[(model, ranks, key_variant)] = found[(ranks, variant)][1]
            side_1 = found[(1, "shardext")][0]
            for ranks in rank_list:
                row: dict[str, Any] = {"model": model, "budget_mib": budget, "ranks": ranks, "dims": spec["dims"]}
                for variant in ("shardext", "physicsnemo"):
                    side, status = found[(ranks, variant)]
                    key = (model, ranks, "plain" if ranks == 1 else variant, side)
                    row[variant] = {
                        "side": side,
                        "status": status,
                        "peak_mib": cache[key]["peak"] if side is not None else None,
                    }
                row["ideal"] = ideal(side_1, ranks, spec["dims"])
                got = row["shardext"]["side"]
                row["vs_ideal"] = None if got is None or not row["ideal"] else got / row["ideal"]
                results.append(row)
    trials = [
        {"model": m, "ranks": n, "variant": v, **t} for (m, n, v, _), t in sorted(cache.items(), key=lambda kv: kv[0])
    ]
    return {"results": results, "trials": trials}


# -- output --------------------------------------------------------------------------------------
def _cell(entry: dict, dims: int) -> str:
    if entry["side"] is None:
        return entry["status"]
    shape = "^3" if dims == 3 else f"x{entry['side']}"
    limit = ", search limit" if "limit" in entry["status"] else ""
    return f"{entry['side']}{shape} ({entry['peak_mib']:.0f} MiB{limit})"


def table(report: dict) -> str:
    lines = [
        "Largest side S whose one training step (forward+backward) peaks below the budget per rank (busiest rank); "
        "2-D models: S x S sharded over H; UNet 3-D: S^3 sharded over D. Ideal: S(1 rank) * N^(1/2) (2-D), "
        "* N^(1/3) (3-D): memory linear in the points, one dim sharded. 1 rank: the plain model.",
        "",
        "| model | budget / rank | N | shardext: largest (peak) | PhysicsNeMo alone: largest (peak) | ideal "
        "| shardext / ideal |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for r in report["results"]:
        ideal_cell = "-" if r["ideal"] is None else f"{r['ideal']:.0f}"
        ratio = "-" if r["vs_ideal"] is None else f"{r['vs_ideal']:.2f}"
        lines.append(
            f"| {r['model']} | {r['budget_mib']:g} MiB | {r['ranks']} | {_cell(r['shardext'], r['dims'])} "
            f"| {_cell(r['physicsnemo'], r['dims'])} | {ideal_cell} | {ratio} |"
        )
    return "\n".join(lines)


def write_plot(report: dict, prefix: str, fmt: str = "svg") -> Path:
    """Largest side against ranks, per model (and budget): shardext, PhysicsNeMo alone, the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "physicsnemo-shardext"  # stable ids, as report.write_plots
    path = Path(prefix)
    path = path / f"largest-field.{fmt}" if path.is_dir() or prefix.endswith("/") else Path(f"{prefix}.{fmt}")
    path.parent.mkdir(parents=True, exist_ok=True)
    models = list(dict.fromkeys(r["model"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in report["results"] if r["model"] == model]
        for i, budget in enumerate(dict.fromkeys(r["budget_mib"] for r in rows)):
            sel = sorted((r for r in rows if r["budget_mib"] == budget), key=lambda r: r["ranks"])
            ns = [r["ranks"] for r in sel]
            color = f"C{i}"
            tag = f"{budget:g} MiB"
            ax.plot(ns, [r["shardext"]["side"] or math.nan for r in sel], "o-", color=color, label=f"shardext, {tag}")
            ax.plot(
                ns,
                [r["physicsnemo"]["side"] or math.nan for r in sel],
                "x:",
                color=color,
                label=f"PhysicsNeMo alone, {tag}",
            )
            for r in sel:
                if r["physicsnemo"]["side"] is None and r["ranks"] > 1:
                    ax.annotate("fails", (r["ranks"], r["shardext"]["side"] or 1), fontsize=7, color=color)
            ax.plot(ns, [r["ideal"] or math.nan for r in sel], "--", color=color, alpha=0.5, label=f"ideal, {tag}")
        ns = sorted({r["ranks"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xlabel("ranks")
        ax.set_ylabel("largest side S" + (" (S^3 cube)" if MODEL_SPECS[model]["dims"] == 3 else " (S x S)"))
        ax.set_title(f"{model}: largest field under the budget / rank", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="fno,unet,songunet", help=f"comma-separated ({', '.join(MODEL_SPECS)})")
    parser.add_argument("--ranks", default="1,2,4", help="rank counts")
    parser.add_argument("--budget-mib", default="512", help="per-rank budget(s) in MiB, comma-separated")
    parser.add_argument("--json", default=None, help="write the results and every trial to this file")
    parser.add_argument(
        "--plot", default=None, metavar="PREFIX", help="write PREFIX.svg (a directory: largest-field.svg)"
    )
    parser.add_argument("--plot-format", default="svg", choices=("svg", "png", "pdf"))
    parser.add_argument("--limit", type=int, default=1 << 14, help="largest side tried (default 16384)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: fno at 1 and 2 ranks, budgets 6,12 MiB, sides 32 and 64 only (multiples of 32, limit 64)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.ranks = "fno", "1,2"
        args.limit = min(args.limit, 64)
        if args.budget_mib == parser.get_default("budget_mib"):
            args.budget_mib = "6,12"
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.model_list if m not in MODEL_SPECS]
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)} (known: {', '.join(MODEL_SPECS)})")
    args.rank_list = sorted({int(n) for n in args.ranks.split(",")} | {1})  # 1 rank: the ideal's base
    args.budgets = sorted({float(b) for b in args.budget_mib.split(",")})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        MODEL_SPECS["fno"] = {**MODEL_SPECS["fno"], "step": 32, "start": 32}  # fewer, coarser trials

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    started = time.perf_counter()
    report = measure_all(args.model_list, args.rank_list, args.budgets, log, args.limit)
    report["config"] = {
        "models": args.model_list,
        "ranks": args.rank_list,
        "budgets_mib": args.budgets,
        "granularity": {m: MODEL_SPECS[m] for m in args.model_list},
        "limit": args.limit,
        "seconds": time.perf_counter() - started,
    }
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        print(f"wrote {write_plot(report, args.plot, args.plot_format)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
