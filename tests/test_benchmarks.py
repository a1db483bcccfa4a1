"""Smoke tests of benchmarks/: each runs end to end on a tiny size and prints its table (not timing tests)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_spectral_layer_benchmark_prints_both_variants_on_2_ranks():
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "spectral_layer.py"),
            "--nproc",
            "2",
            "--channels",
            "2",
            "--height",
            "16",
            "--width",
            "12",
            "--modes",
            "3",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "1x2x16x12 sharded over H, 2 ranks (cpu, gloo)" in result.stdout
    rows = {
        (m.group(1), int(m.group(2))): m.group(0)
        for m in re.finditer(r"^\| (patched|fallback) \| (\d) \|.*$", result.stdout, re.M)
    }
    assert set(rows) == {("patched", 0), ("patched", 1), ("fallback", 0), ("fallback", 1)}, result.stdout
    for rank in (0, 1):
        cells = [c.strip() for c in rows[("patched", rank)].strip("|").split("|")]
        assert cells[-1] == "ok", rows[("patched", rank)]  # the patched layer runs forward and backward
        assert float(cells[-2]) < 1e-4  # and matches the single-process layer
        fallback = [c.strip() for c in rows[("fallback", rank)].strip("|").split("|")]
        assert int(fallback[3]) >= 1  # the fallback's own collectives are counted, not hidden in DTensor


def _attention_benchmark(tmp_path: Path, *options: str) -> tuple[str, dict]:
    report = tmp_path / "attention.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "attention.py"), *options, "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout, json.loads(report.read_text())


def test_attention_benchmark_meets_the_byte_bounds_on_2_ranks(tmp_path):
    out, report = _attention_benchmark(
        tmp_path, "--nproc", "2", "--tokens", "256", "--heads", "4", "--dim", "16", "--causal", "--repeats", "1"
    )
    assert "q, k, v of 1x4x256x16 (B x H x L x E, float32) sharded over L, 2 ranks (cpu, gloo)" in out
    rows = {(r["variant"], r["rank"]): r for r in report["results"]}
    assert set(rows) == {(v, rank) for v in ("ring", "gather", "physicsnemo", "single") for rank in (0, 1)}
    table = {(m.group(1), int(m.group(2))) for m in re.finditer(r"^\| (\w+) \| (\d) \|", out, re.M)}
    assert table == set(rows), out
    goals = report["goals"]
    for rank in (0, 1):
        ring = rows[("ring", rank)]
        assert ring["status"] == "ok", ring
        assert ring["forward_ratio"] <= goals["forward"], ring  # K/V once around the ring
        assert ring["backward_ratio"] <= goals["backward"], ring  # K/V again, dK/dV partials home
        assert ring["max_error"] < 1e-5, ring  # output and q/k/v gradients match single-process
        assert ring["peak_mib"] is not None and ring["median_ms"] > 0
        assert rows[("gather", rank)]["status"] == "ok" and rows[("gather", rank)]["max_error"] < 1e-5
        # PhysicsNeMo's own ring needs CUDA: measured beside it, reported as a crash on CPU ranks
        assert rows[("physicsnemo", rank)]["status"].startswith("crashes ("), rows[("physicsnemo", rank)]


@pytest.mark.slow
def test_attention_benchmark_memory_goal_on_4_ranks(tmp_path):
    # The size: 4096 tokens on 4 ranks (B=1, H=8, E=64); memory is meaningless on tiny sizes.
    _, report = _attention_benchmark(tmp_path, "--nproc", "4", "--repeats", "1")
    for r in report["results"]:
        if r["variant"] == "ring":
            assert r["status"] == "ok" and r["max_error"] < 1e-5, r
            assert r["forward_ratio"] <= report["goals"]["forward"], r
            assert r["backward_ratio"] <= report["goals"]["backward"], r
            assert r["memory_ratio"] <= report["goals"]["memory"], r


def test_runner_reports_every_ratio_and_the_exact_conv_halo_on_2_ranks(tmp_path):
    # Two families on a tiny field (1 x 2 x 16 x 8, H split 8 + 8), no models: bytes and bounds are
    # exact at any size; memory needs the full size and is only checked for presence here.
    report_file, plots = tmp_path / "report.json", tmp_path / "plots"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "run.py"),
            "--families",
            "convolution,pointwise",
            "--ranks",
            "2",
            "--size",
            "1x2x16x8",
            "--models",
            "none",
            "--json",
            str(report_file),
            "--plot",
            str(plots),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "[2/2] 2 ranks: pointwise done" in result.stderr  # progress on stderr (one line per task off a tty)
    report = json.loads(report_file.read_text())
    assert report["schema"] == 1 and report["config"]["size"] == [1, 2, 16, 8] and report["config"]["ranks"] == [2]
    assert set(report["goals"]) == {
        "bytes",
        "bytes_exchange",
        "fallback_at_4_ranks",
        "memory_slack",
        "model_memory_slack",
        "wrapper",
    }
    # a small field: the memory goal is 1/N + 25% (1/N + 10% only at the large size), stated in the header
    assert report["config"]["size_class"] == "small" and report["goals"]["memory_slack"] == 0.25
    assert "| goal 1/N+25% |" in result.stdout and report["wrapper"] is None  # --models none: no wrapper case
    cases = {c["family"]: c for c in report["families"]}
    assert set(cases) == {"convolution", "pointwise"} and report["models"] == []
    for case in cases.values():
        assert case["ranks"] == 2 and case["status"] == "ok", case
        for phase in ("forward", "backward"):
            assert len(case[phase]["bytes"]) == len(case[phase]["bound"]) == 2
            assert isinstance(case[phase]["ratio"], float), case  # bytes / bound is a number
        assert isinstance(case["fallback"]["ratio"], float) and case["fallback"]["status"] == "ok", case
        assert set(case["goals"]) == {"bytes", "fallback", "memory"}
        assert case["goals"]["fallback"] is None  # the 5x goal is stated at 4 ranks
        assert len(case["memory"]["peak_mib"]) == 2 and case["memory"]["goal"] == pytest.approx(0.75)
        assert case["max_error"] < 1e-5  # output and every gradient match single-process
    # The analytic halo of Conv2d(2, 2, 3, stride=2, padding=1) on H = 16 split 8 + 8: output row o reads
    # input rows 2o-1..2o+1; rank 1's first output row (4) reads rows 7, 8, 9, so one row (7) crosses from
    # rank 0, and rank 0's rows 0-3 read nothing of rank 1. Backward: that row's gradient goes back, and
    # every rank all-reduces the weight and bias gradients.
    row = 2 * 8 * 4  # C x W x float32
    weights = (2 * 2 * 3 * 3 + 2) * 4
    conv = cases["convolution"]
    assert conv["forward"]["bound"] == [row, 0] and conv["forward"]["bytes"] == [row, 0]
    assert (
        conv["backward"]["bound"] == [weights, row + weights] and conv["backward"]["bytes"] == conv["backward"]["bound"]
    )
    assert conv["forward"]["ratio"] == conv["backward"]["ratio"] == 1.0 and conv["goals"]["bytes"] is True
    pointwise = cases["pointwise"]
    assert pointwise["forward"]["bytes"] == pointwise["backward"]["bytes"] == [0, 0]
    assert pointwise["forward"]["ratio"] == 1.0  # 0 bytes against a bound of 0
    assert "| convolution | Conv2d(2, 2, 3, stride=2, padding=1) | 2 | 1.000 | 1.000 |" in result.stdout
    assert sorted(p.name for p in plots.iterdir()) == ["family-bytes.svg", "family-memory.svg"]
    assert all(p.read_text().lstrip().startswith("<?xml") for p in plots.iterdir())


def test_pytest_startup_benchmark_compares_with_and_without_the_plugin(tmp_path):
    report_file = tmp_path / "startup.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "pytest_startup.py"), "--repeats", "1", "--json", str(report_file)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert set(report["results"]) == {"with plugin", "-p no:shardext"}
    assert report["goals"] == {"seconds": 0.3, "mib": 20.0}
    for name, row in report["results"].items():
        assert len(row["seconds"]) == len(row["peak_mib"]) == 1 and row["median_mib"] > 0
        assert f"| {name} | {row['median_s']:.2f} | {row['median_mib']:.1f} |" in result.stdout
    assert re.search(r"^goal \(at most \+0\.3 s and \+20 MiB\): (met|not met)$", result.stdout, re.M)
    # Not a timing test; memory is steady, though: torch alone would add hundreds of MiB.
    assert report["overhead"]["mib"] <= 20, report


def test_runner_size_presets_and_goals():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import report as runner_report
        import run
    finally:
        sys.path.remove(str(BENCHMARKS))
    small, large = run.parse_args([]), run.parse_args(["--size", "large"])
    assert small.size == [1, 16, 256, 256] and small.model_res == 256 and small.wrapper == "fno"
    assert large.size == [1, 16, 1024, 1024] and large.model_res == 1024
    assert run.parse_args(["--size", "large3d", "--models", "none"]).size == [1, 16, 128, 128, 128]
    assert run.parse_args(["--models", "none"]).wrapper == "none"
    assert runner_report.memory_slack(large.size) == 0.10 and runner_report.memory_slack(small.size) == 0.25
    assert runner_report.memory_slack([1, 16, 128, 128, 128]) == 0.10
    assert runner_report.model_memory_slack(1024) == 0.10 and runner_report.model_memory_slack(256) == 0.25
    assert "songunet" in run.MODELS


def test_largest_field_quick_mode_gives_a_sane_table(tmp_path):
    # fno at 1 and 2 ranks, budgets 6 and 12 MiB, sides 32 and 64 only: every trial a fresh world
    report_file, plot = tmp_path / "lf.json", tmp_path / "lf"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "largest_field.py"),
            "--quick",
            "--json",
            str(report_file),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(report_file.read_text())
    rows = {(r["budget_mib"], r["ranks"]): r for r in report["results"]}
    assert set(rows) == {(6.0, 1), (6.0, 2), (12.0, 1), (12.0, 2)}
    for (budget, ranks), r in rows.items():
        ours = r["shardext"]
        assert ours["side"] is not None and ours["side"] % 32 == 0 and ours["peak_mib"] <= budget, r
        assert r["ideal"] == pytest.approx(rows[(budget, 1)]["shardext"]["side"] * ranks**0.5)
        assert f"| fno | {budget:g} MiB | {ranks} |" in result.stdout
        if ranks == 1:  # both variants are the plain model at 1 rank
            assert r["physicsnemo"] == ours
        else:  # PhysicsNeMo alone: a side, or why not
            assert r["physicsnemo"]["side"] is not None or r["physicsnemo"]["status"].startswith("fails: ")
    for ranks in (1, 2):  # a larger budget never gives a smaller field
        assert rows[(12.0, ranks)]["shardext"]["side"] >= rows[(6.0, ranks)]["shardext"]["side"]
    for budget in (6.0, 12.0):  # sharding never makes the largest field smaller
        assert rows[(budget, 2)]["shardext"]["side"] >= rows[(budget, 1)]["shardext"]["side"]
    for t in report["trials"]:  # every trial's peak grows with the side (same model, ranks, variant)
        assert t["status"] == "ok" or t["status"].startswith("fails: ")
    assert (tmp_path / "lf.svg").read_text().lstrip().startswith("<?xml")


def test_halo_overlap_benchmark_times_both_variants_forward_and_backward_on_2_ranks():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "halo_overlap.py"), "--ranks", "2", "--size", "1x2x32x8", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (\d) \| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", result.stdout, re.M)
    assert [r[:2] for r in rows] == [(rank, p) for rank in "01" for p in ("forward", "backward")], result.stdout
    assert all(float(v) > 0 for r in rows for v in r[2:]), result.stdout


def test_reshard_benchmark_counts_and_times_both_methods_on_2_ranks():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "reshard.py"), "--ranks", "2", "--size", "1x2x16x8", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(
        r"^\| (S\(H\)->S\(W\) \w+|S\(H\)->R \w+|R->S\(W\)) \| (\d) \| (.+?) \| (\d), (.+?) \| (\d), (.+?) \|",
        result.stdout,
        re.M,
    )
    assert {(r[0], r[1]) for r in rows} == {
        (m, k) for m in ("S(H)->S(W) uneven", "S(H)->S(W) even", "S(H)->R uneven", "R->S(W)") for k in "01"
    }, result.stdout
    for move, _, bound, calls, ours, their_calls, theirs in rows:
        assert ours == bound, (move, ours, bound)  # at the analytic bound
        if move.startswith("S(H)->S(W)"):  # one all-to-all of half of what PhysicsNeMo's sends
            assert calls == their_calls == "1" and ours != theirs, (move, ours, theirs)


def test_scaling_projection_has_every_gpu_count_and_efficiency_never_rises(tmp_path):
    # The checked-in measurement and H100 times: no ranks started; the table and the figure.
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "scaling_projection.py"), "--plot", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "PROJECTION, not a measurement" in out
    header = re.search(r"^\| model \| field \| fabric \| (.*) \|$", out, re.M)
    assert header is not None and header.group(1).split(" | ") == ["1", "2", "4", "8", "16", "32", "64"], out
    rows = re.findall(
        r"^\| (FNO|Pix2Pix|UNet 3-D|ViT) \| ([^|]+) \| (NVLink \(IB beyond 8\)|IB only) \| (.*) \|$", out, re.M
    )
    assert len(rows) == 4 * 2 * 2, out  # 4 models x 2 fields x 2 fabrics
    for model, field, fabric, cells in rows:
        efficiency = [float(c.rstrip("†")) for c in cells.split(" | ")]
        assert len(efficiency) == 7 and efficiency[0] == 1.0, (model, field, fabric, cells)
        assert all(0 <= e <= 1 for e in efficiency), (model, field, fabric, cells)
        # E(N) = T(1) / (N T(N)): host time and communication never shrink with N, so E never rises
        assert all(a >= b for a, b in zip(efficiency, efficiency[1:])), (model, field, fabric, cells)
    # the fitted laws reproduce every measured point within 5% (bytes) and exactly (calls)
    laws = re.findall(r"^\| [^|]+ \| \w+ \| [^|]+ \| [^|]+ \| \d+ \| ([\d.]+)% \| ([\d.]+)% \|$", out, re.M)
    assert len(laws) == 8 and all(float(b) < 5 and float(c) < 0.5 for b, c in laws), out
    detail = re.findall(r"^\| (\d+)†? \| [\d.]+ \| [\d.]+ \|", out.split("FNO 2048^2 (ms per training step")[1], re.M)
    assert [int(n) for n in detail[:7]] == [1, 2, 4, 8, 16, 32, 64]
    assert "PROJECTION" in (tmp_path / "scaling-projection.svg").read_text()


def test_scaling_projection_measures_collectives_and_ops_on_2_ranks(tmp_path):
    # FNO at 32x32 on 2 gloo ranks: every rank hands bytes to the spectral all-to-alls and to the
    # weight-gradient all-reduces, and the step's ShardTensor ops are counted.
    report = tmp_path / "proj.json"
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "scaling_projection.py"),
            "--measure",
            "--models",
            "fno",
            "--res",
            "32",
            "--ranks",
            "2",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    measured = json.loads(report.read_text())
    (run,) = measured["runs"]
    assert run["model"] == "fno" and run["ranks"] == 2 and run["input_shape"] == [1, 3, 32, 32]
    assert len(run["per_rank"]) == 2
    for rank in run["per_rank"]:
        assert rank["ops"]["forward"]["function"] > 10, rank["ops"]  # one per sharded op of the forward
        moved = {k: rank["forward"].get(k, [0, 0])[1] + rank["backward"].get(k, [0, 0])[1] for k in rank["backward"]}
        assert moved["alltoall_base_"] > 0 and moved["allreduce_"] > 0, rank
    assert "| FNO | alltoall_base_ |" in result.stdout and "| FNO | 2048^2 | IB only | 1.00 |" in result.stdout
