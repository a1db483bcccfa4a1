"""The torchrun example scripts run on CPU ranks and report a match with the single-process run."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(("ranks", "height", "expected_heights"), [(2, 33, "[17, 16]"), (3, 37, "[13, 13, 11]")])
def test_domain_parallel_example_matches_single_process(ranks, height, expected_heights):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(EXAMPLES / "domain_parallel_cpu.py"), "--height", str(height), "--steps", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"ranks {ranks} (cpu), shard heights {expected_heights}" in result.stdout
    assert "pointwise (physicsnemo-shardext)" in result.stdout  # plugins were loaded
    worst = float(re.search(r"worst difference (\S+) -> MATCH", result.stdout).group(1))
    assert worst < 1e-5


def test_minimal_example_from_getting_started():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "minimal_shardtensor.py")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "rank 0: local rows (5, 16), matches single-process" in result.stdout
    assert "rank 1: local rows (5, 16), matches single-process" in result.stdout


@pytest.mark.parametrize(
    ("options", "model", "heights", "plugins"),
    [([], "fno", "[17, 16]", {"fft", "indexing_einsum", "layout_ops"}),
     (["--model", "afno", "--height", "36"], "afno", "[20, 16]", {"fft", "indexing_einsum", "afno"})],
    ids=["fno", "afno"],
)
def test_fno_training_example_tracks_single_process(options, model, heights, plugins):
    """examples/fno_training_cpu.py trains PhysicsNeMo's FNO (defaults) or AFNO on 2 uneven ranks like one process."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "fno_training_cpu.py"), "--steps", "6", *options],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"{model}: ranks 2 (cpu), shard heights {heights}" in result.stdout
    loaded = re.search(r"plugins: (.*)", result.stdout).group(1).split(", ")
    assert plugins <= set(loaded)  # loaded, so the spectral ops are not on the fallback
    curves = re.findall(r"loss curve (?:sharded|single-process): +(.*)", result.stdout)
    assert len(curves) == 2 and len(curves[0].split()) == 6
    match = re.search(r"worst relative loss difference (\S+), max weight difference (\S+) -> TRACKS", result.stdout)
    assert match and float(match.group(1)) < 1e-4 and float(match.group(2)) < 1e-4


@pytest.mark.parametrize(
    ("ranks", "options", "header"),
    [(2, ["--model", "vit"], "vit: ranks 2 (cpu), ddp 1, domain split [16, 16]"),
     (4, ["--model", "lm", "--ddp", "2"], "lm: ranks 4 (cpu), ddp 2, domain split [50, 49]")],
    ids=["vit", "lm-ddp2"],
)
def test_transformer_example_verifies_and_trains(ranks, options, header):
    """examples/transformer_cpu.py (docs/transformers.md): the check against one process passes, then it trains."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(EXAMPLES / "transformer_cpu.py"), "--steps", "2", *options],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert header in result.stdout
    assert "training check ok" in result.stdout
    assert re.search(r"step 1: loss \d", result.stdout)
