"""Tests of physicsnemo_shardext.ranks.watchdog: a hang under torchrun ends with per-rank reports."""

import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from physicsnemo_shardext.ranks.watchdog import BACKSTOP_S, TIMEOUT_EXIT_CODE, rank_watchdog

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
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_inner_hang.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        check=False,
    )
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert elapsed < 180, f"took {elapsed:.0f} s"
    assert "exceeded its 6 s timeout" in output
    reporting = {r for r in (0, 1) if f"rank {r}: test_inner_hang.py::test_rank_one_hangs exceeded" in output}
    assert reporting == {0, 1}, output[-3000:]  # each rank waits for the others to report before it exits
    assert 'test_inner_hang.py", line' in output  # the stacks show where the rank was stuck
    assert "in test_rank_one_hangs" in output
    # rank 0 waits in the barrier rank 1 never reaches
    assert "pending collective: barrier() over a process group of 2 ranks, issued at" in output
    assert f"exitcode  : {TIMEOUT_EXIT_CODE}" in output  # torchrun's summary of the ended ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def one_rank_launch(monkeypatch):
    """The environment torchrun gives a job of 1 rank (so the plugin runs bodies inline, under the watchdog)."""
    for name, value in {
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(name, value)


GIL_HELD = """
import ctypes
import pytest

@pytest.mark.multirank(1, timeout=1)
def test_holds_the_gil(rank):
    ctypes.PyDLL(None).sleep(60)   # no Python thread can run: only faulthandler's C watchdog can report
"""


def test_a_rank_holding_the_gil_still_reports_on_the_real_stderr(pytester, one_rank_launch):
    # pytest captures fd 2 during the test; the backstop used to dump into that capture, which
    # is lost when the process exits: the rank ended without a word.
    pytester.makepyfile(test_inner_gil=GIL_HELD)
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    assert time.monotonic() - start < 60
    assert result.ret != 0
    err = result.stderr.str()
    assert "Timeout (0:00:0" in err, err[-2000:]
    assert "in test_holds_the_gil" in err
    assert BACKSTOP_S < 10


TERMINATED = """
import os, signal, time
import pytest

@pytest.mark.multirank(1, timeout=60)
def test_terminated_by_the_launcher(rank):
    os.kill(os.getpid(), signal.SIGTERM)   # as torchrun does to the other ranks when one exits
    time.sleep(30)
"""


def test_a_rank_terminated_by_torchrun_leaves_its_stacks(pytester, one_rank_launch):
    pytester.makepyfile(test_inner_term=TERMINATED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    assert result.ret == -signal.SIGTERM  # the default action still ends the process
    err = result.stderr.str()
    assert "(most recent call first)" in err and "in test_terminated_by_the_launcher" in err, err[-2000:]
