"""Tests of physicsnemo_shardext.testing.watchdog: a hang under torchrun ends with per-rank reports."""

import subprocess
import sys
import textwrap
import time

from physicsnemo_shardext.testing.watchdog import TIMEOUT_EXIT_CODE, rank_watchdog

HANGING_TEST = """
import time
import pytest
import torch.distributed as dist

@pytest.mark.multirank(2, timeout=6)
def test_rank_one_hangs(rank):
    if rank == 1:
        time.sleep(600)       # never reaches the barrier
    dist.barrier()            # rank 0 waits here for ever

@pytest.mark.multirank(2)
def test_never_reached(rank):
    pass
"""


def test_watchdog_is_silent_when_the_body_is_quick():
    with rank_watchdog(5.0, "quick", rank=0):
        pass
    time.sleep(0.1)  # the cancelled timer must not fire later


def test_hang_under_torchrun_ends_with_a_report_from_every_rank(tmp_path):
    (tmp_path / "test_inner_hang.py").write_text(textwrap.dedent(HANGING_TEST))
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_inner_hang.py")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False,
    )
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert elapsed < 180, f"took {elapsed:.0f} s"
    assert "exceeded its 6 s timeout" in output
    reporting = {r for r in (0, 1) if f"rank {r}: test_inner_hang.py::test_rank_one_hangs exceeded" in output}
    assert reporting, output[-3000:]
    assert 'test_inner_hang.py", line' in output  # the stacks show where the rank was stuck
    assert "in test_rank_one_hangs" in output
    assert f"exitcode  : {TIMEOUT_EXIT_CODE}" in output  # torchrun's summary of the ended ranks
