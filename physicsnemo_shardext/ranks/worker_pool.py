"""The parent side: a pool of N rank processes, reused across tests, torn down after any failure.

The pool runs one `RankTask` at a
time on all ranks and waits with a timeout. Ranks that fail or die start a
short *grace* period for the others (which are usually stuck in a collective
with the failed rank); ranks still silent at the deadline are reported as hung,
and the whole pool is killed so the next test starts from a fresh process group.

A hung rank's report comes from the rank's reporter thread, asked over a second
pipe: the collective it waits in (op, tensors, group size, issuing source line)
and every thread's Python stack, innermost call last. A rank that does not
answer within `REPORT_WAIT_S` (a C call holds its GIL) is sent
`STACK_DUMP_SIGNAL` instead, and its ``faulthandler`` dump is shown in the
same order.

Examples:
    ```python
    pool = WorkerPool(world_size=2)
    outcome = pool.run(task, timeout_s=60)
    if not outcome.ok:
        print(outcome.report())
    pool.close()
    ```

    What an outcome says when one rank failed:

    >>> from physicsnemo_shardext.ranks.worker import RankResult
    >>> outcome = PoolOutcome(2, results={0: RankResult(0, "passed"), 1: RankResult(1, "failed", "boom")})
    >>> outcome.ok, outcome.summary()
    (False, 'failed on rank(s) [1]')
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from physicsnemo_shardext.ranks.hang_report import reformat_faulthandler
from physicsnemo_shardext.ranks.worker import STACK_DUMP_SIGNAL, RankResult, RankTask, WorkerConfig, worker_main

__all__ = ["REPORT_WAIT_S", "PoolOutcome", "PoolStartupError", "WorkerPool"]

_OUTPUT_TAIL_CHARS = 4000

#: How long a hung rank's reporter thread may take to answer before faulthandler is used.
REPORT_WAIT_S = 3.0
#: How long a faulthandler dump may take to appear in a rank's log.
_DUMP_WAIT_S = 5.0


class PoolStartupError(RuntimeError):
    """The rank processes could not start or join the process group."""


@dataclass
class PoolOutcome:
    """What happened on every rank for one task."""

    world_size: int
    results: dict[int, RankResult] = field(default_factory=dict)
    hung: dict[int, str] = field(default_factory=dict)  # rank -> stack dump
    dead: dict[int, int | None] = field(default_factory=dict)  # rank -> exit code
    output: dict[int, str] = field(default_factory=dict)  # rank -> captured output of this task
    timeout_s: float = 0.0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """All ranks finished and none failed."""
        return not self.hung and not self.dead and all(r.outcome != "failed" for r in self.results.values())

    @property
    def skipped(self) -> str | None:
        """The skip reason when every rank finished and at least one skipped, none failed."""
        if not self.ok:
            return None
        reasons = [r.message for r in self.results.values() if r.outcome == "skipped"]
        return reasons[0] if reasons else None

    def summary(self) -> str:
        """One line: which ranks failed, hung, died."""
        parts = []
        failed = sorted(r for r, res in self.results.items() if res.outcome == "failed")
        if failed:
            parts.append(f"failed on rank(s) {failed}")
        if self.hung:
            parts.append(f"rank(s) {sorted(self.hung)} hung (no result within {self.timeout_s:g} s)")
        if self.dead:
            parts.append(f"rank(s) {sorted(self.dead)} died")
        return "; ".join(parts) or "passed"

    def report(self) -> str:
        """The per-rank report used as the pytest failure message."""
        lines = [f"multirank({self.world_size}) test {self.summary()} [{self.wall_s:.1f} s]"]
        for rank in range(self.world_size):
            if rank in self.results:
                result = self.results[rank]
                lines.append(f"rank {rank}: {result.outcome} ({result.duration_s:.2f} s)")
                if result.outcome != "passed" and result.message:
                    lines.append(_indent(result.message))
            elif rank in self.dead:
                lines.append(f"rank {rank}: DIED with exit code {self.dead[rank]}")
            elif rank in self.hung:
                lines.append(f"rank {rank}: HUNG, Python stacks at the timeout:")
                lines.append(_indent(self.hung[rank] or "(no stack dump captured)"))
            else:
                lines.append(f"rank {rank}: unknown")
            output = self.output.get(rank, "").strip()
            if output and (rank not in self.results or self.results[rank].outcome != "passed"):
                lines.append(f"  rank {rank} output (tail):")
                lines.append(_indent(output[-_OUTPUT_TAIL_CHARS:], "    | "))
        return "\n".join(lines)


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


@contextlib.contextmanager
def _inherited_output(log_path: Path) -> Iterator[None]:
    """Let a child inherit ``log_path`` as stdout/stderr, so import-time chatter goes to its log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@dataclass
