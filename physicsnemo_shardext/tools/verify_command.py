"""``shardext verify``: start the ranks, run `check_model` on them, print the report, exit 0/1/2/3.

Without ``torchrun`` the command spawns ``--ranks`` CPU processes itself (gloo,
the multirank tests' worker pool) and waits for them with a timeout; a rank
that hangs ends the run with every rank's Python stacks. Under ``torchrun``
(``WORLD_SIZE`` set) every process runs the check inline on its own device
(NCCL on GPUs) and rank 0 prints.

Exit status: 0 every compared tensor matches, 1 a mismatch, 2 an op raised in
the sharded run (unsupported), 3 bad input (factory, shape, split, a failing
reference run, a hang or a dead rank).

Examples:
    >>> parse_shape("1x3x64x64"), parse_mesh("2x2", 4, dims=2)
    ((1, 3, 64, 64), (2, 2))
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from physicsnemo_shardext.tools.progress import ProgressBar, ProgressFeed, bar_text

__all__ = ["add_arguments", "config_from_args", "parse_mesh", "parse_shape", "render_text", "run_verify"]

BAD_INPUT = 3


class UsageError(ValueError):
    """A flag that cannot be run (reported before any rank starts)."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1x3x64x64"`` -> ``(1, 3, 64, 64)``."""
    try:
        shape = tuple(int(part) for part in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise UsageError(f"--input {text!r}: expected sizes joined by x, like 1x3x64x64") from None
    if not shape or min(shape) < 1:
        raise UsageError(f"--input {text!r}: every size must be positive")
    return shape


def parse_mesh(text: str | None, ranks: int, dims: int = 1) -> tuple[int, ...]:
    """The mesh shape: ``--mesh AxB`` or, by default, ``(ranks,)`` (``(2, ranks/2)`` for two shard dims)."""
    if text is None:
        if dims == 1:
            return (ranks,)
        if dims == 2 and ranks % 2 == 0:
            return (2, ranks // 2)
        raise UsageError(f"{dims} --shard dims over {ranks} ranks: give --mesh (one size per shard dim)")
    try:
        mesh = parse_shape(text)
    except UsageError:
        raise UsageError(f"--mesh {text!r}: expected sizes joined by x, like 2x2") from None
    product = 1
    for size in mesh:
        product *= size
    if product != ranks:
        raise UsageError(f"--mesh {text} has {product} ranks but --ranks is {ranks}")
    if len(mesh) != dims:
        raise UsageError(f"--mesh {text} has {len(mesh)} dims but {dims} --shard dim(s) were given")
    return mesh


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``shardext verify`` (documented in ``docs/reference/cli.md``)."""
    parser.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="callable returning the model, or (model, inputs); MODULE may be path/to/file.py",
    )
    parser.add_argument("--input", metavar="SHAPE", help="input shape, e.g. 1x3x256x256 (seeded randn)")
    parser.add_argument(
        "--shard",
        metavar="DIM",
        type=int,
        action="append",
        help="input dim to shard (repeat for a 2-D mesh); default 2",
    )
    parser.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--mesh", metavar="AxB", help="mesh shape, one size per --shard (default: --ranks)")
    parser.add_argument(
        "--split", default="uneven", help="even, uneven (default) or sizes: 10,7 (one dim) or 10,7/8,8 (two)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--train", dest="train", action="store_true", default=True, help="train mode (default; dropout is set to p=0)"
    )
    mode.add_argument("--eval", dest="train", action="store_false", help="eval mode")
    parser.add_argument(
        "--loss",
        default="mse",
        choices=["mse", "sum"],
        help="mse against a seeded random target (default) or the output's sum",
    )
    parser.add_argument("--rtol", type=float, help="relative tolerance (default by dtype: 1e-4 for float32)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default by dtype: 1e-5 for float32)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="also load this module (or file.py:attr) as a plugin on every rank",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hanging run is stopped")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON (- for stdout)")
    parser.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace, progress_path: str | None) -> Any:
    """A `VerifyConfig` from parsed flags (raises `UsageError` for flags that cannot be run)."""
    from physicsnemo_shardext.tools.model_check import VerifyConfig

    dims = tuple(args.shard or [2])
    if args.ranks < 1:
        raise UsageError(f"--ranks {args.ranks}: need at least 1")
    mesh = parse_mesh(args.mesh, args.ranks, len(dims))
    return VerifyConfig(
        factory=args.factory,
        input_shape=parse_shape(args.input) if args.input else None,
        shard_dims=dims,
        ranks=args.ranks,
        mesh=mesh,
        split=args.split,
        dtype=args.dtype,
        train=args.train,
        loss=args.loss,
        rtol=args.rtol,
        atol=getattr(args, "atol", None),
        seed=args.seed,
        plugins=tuple(args.plugin),
        progress_path=progress_path,
    )


