"""The benchmark runner's report: per-case summaries and goals, the markdown tables, the figures.

Everything here reads the rows the worlds wrote (``world.py``) or a saved report
(``--from-json``); nothing measures. `build_report` merges the worlds into the
versioned report (``schema`` 1) that ``--json`` writes; `summarize_cases` turns
every rank's row of a case into ratios against the analytic bound, the fallback
and single-process memory, and checks the goals; `family_tables` and
`model_table` print them; `write_plots` draws the figures (matplotlib).

The memory goal depends on the size run (`memory_slack`, `model_memory_slack`):
``1/N + 10%`` where a halo is a small share of a block (a field of at least
1024x1024 spatial points, e.g. ``--size large``; models at ``--model-res`` 1024
and above), ``1/N + 25%`` at the small sizes.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
from pathlib import Path
from typing import Any

import torch
from _common import fmt_bytes
from cases import FAMILIES
from models import MODELS

__all__ = [
    "BYTES_GOAL",
    "EXCHANGE_BYTES_GOAL",
    "FALLBACK_GOAL",
    "LARGE_MODEL_RES",
    "LARGE_SPATIAL",
    "MEMORY_SLACK",
    "SMALL_MEMORY_SLACK",
    "build_report",
    "family_tables",
    "finite",
    "memory_slack",
    "model_memory_slack",
    "model_table",
    "summarize_cases",
    "summarize_models",
    "write_plots",
]

BYTES_GOAL, EXCHANGE_BYTES_GOAL = 1.1, 1.25  # the second for the all-to-all families (FFT, AFNO) and the ring
FALLBACK_GOAL = 5.0  # at 4 ranks, wherever the fallback gathers
MEMORY_SLACK = 0.10  # per-rank peak within 1/N + 10% of single-process, at the large size
SMALL_MEMORY_SLACK = 0.25  # ... and 1/N + 25% at the small sizes, where halos are a larger share of a block
LARGE_SPATIAL = 1024 * 1024  # a field with at least this many spatial points is "large" (1024^2, 128^3)
LARGE_MODEL_RES = 1024  # models at --model-res 1024 and above are "large"


def memory_slack(size: list[int] | tuple[int, ...]) -> float:
    """The families' memory slack over 1/N for a ``B x C x spatial...`` field: 0.10 large, 0.25 small."""
    return MEMORY_SLACK if math.prod(size[2:]) >= LARGE_SPATIAL else SMALL_MEMORY_SLACK


def model_memory_slack(res: int) -> float:
    """The models' memory slack over 1/N at ``--model-res``: 0.10 large, 0.25 small."""
    return MEMORY_SLACK if res >= LARGE_MODEL_RES else SMALL_MEMORY_SLACK


def _pct(slack: float) -> str:
    return f"{slack * 100:.0f}%"


