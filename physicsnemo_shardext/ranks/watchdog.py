"""A per-rank deadline for multirank tests run inline under ``torchrun``.

Under plain ``pytest`` the worker pool enforces timeouts from outside. Under
``torchrun`` every rank *is* a pytest process, and a rank stuck in a collective
would hang the job forever. `rank_watchdog` gives each test body a
deadline: when it passes, the rank prints which test timed out, the collective
it waits in and the Python stacks of all its threads (innermost call last), then
exits, so torchrun tears the job down and the log holds one report per rank.

Three paths make sure a report gets out:

* a Python timer thread writes the full report (`hang_report`), waits
  `PEER_REPORT_S` so that the other ranks' timers can fire too, and exits with
  `TIMEOUT_EXIT_CODE`;
* when a C call holds the GIL the timer cannot run: ``faulthandler``'s own C
  watchdog dumps the stacks (innermost call *first*, no pending collective)
  `BACKSTOP_S` later and exits;
* a rank that torchrun terminates (SIGTERM, because a peer exited first) dumps
  its stacks the same way on its way out.

All of them write to ``report_fd``: pytest captures file descriptor 2 during a
test, so the pytest plugin passes a duplicate of the real stderr it took before.

Examples:
    A block that ends before its deadline leaves no trace:

    >>> with rank_watchdog(60.0, "tests/test_x.py::test_y", rank=1):
    ...     total = sum(range(10))
    >>> total
    45
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from physicsnemo_shardext.ranks.hang_report import hang_report, tracking_collectives

__all__ = ["BACKSTOP_S", "PEER_REPORT_S", "TIMEOUT_EXIT_CODE", "rank_watchdog"]

TIMEOUT_EXIT_CODE = 124
"""Exit status of a rank whose test outlived its timeout (as coreutils' ``timeout``)."""

#: Seconds after the deadline at which faulthandler's C-level watchdog dumps and exits,
#: for a rank whose Python timer could not run (a C call holding the GIL).
BACKSTOP_S = 5.0

#: Seconds a rank waits after writing its report before it exits: torchrun terminates
#: the other ranks as soon as one exits, and their timers fire at about the same time.
PEER_REPORT_S = 2.0

_TERMINATION_SIGNAL = getattr(signal, "SIGTERM", None) if hasattr(faulthandler, "register") else None


def _default_fd() -> int:
    stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    return stream.fileno()


@contextlib.contextmanager
def rank_watchdog(
    timeout_s: float,
    label: str,
    rank: int,
    before_report: Callable[[], None] | None = None,
    report_fd: int | None = None,
) -> Iterator[None]:
    """Exit this process with a hang report if the block runs longer than ``timeout_s``.

    Args:
        timeout_s: the deadline, in seconds from entering the block.
        label: what timed out (the test id), for the report's first line.
        rank: this process's rank, for the report's first line.
        before_report: run first when the deadline passes (for instance to suspend
            output capturing).
        report_fd: where the reports go; default: the interpreter's original stderr.
    """
    fd = report_fd if report_fd is not None else _default_fd()

    def expire() -> None:
        if before_report is not None:
            with contextlib.suppress(Exception):
                before_report()
        report = (
            f"\n[shardext] rank {rank}: {label} exceeded its {timeout_s:g} s timeout; "
            f"pending collective and Python stacks of rank {rank} follow, then exit {TIMEOUT_EXIT_CODE}\n"
            f"{hang_report()}\n[shardext] rank {rank}: end of report\n"
        )
        # One write: torchrun may kill this rank as soon as a peer exits, so the
        # report must not be spread over many small writes.
        with contextlib.suppress(OSError):
            sys.stderr.flush()
            os.write(fd, report.encode(errors="replace"))
        time.sleep(PEER_REPORT_S)
        os._exit(TIMEOUT_EXIT_CODE)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    with tracking_collectives():
        timer.start()
        faulthandler.dump_traceback_later(timeout_s + BACKSTOP_S, exit=True, file=fd)
        if _TERMINATION_SIGNAL is not None:
            faulthandler.register(_TERMINATION_SIGNAL, file=fd, all_threads=True, chain=True)
        try:
            yield
        finally:
            timer.cancel()
            faulthandler.cancel_dump_traceback_later()
            if _TERMINATION_SIGNAL is not None:
                faulthandler.unregister(_TERMINATION_SIGNAL)