def _precheck(config: Any) -> None:
    """What the parent can refuse before starting ranks: the factory import, dims and rows."""
    from physicsnemo_shardext.tools.model_check import load_factory, split_sizes

    load_factory(config.factory)
    if config.input_shape is None:
        return
    for mesh_dim, dim in enumerate(config.shard_dims):
        if not -len(config.input_shape) <= dim < len(config.input_shape):
            raise UsageError(f"--shard {dim}: the input {list(config.input_shape)} has {len(config.input_shape)} dims")
        split = config.split if "/" not in config.split else config.split.split("/")[mesh_dim]
        split_sizes(config.input_shape[dim], config.mesh[mesh_dim], split)


# -- running -----------------------------------------------------------------------------------
def run_verify(args: argparse.Namespace, out: TextIO) -> int:
    """The ``verify`` subcommand; returns the exit status."""
    from physicsnemo_shardext.tools.model_check import BadInput

    workdir = Path(tempfile.mkdtemp(prefix="shardext-verify-"))
    progress_path = str(workdir / "progress")
    try:
        config = config_from_args(args, progress_path)
        _precheck(config)
    except (UsageError, BadInput) as error:
        sys.stderr.write(f"shardext verify: error: {error}\n")
        return BAD_INPUT
    if os.environ.get("WORLD_SIZE"):
        report = _run_inline(config)
        if report is None:
            return 0  # not rank 0: rank 0 prints and sets the job's status
    else:
        report, failure = _run_pool(config, workdir, show_progress=not args.no_progress, timeout_s=args.timeout)
        if report is None:
            sys.stderr.write(f"shardext verify: the ranks did not finish:\n{failure}\n")
            return BAD_INPUT
    _emit(report, args, out)
    shutil.rmtree(workdir, ignore_errors=True)
    return int(report["exit_code"])


def _run_inline(config: Any) -> dict[str, Any] | None:
    import torch.distributed as dist

    from physicsnemo_shardext import initialize
    from physicsnemo_shardext.tools.model_check import check_model

    initialize()
    if dist.get_world_size() != config.ranks:
        config = _replace(
            config,
            ranks=dist.get_world_size(),
            mesh=parse_mesh(
                None if len(config.shard_dims) == 1 else "x".join(map(str, config.mesh)),
                dist.get_world_size(),
                len(config.shard_dims),
            ),
        )
    return check_model(_replace(config, progress_path=None))


def _replace(config: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **changes)


def _run_pool(
    config: Any, workdir: Path, *, show_progress: bool, timeout_s: float
) -> tuple[dict[str, Any] | None, str]:
    import json

    from physicsnemo_shardext.ranks.worker import RankTask
    from physicsnemo_shardext.ranks.worker_pool import WorkerPool
    from physicsnemo_shardext.testing.isolation import RANK_TASK_ENVIRONMENT  # sandbox, seeding, fixtures

    report_path = workdir / "report.json"
    task = RankTask(
        nodeid=f"shardext verify {config.factory}",
        module_name="physicsnemo_shardext.tools.verify_command",
        file_path=__file__,
        qualname="rank_main",
        kwargs_blob=pickle.dumps({"config": config, "report_path": str(report_path)}),
        sys_path=(os.getcwd(),),
        seed=config.seed,
        environment=RANK_TASK_ENVIRONMENT,
    )
    pool = WorkerPool(config.ranks, startup_timeout_s=max(120.0, config.ranks * 60.0), grace_s=15.0)
    bar = ProgressBar(sys.stderr, enabled=show_progress)
    feed = ProgressFeed(config.progress_path, lambda *record: _draw(bar, *record))
    try:
        if show_progress:
            bar.update(f"starting {config.ranks} ranks", log=f"starting {config.ranks} ranks")
            feed.start()
        outcome = pool.run(task, timeout_s=timeout_s)
    finally:
        if show_progress:
            feed.stop()
            bar.close()
        pool.close()
        pool.kill()
    if report_path.exists():
        return json.loads(report_path.read_text(encoding="utf-8")), ""
    return None, outcome.report() if not outcome.ok else "rank 0 wrote no report"


def rank_main(config: Any, report_path: str) -> None:
    """What each spawned rank runs (a worker-pool task)."""
    from physicsnemo_shardext.tools.model_check import check_model, write_json

    report = check_model(config)
    if report is not None:
        write_json(report, report_path)


def _draw(bar: ProgressBar, phase: str, done: int, total: int) -> None:
    """Rank 0's progress record on the bar: every phase in a log, the op counts on a terminal only."""
    text = _bar_text(phase, done, total)
    bar.update(text, log=None if text.endswith(" ops") else text)