# == summaries and tables ===========================================================================
def _ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``; 0/0 is 1 (both at the bound), x/0 is None (unbounded)."""
    if denominator:
        return numerator / denominator
    return 1.0 if not numerator else None


def summarize_cases(rows: list[dict], slack: float = MEMORY_SLACK) -> list[dict]:
    """One entry per (case, ranks): per-rank lists, ratios and the goals (memory: ``1/N + slack``)."""
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
        memory_ratios = [
            None if not r["single_peak_mib"] or r["peak_mib"] is None else r["peak_mib"] / r["single_peak_mib"]
            for r in per_rank
        ]
        memory_ratio = None if any(m is None for m in memory_ratios) else max(memory_ratios)
        bytes_goal = EXCHANGE_BYTES_GOAL if first["exchange"] else BYTES_GOAL
        memory_goal = 1 / ranks + slack
        goals = {
            "bytes": status == "ok"
            and fwd_ratio is not None
            and bwd_ratio is not None
            and fwd_ratio <= bytes_goal
            and bwd_ratio <= bytes_goal,
            # at 4 ranks, where the fallback runs (right or wrong) and gathers
            "fallback": (
                None
                if ranks != 4 or not gathers or fallback_bytes is None or ours is None or not fallback_ran
                else fallback_bytes >= FALLBACK_GOAL * ours
            ),
            "memory": memory_ratio is not None and memory_ratio <= memory_goal,
        }
        summaries.append(
            {
                "family": family,
                "op": op,
                "ranks": ranks,
                "status": status,
                "bound": first["bound_text"],
                "max_error": max(
                    (r["max_error"] for r in per_rank if r["max_error"] is not None and not math.isnan(r["max_error"])),
                    default=None,
                ),
                "forward": {
                    "bytes": column("forward_bytes"),
                    "bound": column("forward_bound"),
                    "calls": column("forward_calls"),
                    "ratio": fwd_ratio,
                },
                "backward": {
                    "bytes": column("backward_bytes"),
                    "bound": column("backward_bound"),
                    "calls": column("backward_calls"),
                    "ratio": bwd_ratio,
                },
                "fallback": {
                    "path": first["fallback_path"],
                    "status": fallback_status,
                    "gathers": gathers,
                    "partial_grads": any(r["fallback_partial_grads"] for r in per_rank),
                    "forward_bytes": column("fallback_forward_bytes"),
                    "backward_bytes": column("fallback_backward_bytes"),
                    "ops": sorted({k for r in per_rank for k in r["fallback_ops"]}),
                    "peak_mib": column("fallback_peak_mib"),
                    "ratio": fallback_ratio,
                },
                "memory": {
                    "peak_mib": column("peak_mib"),
                    "single_peak_mib": column("single_peak_mib"),
                    "ratio": memory_ratio,
                    "goal": memory_goal,
                    "slack": slack,
                },
                "goals": goals,
                "goal_values": {"bytes": bytes_goal, "fallback": FALLBACK_GOAL, "memory": memory_goal},
            }
        )
    order = {f: i for i, f in enumerate(FAMILIES)}
    summaries.sort(key=lambda s: (order.get(s["family"], 99), s["ranks"]))
    return summaries


def summarize_models(rows: list[dict], slack: float = MEMORY_SLACK) -> list[dict]:
    """One entry per (model, ranks): the busiest rank's peak memory, the step time, ratios to 1 rank, the goal.

    Memory goal: the busiest rank's peak within ``1/N + slack`` of 1 rank's (1 rank: n/a).
    """
    grouped: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["model"], row["ranks"]), []).append(row)
    summaries = []
    for (model, ranks), per_rank in grouped.items():
        status = next((r["status"] for r in per_rank if r["status"] != "ok"), "ok")
        peaks = [r["peak_mib"] for r in per_rank]
        times = [r["median_ms"] for r in per_rank if r["median_ms"] is not None]
        summaries.append(
            {
                "model": model,
                "config": per_rank[0]["config"],
                "ranks": ranks,
                "input": per_rank[0]["input_shape"],
                "status": status,
                "peak_mib": peaks,
                "max_peak_mib": max((p for p in peaks if p is not None), default=None),
                "median_ms": max(times) if times else None,
            }
        )
    single = {s["model"]: s for s in summaries if s["ranks"] == 1}
    for s in summaries:
        base = single.get(s["model"])
        s["memory_vs_1_rank"] = (
            None
            if not base or not base["max_peak_mib"] or s["max_peak_mib"] is None
            else s["max_peak_mib"] / base["max_peak_mib"]
        )
        s["time_vs_1_rank"] = (
            None if not base or not base["median_ms"] or s["median_ms"] is None else s["median_ms"] / base["median_ms"]
        )
        s["memory_goal"] = None if s["ranks"] == 1 else 1 / s["ranks"] + slack
        s["memory_slack"] = slack
        s["memory_goal_met"] = (
            None
            if s["memory_goal"] is None
            else s["memory_vs_1_rank"] is not None and s["memory_vs_1_rank"] <= s["memory_goal"]
        )
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
    slack = next((s["memory"].get("slack") for s in summaries), None)
    if slack is None:  # a report written before the goal depended on the size
        slack = summaries[0]["memory"]["goal"] - 1 / summaries[0]["ranks"] if summaries else MEMORY_SLACK
    lines = [
        f"| family | op | N | fwd / bound | bwd / bound | fallback / ours | mem / single | goal 1/N+{_pct(slack)} "
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
        fb_bytes = (
            None
            if _mean(fb["forward_bytes"]) is None
            else _mean(fb["forward_bytes"]) + (_mean(fb["backward_bytes"]) or 0)
        )
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
    slack = next((s["memory_slack"] for s in summaries if "memory_slack" in s), MEMORY_SLACK)
    lines = [
        f"| model | configuration | input | N | peak mem / rank | vs 1 rank | goal 1/N+{_pct(slack)} | memory goal "
        "| step (fwd+bwd) | vs 1 rank | status |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for s in summaries:
        peak = "-" if s["max_peak_mib"] is None else f"{s['max_peak_mib']:.1f} MiB"
        step = "-" if s["median_ms"] is None else f"{s['median_ms']:.0f} ms"
        goal = "-" if s.get("memory_goal") is None else f"{s['memory_goal']:.2f}"
        lines.append(
            f"| {s['model']} | {s['config']} | {'x'.join(map(str, s['input']))} | {s['ranks']} | {peak} "
            f"| {_r(s['memory_vs_1_rank'])} | {goal} | {_yes(s.get('memory_goal_met'))} | {step} "
            f"| {_r(s['time_vs_1_rank'])} | {s['status']} |"
        )
    return "\n".join(lines)


def _machine(meta: dict) -> str:
    cores = os.cpu_count()
    if meta["device"] == "cuda":
        return f"{torch.cuda.get_device_name(0)}, {meta['backend']}"
    return f"{cores} CPU cores, {meta['backend']}"


def build_report(args: argparse.Namespace, worlds: list[dict], wrapper: dict | None = None) -> dict:
    import physicsnemo

    meta = next(
        (w["meta"] for w in worlds if w["world"] > 1),
        worlds[0]["meta"] if worlds else {"backend": "none", "device": "cpu"},
    )
    cases = [row for w in worlds for row in w["families"]]
    models = [row for w in worlds for row in w["models"]]
    slack, model_slack = memory_slack(args.size), model_memory_slack(args.model_res)
    return {
        "schema": 1,
        "config": {
            "size": args.size,
            "size_class": "large" if slack == MEMORY_SLACK else "small",
            "size_name": getattr(args, "size_name", "custom"),
            "ranks": sorted({w["world"] for w in worlds if w["world"] > 1}),
            "families": args.family_list,
            "models": args.model_list,
            "model_res": args.model_res,
            "attention": {"tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim},
            "dtype": "float32",
            "backend": meta["backend"],
            "device": meta["device"],
            "machine": _machine(meta),
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "physicsnemo": physicsnemo.__version__,
            "python": platform.python_version(),
        },
        "goals": {
            "bytes": BYTES_GOAL,
            "bytes_exchange": EXCHANGE_BYTES_GOAL,
            "fallback_at_4_ranks": FALLBACK_GOAL,
            "memory_slack": slack,
            "model_memory_slack": model_slack,
            "wrapper": 1.05,
        },
        "families": summarize_cases(cases, slack),
        "models": summarize_models(models, model_slack),
        "wrapper": wrapper,
    }


def finite(value: Any) -> Any:
    """The report with every non-finite float as None (JSON has no infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


# == plots ============================================================================================
def write_plots(report: dict, directory: Path, fmt: str = "svg") -> list[Path]:
    """Figures (SVG by default): bytes per family vs bound vs fallback, memory ratio per family, models vs ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "physicsnemo-shardext"  # stable ids: diffs show data changes only
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    # the default size keeps the plain names; a preset adds its name (family-memory-large.svg, models-large.svg)
    name = report["config"].get("size_name", "small")
    suffix = "" if name in ("small", "custom") else f"-{name}"
    field = "x".join(map(str, report["config"]["size"]))
    cases = report["families"]
    rank_counts = sorted({c["ranks"] for c in cases})

    def label(c: dict) -> str:
        return (
            c["family"]
            if sum(1 for d in cases if d["family"] == c["family"] and d["ranks"] == c["ranks"]) == 1
            else f"{c['family']}: {c['op'].split('(')[0]}"
        )

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
                (
                    "family off (fallback)",
                    "#d62728",
                    [
                        total(c["fallback"]["forward_bytes"], c["fallback"]["backward_bytes"]) if ok else None
                        for c, ok in zip(rows, ran)
                    ],
                ),
            ]
            floor, width = 1.0, 0.27  # log scale: zero bytes drawn at 1 B
            for offset, (name, color, values) in zip((-width, 0.0, width), series):
                ax.bar(
                    [x + offset for x in xs],
                    [math.nan if v is None else max(v, floor) for v in values],
                    width,
                    label=name,
                    color=color,
                )
                for x, v in zip(xs, values):
                    if v is None:
                        ax.text(
                            x + offset,
                            floor * 1.3,
                            "fails",
                            rotation=90,
                            ha="center",
                            va="bottom",
                            fontsize=7,
                            color=color,
                        )
            ax.set_yscale("log")
            ax.set_ylabel("bytes / rank (fwd+bwd)")
            ax.set_title(f"{n} ranks, field {field}: bytes each rank hands to collectives (zero drawn at 1 B)")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([label(c) for c in rows], rotation=40, ha="right", fontsize=8)
            ax.legend(fontsize=8, ncols=3)
        fig.tight_layout()
        written.append(directory / f"family-bytes{suffix}.{fmt}")
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
            slack = rows[0]["memory"].get("slack", rows[0]["memory"]["goal"] - 1 / n)
            ax.axhline(
                1 / n + slack,
                color="black",
                linestyle=":",
                linewidth=1,
                label=f"goal 1/N + {_pct(slack)} = {1 / n + slack:.2f}",
            )
            ax.set_ylabel("peak mem / single-process")
            ax.set_title(f"{n} ranks, field {field}: per-rank peak memory of forward+backward (busiest rank)")
            ax.set_xticks(xs)
            ax.set_xticklabels([label(c) for c in rows], rotation=40, ha="right", fontsize=8)
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(directory / f"family-memory{suffix}.{fmt}")
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
        model_slack = next((m["memory_slack"] for m in models if "memory_slack" in m), None)
        if model_slack is not None:
            mem_ax.plot(
                all_ns,
                [1.0 if n == 1 else 1 / n + model_slack for n in all_ns],
                color="black",
                linestyle=":",
                linewidth=1,
                label=f"goal 1/N + {_pct(model_slack)}",
            )
        for ax in (mem_ax, time_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_ns)
            ax.set_xticklabels([str(n) for n in all_ns])
            ax.set_xlabel("ranks")
            ax.legend(fontsize=8)
        mem_ax.set_yscale("log", base=2)
        mem_ax.set_ylabel("peak memory / rank, over 1 rank's")
        res = report["config"].get("model_res")
        mem_ax.set_title(f"training step: per-rank peak memory (busiest rank), res {res}", fontsize=9)
        time_ax.set_yscale("log")
        time_ax.set_ylabel("step time (s)")
        time_ax.set_title(f"training step time ({report['config']['machine']})", fontsize=9)
        fig.tight_layout()
        written.append(directory / f"models{suffix}.{fmt}")
        fig.savefig(written[-1])
        plt.close(fig)
    return written
