"""Smoke test of benchmarks/spectral_layer.py: it runs end to end and prints both variants (not a timing test)."""

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_spectral_layer_benchmark_prints_both_variants_on_2_ranks():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "spectral_layer.py"), "--nproc", "2", "--channels", "2", "--height", "16",
         "--width", "12", "--modes", "3", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "1x2x16x12 sharded over H, 2 ranks (cpu, gloo)" in result.stdout
    rows = {(m.group(1), int(m.group(2))): m.group(0) for m in re.finditer(r"^\| (patched|fallback) \| (\d) \|.*$", result.stdout, re.M)}
    assert set(rows) == {("patched", 0), ("patched", 1), ("fallback", 0), ("fallback", 1)}, result.stdout
    for rank in (0, 1):
        cells = [c.strip() for c in rows[("patched", rank)].strip("|").split("|")]
        assert cells[-1] == "ok", rows[("patched", rank)]  # the patched layer runs forward and backward
        assert float(cells[-2]) < 1e-4  # and matches the single-process layer
        fallback = [c.strip() for c in rows[("fallback", rank)].strip("|").split("|")]
        assert int(fallback[3]) >= 1  # the fallback's own collectives are counted, not hidden in DTensor
