"""pytest start-up cost of having physicsnemo-shardext installed, in a project that does not use it.

A throwaway project with one trivial test is run with ``python -m pytest -q``,
with the ``shardext`` plugin (the default once the package is installed) and
with ``-p no:shardext``, alternating, ``--repeats`` times each. Reported: the
median wall time of the whole process (interpreter start to exit) and its median
peak resident set, and the differences. The goal (issue 14): at most 0.3 s and
20 MiB more than without the plugin.

Peak RSS is read by ``/usr/bin/time -v`` when it exists, else by a small
wrapper process that runs ``pytest.main`` and reports its own ``ru_maxrss``.

Usage::

    python benchmarks/pytest_startup.py                       # 3 runs each
    python benchmarks/pytest_startup.py --repeats 5 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_SECONDS = 0.3
GOAL_MIB = 20.0
TIME = "/usr/bin/time"
VARIANTS = {"with plugin": [], "-p no:shardext": ["-p", "no:shardext"]}

# Runs pytest in this process, then prints its own peak RSS (KiB on Linux) to stderr's last line.
_WRAPPER = (
    "import resource, sys, pytest\n"
    "code = pytest.main(sys.argv[1:])\n"
    "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(int(code))\n"
)


def _env() -> dict[str, str]:
    # The user's own pytest settings and SHARDEXT_* switches would change what is measured.
    drop = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_CURRENT_TEST")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SHARDEXT_")}


def run_once(project: Path, extra: list[str], use_time: bool) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one ``pytest -q`` run in ``project``."""
    if use_time:
        report = project / "time.txt"
        command = [TIME, "-v", "-o", str(report), sys.executable, "-m", "pytest", "-q", *extra]
    else:
        command = [sys.executable, "-c", _WRAPPER, "-q", *extra]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=project, env=_env(), capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"pytest failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    if use_time:
        lines = report.read_text().splitlines()
        kib = next(int(line.split(":")[1]) for line in lines if "Maximum resident set size" in line)
    else:
        kib = int(result.stderr.strip().splitlines()[-1].split()[1])
    return seconds, kib / 1024


def measure(repeats: int, use_time: bool) -> dict[str, Any]:
    """Alternate the variants ``repeats`` times in a fresh one-test project; medians and the verdict."""
    project = Path(tempfile.mkdtemp(prefix="shardext-startup-"))
    try:
        (project / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
        for _ in range(repeats):
            for name, extra in VARIANTS.items():
                runs[name].append(run_once(project, extra, use_time))
    finally:
        shutil.rmtree(project, ignore_errors=True)
    results = {
        name: {
            "seconds": [s for s, _ in samples],
            "peak_mib": [m for _, m in samples],
            "median_s": statistics.median(s for s, _ in samples),
            "median_mib": statistics.median(m for _, m in samples),
        }
        for name, samples in runs.items()
    }
    with_, without = results["with plugin"], results["-p no:shardext"]
    overhead = {
        "seconds": with_["median_s"] - without["median_s"],
        "mib": with_["median_mib"] - without["median_mib"],
    }
    return {
        "schema": 1,
        "config": {
            "repeats": repeats,
            "rss_from": "/usr/bin/time -v" if use_time else "ru_maxrss",
            "python": sys.version.split()[0],
        },
        "results": results,
        "overhead": overhead,
        "goals": {"seconds": GOAL_SECONDS, "mib": GOAL_MIB},
        "met": overhead["seconds"] <= GOAL_SECONDS and overhead["mib"] <= GOAL_MIB,
    }


def table(report: dict[str, Any]) -> str:
    """The markdown table and the verdict line."""
    lines = ["| pytest run | median wall time (s) | median peak RSS (MiB) |", "|---|---:|---:|"]
    for name, row in report["results"].items():
        lines.append(f"| {name} | {row['median_s']:.2f} | {row['median_mib']:.1f} |")
    over = report["overhead"]
    lines.append(f"| difference | {over['seconds']:+.2f} | {over['mib']:+.1f} |")
    verdict = "met" if report["met"] else "not met"
    lines.append("")
    lines.append(f"goal (at most +{GOAL_SECONDS} s and +{GOAL_MIB:.0f} MiB): {verdict}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant (the median is reported)")
    parser.add_argument(
        "--rss-from",
        choices=("auto", "time", "wrapper"),
        default="auto",
        help="peak RSS from /usr/bin/time -v (auto: when it exists) or a ru_maxrss wrapper",
    )
    parser.add_argument("--json", default=None, help="also write every sample, the medians and the goals to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_time = args.rss_from == "time" or (args.rss_from == "auto" and os.access(TIME, os.X_OK))
    report = measure(args.repeats, use_time)
    print(
        f"one-test project, python -m pytest -q, median of {args.repeats} (peak RSS from "
        f"{report['config']['rss_from']})\n"
    )
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