def _bar_text(phase: str, done: int, total: int) -> str:
    """One progress line.

    Examples:
        >>> _bar_text("sharded forward", 5, 10)
        'sharded forward [##########----------] 5/10 ops'
    """
    if total <= 0 or phase != "sharded forward":
        return phase
    return bar_text(phase, done, total, unit="ops")


# -- output -------------------------------------------------------------------------------------
def _emit(report: dict[str, Any], args: argparse.Namespace, out: TextIO) -> None:
    from physicsnemo_shardext.tools.model_check import write_json
    from physicsnemo_shardext.tools.verify_html import write_html

    if args.json:
        write_json(report, args.json)
    if args.html:
        write_html(report, args.html)
    if args.json != "-":
        out.write(render_text(report))


def _size(nbytes: int) -> str:
    """Bytes for people.

    Examples:
        >>> _size(512), _size(2048), _size(3 * 2**20)
        ('512 B', '2.0 KiB', '3.0 MiB')
    """
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _short_site(site: dict[str, Any] | None) -> str:
    if not site:
        return "?"
    return f"{Path(site['file']).name}:{site['line']}"


def _short_handler(name: str) -> str:
    """A handler's function name without its module (the JSON report keeps the full name).

    Examples:
        >>> _short_handler("patches.convolution.sharded_conv"), _short_handler("DTensor fallback")
        ('sharded_conv', 'DTensor fallback')
    """
    if name.startswith("dispatch: ") or " " in name:
        return name
    return name.rsplit(".", 1)[-1]


def render_text(report: dict[str, Any]) -> str:
    """The report as people read it in a terminal (see ``docs/reference/cli.md`` for a real one)."""
    config = report["config"]
    lines = [
        f"shardext verify {config['factory']}  ({report['ranks']} ranks, {config['dtype']}, "
        f"{'train' if config['train'] else 'eval'}, loss {config['loss']})"
    ]
    if report["status"] == "bad-input":
        lines.append(report["summary"])
        return "\n".join(lines) + "\n"
    split = report.get("split", {})
    lines.append(f"input split: {', '.join(split.get('placements', []))} sizes {split.get('sizes')}")
    lines += [f"note: {note}" for note in report.get("notes", [])]
    header = ("#", "op", "site", "calls", "handler", "provider", "output", "fwd coll/bytes", "bwd coll/bytes", "flag")
    rows = []
    for op in report["ops"]:
        flags = []
        if op["error"]:
            flags.append("ERROR")
        if op["activation_gathers"]:
            flags.append("GATHER")
        if not op["stayed_sharded"]:
            flags.append("REPLICATED")
        rows.append(
            (
                str(op["index"]),
                op["op"].replace("torch.nn.functional.", "F."),
                _short_site(op["site"]),
                str(op["calls"]),
                _short_handler(op["handler"]),
                op["provider"].replace("physicsnemo-shardext", "shardext"),
                op["output"],
                f"{max(op['forward']['collectives'])}/{_size(max(op['forward']['bytes']))}",
                f"{max(op['backward']['collectives'])}/{_size(max(op['backward']['bytes']))}",
                " ".join(flags),
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    lines.append("(collectives and bytes: the most on any rank; --json has every rank's)")
    error = report.get("error")
    if error:
        lines.append("")
        lines.append(f"first error: {error['type']} in {error['op'] or '?'}")
        if error.get("configuration"):
            lines.append(f"  configuration: {error['configuration']}")
        if error.get("site"):
            lines.append(f"  at {error['site']['file']}:{error['site']['line']} in {error['site']['function']}")
            lines.append(f"    {error['site']['code']}")
        lines.append(f"  {error['message'].splitlines()[0] if error['message'] else ''}")
    if report["comparison"]:
        lines.append("")
        lines.append(
            f"against single-process (|a - r| <= atol + rtol*|r| per element, rtol {report['tolerance']:.0e}, "
            f"atol {report.get('atol', 0.0):.0e}; relative error max|a-r|/max(max|r|, atol)), "
            "mismatches first:"
        )
        for row in report["comparison"][:12]:
            mark = "ok" if row["ok"] else "MISMATCH"
            max_abs = "-" if row["max_abs_error"] is None else f"{row['max_abs_error']:.2e}"
            extra = f" {row['detail']}" if row.get("detail") else ""
            lines.append(f"  {mark:8s} {row['relative_error']:.2e}  (max abs {max_abs})  {row['tensor']}{extra}")
        if len(report["comparison"]) > 12:
            lines.append(f"  ... {len(report['comparison']) - 12} more, all within the worst above")
    if report["next_steps"]:
        lines.append("")
        lines.append("next:")
        lines += [f"  - {step}" for step in report["next_steps"]]
    lines.append("")
    lines.append(report["summary"])
    return "\n".join(lines) + "\n"
