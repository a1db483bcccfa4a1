"""A per-rank deadline for multirank tests run inline under ``torchrun``.

Under plain ``pytest`` the worker pool enforces timeouts from outside. Under
``torchrun`` every rank *is* a pytest process, and a rank stuck in a collective
would hang the job forever. `rank_watchdog` gives each test body a
deadline: when it passes, the rank prints which test timed out and the Python
stacks of all its threads, then exits, so torchrun tears the job down and the
log holds one report per rank.

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
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

__all__ = ["TIMEOUT_EXIT_CODE", "rank_watchdog"]

TIMEOUT_EXIT_CODE = 124
"""Exit status of a rank whose test outlived its timeout (as coreutils' ``timeout``)."""

# If a C call never releases the GIL the Python timer cannot run; faulthandler's
# own C-level watchdog then dumps the stacks and exits this much later.
_BACKSTOP_S = 30.0


def _all_stacks() -> str:
    """The Python stacks of every thread of this process, innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watchdog's own thread
        parts.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


@contextlib.contextmanager
def rank_watchdog(
    timeout_s: float, label: str, rank: int, before_report: Callable[[], None] | None = None
) -> Iterator[None]:
    """Exit this process with a stack report if the block runs longer than ``timeout_s``.

    ``before_report`` runs first when the deadline passes; pytest's plugin uses it
    to suspend output capturing, so the report reaches the real stderr.
    """

    def expire() -> None:
        if before_report is not None:
            with contextlib.suppress(Exception):
                before_report()
        report = (
            f"\n[shardext] rank {rank}: {label} exceeded its {timeout_s:g} s timeout; "
            f"Python stacks of rank {rank} follow, then exit {TIMEOUT_EXIT_CODE}\n{_all_stacks()}"
        )
        # One write: torchrun may kill this rank as soon as a peer exits, so the
        # report must not be spread over many small writes.
        with contextlib.suppress(OSError):
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), report.encode(errors="replace"))
        os._exit(TIMEOUT_EXIT_CODE)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(timeout_s + _BACKSTOP_S, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
