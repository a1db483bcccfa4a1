"""Benchmark every first-party patch family, and whole PhysicsNeMo models, on ranks it starts itself.

For each patch family, one representative op on a field sharded evenly over its
first spatial dim (``H``), forward and backward, at each ``--ranks`` count:

* **bytes**: the payload bytes each rank hands to collectives (``CommCounter``),
  forward and backward, against the *analytic minimum* derived for the op
  (``docs/benchmarks.md`` gives each derivation) and against the *fallback*: the
  same op inside ``physicsnemo_shardext.disabled(plugins=[family])`` (ShardTensor's
  DTensor fallback, or PhysicsNeMo's own handler where it has one), recorded as
  ``fails: <error>`` where that raises;
* **memory**: each rank's peak extra memory of one forward+backward over the
  single-process run's (the same op on the whole field, in the same process);
  goal ``1/N + 10%`` at the large size (``--size large``: a halo is a small share
  of a block), ``1/N + 25%`` at the small ones (``report.memory_slack``).

Goals, checked per row: bytes within 1.1x of the bound (1.25x for the FFT, AFNO
and attention), at least 5x below the fallback at 4 ranks wherever the fallback
gathers, memory within ``1/N + 10%`` (large) or ``1/N + 25%`` (small) of single-process.

Whole models (PhysicsNeMo's FNO, UNet, Pix2Pix and SongUNet, and timm's
VisionTransformer when timm is installed), input sharded over ``H`` (UNet: ``D``),
at 1 rank (the plain model on the whole input) and at each ``--ranks`` count:
per-rank peak memory of one training step (forward+backward) over 1 rank's
(goal ``1/N + 10%`` at ``--model-res`` 1024 and above, else ``1/N + 25%``) and
its median wall time.

The wrapper's own cost (``wrapper_cost.py``, ``--wrapper MODEL``): one training
step of a model on a mesh of ONE rank, ShardTensor against plain tensors in the
same process; goal: peak memory within 1.05x.

Usage::

    python benchmarks/run.py                                   # every family and model, 2 and 4 gloo CPU ranks
    python benchmarks/run.py --size large                      # 1x16x1024x1024 fields, models at 1024
    python benchmarks/run.py --size large3d --models none      # 1x16x128x128x128 fields
    python benchmarks/run.py --families convolution,fft --ranks 2 --size 1x4x32x32 --models none --json out.json
    python benchmarks/run.py --json docs/benchmarks/results.json --plot docs/benchmarks
    torchrun --nproc-per-node 4 benchmarks/run.py --json out.json   # one world (NCCL on GPUs); models at 1 rank on rank 0

A progress bar goes to stderr; the tables (markdown) to stdout.

This file is the command line; the runner's other jobs are modules beside it:
``cases.py`` (the op and analytic bound of each family), ``measure.py`` (one case
on the ranks of a world), ``probes.py`` (finding the variants that kill the
process, first), ``models.py`` (whole models), ``world.py`` (what each rank runs,
and starting the worlds through ``_common.launch``) and ``report.py`` (summaries,
goals, tables and figures).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the runner's modules, when run as a script
from _common import launched_by_torchrun  # noqa: E402
from cases import FAMILIES  # noqa: E402
from models import MODELS  # noqa: E402
from report import family_tables, finite, model_table, write_plots  # noqa: E402
from world import measure  # noqa: E402
from wrapper_cost import wrapper_table  # noqa: E402

#: ``--size`` presets: the field, and the models' default ``--model-res``.
SIZES = {
    "small": ([1, 16, 256, 256], 256),
    "large": ([1, 16, 1024, 1024], 1024),
    "small3d": ([1, 16, 64, 64, 64], 256),
    "large3d": ([1, 16, 128, 128, 128], 1024),
}


def _names(value: str, known: Sequence[str], what: str) -> list[str]:
    if value in ("all", ""):
        return list(known)
    if value == "none":
        return []
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="all", help=f"comma-separated, 'all' or 'none' ({', '.join(FAMILIES)})")
    parser.add_argument("--models", default="all", help=f"comma-separated, 'all' or 'none' ({', '.join(MODELS)})")
    parser.add_argument("--ranks", default="2,4", help="rank counts to spawn (ignored under torchrun)")
    parser.add_argument(
        "--size",
        default="small",
        help="B x C x H x W (or x D x H x W for 3-D) of the field, sharded over the first spatial dim, or a preset: "
        + ", ".join(f"{k} ({'x'.join(map(str, v[0]))}, models at {v[1]})" for k, v in SIZES.items()),
    )
    parser.add_argument("--tokens", type=int, default=4096, help="attention: sequence length L (sharded)")
    parser.add_argument("--heads", type=int, default=8, help="attention: heads")
    parser.add_argument("--head-dim", type=int, default=64, help="attention: head dim E")
    parser.add_argument(
        "--model-res",
        type=int,
        default=None,
        help="models: image side (UNet: a cube of side res/8); default 256, 1024 with --size large/large3d",
    )
    parser.add_argument(
        "--wrapper",
        default="auto",
        help=f"the wrapper's own cost: this model on a 1-rank mesh vs plain ({', '.join(MODELS)}; 'none': skip; "
        "'auto', the default: fno when any model is measured, else none)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="models: timed steps (median)")
    parser.add_argument("--json", default=None, help="write the whole report (every rank's numbers) to this file")
    parser.add_argument("--plot", default=None, help="write the figures to this directory (needs matplotlib)")
    parser.add_argument("--plot-format", default="svg", choices=("svg", "png", "pdf"), help="figure format")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="measure nothing: print the tables (and --plot) of a report written by --json",
    )
    args = parser.parse_args(argv)
    args.family_list = _names(args.families, FAMILIES, "families")
    args.model_list = _names(args.models, MODELS, "models")
    args.rank_list = sorted({int(n) for n in args.ranks.split(",")})
    if any(n < 2 for n in args.rank_list):
        parser.error("--ranks: at least 2 (models are measured at 1 rank anyway)")
    preset = SIZES.get(args.size.lower())
    args.size_name = args.size.lower() if preset is not None else "custom"
    if preset is not None:
        args.size, default_res = list(preset[0]), preset[1]
    else:
        args.size, default_res = [int(n) for n in args.size.lower().split("x")], 256
    if len(args.size) < 3:
        parser.error("--size: B x C x at least one spatial dim")
    if args.model_res is None:
        args.model_res = default_res
    if args.wrapper == "auto":
        args.wrapper = "fno" if args.model_list else "none"
    if args.wrapper != "none" and args.wrapper not in MODELS:
        parser.error(f"--wrapper: unknown model {args.wrapper} (known: {', '.join(MODELS)}, none)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = json.loads(Path(args.from_json).read_text()) if args.from_json else measure(args)
    if report["families"]:
        config = report["config"]
        print(
            f"Field {'x'.join(map(str, config['size']))} float32 sharded over the first spatial dim; ranks "
            f"{', '.join(map(str, config['ranks']))}; {config['machine']}; torch {config['torch']}, PhysicsNeMo "
            f"{config['physicsnemo']}; {config['date']}\n"
        )
        print(family_tables(report["families"]) + "\n")
    if report["models"]:
        print(model_table(report["models"]) + "\n")
    if report.get("wrapper"):
        print(wrapper_table(report["wrapper"]) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(finite(report), indent=1, allow_nan=False) + "\n")
    if args.plot:
        for path in write_plots(report, Path(args.plot), args.plot_format):
            print(f"wrote {path}")
    if launched_by_torchrun():
        import physicsnemo_shardext

        physicsnemo_shardext.exit_rank(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
