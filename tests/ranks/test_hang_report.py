"""Hang reports: the pending collective and every thread's stack, from a hung pool rank and in-process."""

from __future__ import annotations

import faulthandler
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from physicsnemo_shardext.ranks import hang_report as hr


class _Group:
    """Stands for a ProcessGroup of 2 ranks."""

    def size(self) -> int:
        return 2


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def _waiting_in_fake_all_reduce(release: threading.Event, entered: threading.Event) -> None:
    def blocking_all_reduce(tensor, group=None):
        entered.set()
        release.wait(10)

    tracked = hr._wrap("all_reduce", blocking_all_reduce)
    tracked(torch.zeros(4, 3), group=_Group())  # the line the report must name


def test_a_call_in_flight_is_reported_with_its_thread_stack_and_cleared_on_return():
    release, entered = threading.Event(), threading.Event()
    worker = threading.Thread(target=_waiting_in_fake_all_reduce, args=(release, entered), name="rank-body")
    worker.start()
    try:
        assert entered.wait(10)
        report = hr.hang_report()
    finally:
        release.set()
        worker.join(10)
    first = report.splitlines()[0]
    assert first.startswith("pending collective: all_reduce(float32[4, 3]) over a process group of 2 ranks")
    assert f"issued at {__file__}:" in first and "in _waiting_in_fake_all_reduce" in first
    assert "(thread rank-body, waiting" in first
    assert "tracked(torch.zeros(4, 3), group=_Group())" in report  # the source line
    stack = report.split("Thread rank-body:")[1]
    # innermost call last: the body's frame comes before the collective's
    assert stack.index("in _waiting_in_fake_all_reduce") < stack.index("in blocking_all_reduce")
    assert hr.pending_collectives() == []


def test_asynchronous_calls_stay_listed_until_their_work_completes():
    work = _Work()
    tracked = hr._wrap("irecv", lambda tensor, src=None: work)
    hr.forget_asynchronous()
    assert tracked(torch.zeros(2, dtype=torch.int64), src=1) is work
    (pending,) = hr.pending_collectives()
    assert (
        pending.describe().startswith("irecv(int64[2], src=1)") and "asynchronous, not completed" in pending.describe()
    )
    work.done = True
    assert hr.pending_collectives() == []
    hr.forget_asynchronous()


def test_tracking_wraps_both_namespaces_and_restores_them():
    original = dist.all_reduce
    if getattr(original, "__shardext_tracked__", False):
        pytest.skip("collectives are already tracked in this process (a torchrun session)")
    with hr.tracking_collectives():
        with hr.tracking_collectives():  # nested: still one wrapper
            assert dist.all_reduce is c10d.all_reduce is not original
            assert dist.isend is c10d.isend  # torch compares P2POp.op with isend by identity
            assert getattr(dist.all_reduce, "__wrapped__", None) is original
        assert dist.all_reduce is not original
    assert dist.all_reduce is original and c10d.all_reduce is original


def test_faulthandler_dumps_are_shown_innermost_last(tmp_path):
    path = tmp_path / "dump.txt"

    def innermost_function() -> None:
        with open(path, "w") as handle:
            faulthandler.dump_traceback(file=handle, all_threads=False)

    innermost_function()
    text = hr.reformat_faulthandler(path.read_text())
    assert text.splitlines()[0].endswith("(most recent call last):")
    assert text.index("in test_faulthandler_dumps_are_shown_innermost_last") < text.index("in innermost_function")
    assert "faulthandler.dump_traceback(file=handle, all_threads=False)" in text  # source lines added


HANGING = """
import ctypes
import pytest, torch
import torch.distributed as dist

@pytest.mark.multirank(2, timeout=3)
def test_rank_one_waits_in_all_reduce(rank):
    if rank == 1:
        dist.all_reduce(torch.ones(5, 2, dtype=torch.float64))  # rank 0 never joins
"""


def test_a_rank_hung_in_all_reduce_reports_the_collective_and_its_stacks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_hang=HANGING)
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    elapsed = time.monotonic() - start
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "multirank(2) test rank(s) [[]1[]] hung (no result within 3 s)*",
            "rank 0: passed*",
            "rank 1: HUNG, Python stacks at the timeout:",
            "*pending collective: all_reduce(float64[[]5, 2[]]) over a process group of 2 ranks, issued at "
            "*test_inner_hang.py:8 in test_rank_one_waits_in_all_reduce (thread MainThread, waiting *",
            "*dist.all_reduce(torch.ones(5, 2, dtype=torch.float64))*",
            "*Python stacks of every thread (most recent call last):",
            "*Thread MainThread:",
        ]
    )
    rank1 = out.split("rank 1: HUNG")[1]
    main_thread = rank1.split("Thread MainThread:")[1]
    body = main_thread.index("in test_rank_one_waits_in_all_reduce")
    assert body < main_thread.index(", in all_reduce"), "innermost call last"
    assert re.search(r"Thread shardext-hang-reporter", rank1) is None  # the reporter leaves itself out
    assert elapsed < 60, f"took {elapsed:.0f} s"


GIL_HELD = """
import ctypes
import pytest

@pytest.mark.multirank(2, timeout=2)
def test_rank_one_holds_the_gil(rank):
    if rank == 1:
        ctypes.PyDLL(None).sleep(30)  # a C call that keeps the GIL: no Python thread can run
"""


def test_a_rank_holding_the_gil_falls_back_to_faulthandler(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner_gil=GIL_HELD)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank 1: HUNG, Python stacks at the timeout:",
            "*(no answer from the rank's reporter thread within * s: a C call holds its GIL*",
            "*Current thread 0x* (most recent call last):",
            "*test_inner_gil.py*, line 7, in test_rank_one_holds_the_gil",
            "*ctypes.PyDLL(None).sleep(30)*",
        ]
    )