class _Rank:
    process: Any
    conn: Any
    log_path: Path
    control: Any = None  # the pipe on which the rank's reporter thread answers hang-report requests


class WorkerPool:
    """N spawned rank processes sharing one process group, reused across tasks.

    Args:
        world_size: number of ranks.
        startup_timeout_s: how long spawning + importing + joining may take.
        grace_s: after one rank failed or died, how long the others may still take.
    """

    def __init__(self, world_size: int, *, startup_timeout_s: float = 300.0, grace_s: float = 10.0) -> None:
        self.world_size = world_size
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.generation = 0  # how many times the pool was started
        self._ranks: list[_Rank] = []
        self._tmpdir: Path | None = None

    # -- lifecycle -------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether the ranks are up (started and not torn down)."""
        return bool(self._ranks)

    def pids(self) -> list[int]:
        """Process ids of the current ranks."""
        return [r.process.pid for r in self._ranks]

    def start(self) -> None:
        """Spawn the ranks and wait until all joined the process group."""
        if self.alive:
            return
        self.generation += 1
        self._tmpdir = Path(tempfile.mkdtemp(prefix=f"shardext-pool{self.world_size}-"))
        store_path = str(self._tmpdir / "store")
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            parent_conn, child_conn = context.Pipe(duplex=True)
            parent_control, child_control = context.Pipe(duplex=True)
            log_path = self._tmpdir / f"rank{rank}.log"
            log_path.touch()
            config = WorkerConfig(rank, self.world_size, store_path, str(log_path), os.getpid(), tuple(sys.path))
            process = context.Process(
                target=worker_main,
                args=(config, child_conn, child_control),
                name=f"shardext-rank{rank}",
                daemon=True,
            )
            with _inherited_output(log_path):
                process.start()
            child_conn.close()
            child_control.close()
            self._ranks.append(_Rank(process, parent_conn, log_path, parent_control))
        self._await_ready()

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = set(range(self.world_size))
        errors: list[str] = []
        while pending and time.monotonic() < deadline:
            waitables = {self._ranks[r].conn: r for r in pending}
            waitables.update({self._ranks[r].process.sentinel: r for r in pending})
            for ready in multiprocessing.connection.wait(list(waitables), timeout=deadline - time.monotonic()):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                conn = self._ranks[rank].conn
                if ready is conn or conn.poll():
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        message = ("error", rank, "connection closed during startup")
                    if message[0] != "ready":
                        errors.append(f"rank {rank}: {message[2]}")
                else:
                    errors.append(f"rank {rank}: died during startup (exit code {self._ranks[rank].process.exitcode})")
                pending.discard(rank)
        if errors or pending:
            logs = {r: self._read_log(r, 0)[-_OUTPUT_TAIL_CHARS:] for r in range(self.world_size)}
            self.kill()
            detail = "\n".join(errors + [f"rank {r}: not ready after {self.startup_timeout_s:g} s" for r in pending])
            detail += "".join(f"\nrank {r} log:\n{_indent(text)}" for r, text in logs.items() if text.strip())
            raise PoolStartupError(f"could not start {self.world_size} rank processes:\n{detail}")

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the ranks to leave the process group and exit; kill whoever does not."""
        for rank in self._ranks:
            try:
                rank.conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + timeout_s
        for rank in self._ranks:
            rank.process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate every rank now (SIGTERM, then SIGKILL), reap them and drop the pool."""
        for rank in self._ranks:
            if rank.process.is_alive():
                rank.process.terminate()
        for rank in self._ranks:
            rank.process.join(2.0)
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(5.0)
            rank.conn.close()
            if rank.control is not None:
                rank.control.close()
        self._ranks = []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- running ---------------------------------------------------------------------
    def _read_log(self, rank: int, offset: int) -> str:
        try:
            with open(self._ranks[rank].log_path, "rb") as handle:
                handle.seek(offset)
                return handle.read().decode("utf-8", "replace")
        except (OSError, IndexError):
            return ""

    def run(self, task: RankTask, timeout_s: float) -> PoolOutcome:
        """Run ``task`` on all ranks; on any failure, hang or death the pool is torn down."""
        self.start()
        started = time.monotonic()
        outcome = PoolOutcome(self.world_size, timeout_s=timeout_s)
        offsets = [r.log_path.stat().st_size for r in self._ranks]
        for rank, handle in enumerate(self._ranks):
            try:
                handle.conn.send(("run", task))
            except (OSError, BrokenPipeError):
                outcome.dead[rank] = handle.process.exitcode
        deadline = started + timeout_s
        first_trouble: float | None = time.monotonic() if outcome.dead else None
        pending = set(range(self.world_size)) - set(outcome.dead)
        while pending:
            until = deadline if first_trouble is None else min(deadline, first_trouble + self.grace_s)
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            waitables = {self._ranks[r].conn: r for r in pending}
            waitables.update({self._ranks[r].process.sentinel: r for r in pending})
            for ready in multiprocessing.connection.wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                result = self._receive(rank)
                if result is not None:
                    outcome.results[rank] = result
                    trouble = result.outcome == "failed"
                else:
                    self._ranks[rank].process.join(1.0)
                    outcome.dead[rank] = self._ranks[rank].process.exitcode
                    trouble = True
                pending.discard(rank)
                if trouble and first_trouble is None:
                    first_trouble = time.monotonic()
        for rank in pending:
            outcome.hung[rank] = ""
        outcome.output = {r: self._read_log(r, offsets[r]) for r in range(self.world_size)}
        if outcome.hung:
            self._dump_stacks(outcome)
        outcome.wall_s = time.monotonic() - started
        if not outcome.ok:
            # A failed collective can leave the process group inconsistent: start afresh next time.
            self.kill()
        return outcome

    def _receive(self, rank: int) -> RankResult | None:
        conn = self._ranks[rank].conn
        try:
            if conn.poll():
                message = conn.recv()
                if message[0] == "result":
                    return message[1]
        except (EOFError, OSError):
            pass
        return None

    def _dump_stacks(self, outcome: PoolOutcome) -> None:
        """Fill ``outcome.hung`` with each hung rank's report (its reporter thread, else faulthandler)."""
        answers = self._ask_reporters(sorted(outcome.hung))
        silent = [rank for rank in outcome.hung if not answers.get(rank)]
        dumps = self._faulthandler_dumps(silent)
        for rank in outcome.hung:
            if answers.get(rank):
                outcome.hung[rank] = answers[rank].strip()
            elif dumps.get(rank):
                outcome.hung[rank] = (
                    f"(no answer from the rank's reporter thread within {REPORT_WAIT_S:g} s: a C call holds "
                    "its GIL; pending collective unknown; faulthandler's dump follows)\n" + dumps[rank]
                )
            else:
                outcome.hung[rank] = (
                    f"(no answer from the rank's reporter thread within {REPORT_WAIT_S:g} s and no "
                    f"faulthandler output within {_DUMP_WAIT_S:g} s after signal {STACK_DUMP_SIGNAL!s}: "
                    "the process may be stopped, or a library replaced the signal's handler)"
                )

    def _ask_reporters(self, ranks: list[int]) -> dict[int, str]:
        asked: dict[Any, int] = {}
        for rank in ranks:
            control = self._ranks[rank].control
            try:
                control.send(("report",))
                asked[control] = rank
            except (OSError, AttributeError, ValueError):
                pass
        answers: dict[int, str] = {}
        deadline = time.monotonic() + REPORT_WAIT_S
        while asked and (remaining := deadline - time.monotonic()) > 0:
            for ready in multiprocessing.connection.wait(list(asked), timeout=remaining):
                rank = asked.pop(ready)
                try:
                    answers[rank] = str(ready.recv())
                except (EOFError, OSError):
                    pass
        return answers

    def _faulthandler_dumps(self, ranks: list[int]) -> dict[int, str]:
        if STACK_DUMP_SIGNAL is None or not ranks:
            return {}
        sizes = {}
        for rank in ranks:
            sizes[rank] = self._ranks[rank].log_path.stat().st_size
            try:
                os.kill(self._ranks[rank].process.pid, STACK_DUMP_SIGNAL)
            except OSError:
                pass
        # faulthandler writes from a signal handler: wait until every log grew and then stayed put.
        deadline = time.monotonic() + _DUMP_WAIT_S
        last: dict[int, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = {rank: self._ranks[rank].log_path.stat().st_size for rank in ranks}
            if all(now[r] > sizes[r] for r in ranks) and now == last:
                break
            last = now
        return {rank: reformat_faulthandler(self._read_log(rank, size)) for rank, size in sizes.items()}
