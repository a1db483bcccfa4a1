"""What the benchmarks share: starting ranks, per-rank peak memory, counting collectives, formatting.

* **Ranks.** :func:`launch` is the one way a benchmark starts ranks. It runs
  ``body(args)`` on every rank: inline when the script was started by
  ``torchrun`` (``WORLD_SIZE`` is set), else on ``nproc`` processes of the
  package's own rank runner, ``physicsnemo_shardext.ranks.worker_pool.WorkerPool``
  (the multirank tests' and ``shardext verify``'s: gloo on CPU, NCCL with a GPU per
  rank, one thread each, like torchrun's ``OMP_NUM_THREADS=1``; a rank that
  hangs or dies is reported with every rank's stacks). Every ``launch`` starts a
  fresh pool and closes it after the one task: a world's measurements start in
  fresh processes (memory high-water marks, the heap, the plugins' caches), and
  a probe world that a gloo abort kills takes no later world with it. A body
  joins the pool's (or torchrun's) process group with :func:`initialize`, i.e.
  ``physicsnemo_shardext.initialize()``, and leaves it with
  ``physicsnemo_shardext.shutdown()``. What rank 0 prints reaches this process's
  standard output after the world finished (each rank's standard output goes to
  a file while the task runs; :func:`rank_environment`), the ranks' standard
  error its standard error; progress reaches it while the world runs, through
  a ``ProgressFeed`` (``physicsnemo_shardext.tools.progress``).
  (``dispatch_overhead.py`` starts no ranks: it times host-side Python on a
  one-rank mesh in its own process, with the process's own threads.)
* **Peak memory** (:func:`peak_memory`). On CPU torch keeps no allocator
  statistics and ``tracemalloc`` does not see tensors, so the kernel's
  resident-set high-water mark is used: ``VmHWM`` is reset to the current
  resident set (``/proc/self/clear_refs``) right before the block and the block's
  peak is ``VmHWM - VmRSS(before)``. glibc's mmap threshold is pinned to 128 KiB
  (:func:`pin_mmap_threshold`) so every large tensor is its own mapping, given back
  to the OS when freed; otherwise freed buffers would be reused from the heap
  and hide later peaks. On CUDA: ``max_memory_allocated`` above the allocation
  before the block.
* **Collectives** (:func:`counted`): ``CommCounter`` from
  ``physicsnemo_shardext.testing``, i.e. the calls and the payload bytes this
  rank *hands to* collectives (an all-gather of a 1 MiB shard counts 1 MiB,
  whatever the world size), DTensor's own redistributions included.
  :func:`counted_pass` is the measurement every benchmark makes of a forward or
  a backward: counted, an exception caught, and every rank told whether any
  rank raised (so that no rank waits alone in a later collective).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import inspect
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Pass",
    "RanksFailed",
    "all_ranks_agree",
    "counted",
    "counted_pass",
    "first_line",
    "fmt_bytes",
    "heap_allocations",
    "initialize",
    "launch",
    "launched_by_torchrun",
    "median_ms",
    "peak_memory",
    "pin_mmap_threshold",
    "rank_environment",
    "sync",
]

BENCHMARKS = Path(__file__).resolve().parent
#: How long a launched world may run before its ranks are reported as hung (collectives time out before).
WORLD_TIMEOUT_S = 24 * 3600.0

_M_MMAP_THRESHOLD = -3  # mallopt parameter
_PINNED_THRESHOLD = 128 * 1024


# -- memory ------------------------------------------------------------------------------------
def pin_mmap_threshold() -> None:
    """Make glibc map every allocation above 128 KiB separately, so frees return memory to the OS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _PINNED_THRESHOLD)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[list[float | None]]:
    """Yield a one-item list that receives the peak extra memory of the block, in MiB (None: unavailable)."""
    result: list[float | None] = [None]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        yield result
        torch.cuda.synchronize()
        result[0] = (torch.cuda.max_memory_allocated() - before) / 2**20
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM to the current RSS
        before = _status_kib("VmRSS")
    except OSError:
        yield result  # not Linux, or not allowed: report n/a
        return
    yield result
    result[0] = (_status_kib("VmHWM") - before) / 1024


@contextlib.contextmanager
def heap_allocations() -> Iterator[None]:
    """Time with glibc's usual allocator behaviour, not with the pinned mmap threshold of the memory measurement.

    With every allocation above 128 KiB its own mapping, each one costs an ``mmap``, page faults and a
    ``munmap``: that would charge code with many mid-sized buffers more than code with a few large ones.
    glibc's own dynamic threshold rises to 32 MiB; we set that while timing (after every memory
    measurement: freed heap memory would hide later peaks), then give the heap back (``malloc_trim``)
    and pin the threshold again.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
    try:
        yield
    finally:
        libc.malloc_trim(0)
        libc.mallopt(_M_MMAP_THRESHOLD, _PINNED_THRESHOLD)


# -- synchronization and timing -----------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the device, then for every rank."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def all_ranks_agree(ok: bool) -> bool:
    """True when ``ok`` is true on every rank (a rank-local failure must not desynchronize the others)."""
    if not dist.is_initialized():
        return ok
    votes: list[bool | None] = [None] * dist.get_world_size()
    dist.all_gather_object(votes, ok)
    return all(votes)


def median_ms(step: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median wall time of ``repeats`` calls of ``step``, in ms, with every rank synchronized around each."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3 if times else float("nan")


# -- collectives --------------------------------------------------------------------------------
@contextlib.contextmanager
def counted() -> Iterator[Any]:
    """``CommCounter`` for the block; yields its ``CommStats`` (``counts``, ``bytes`` per op, totals)."""
    from physicsnemo_shardext.testing import CommCounter

    with CommCounter() as counter:
        yield counter.stats


@dataclass
class Pass:
    """One counted pass on this rank: its collectives, the exception it raised, whether every rank got through."""

    stats: Any = None  # CommStats (``total_calls``, ``total_bytes``, ``bytes`` per op); None when it raised
    error: Exception | None = None
    everywhere: bool = True  # no rank raised

    @property
    def ok(self) -> bool:
        """Neither this rank nor another raised."""
        return self.error is None and self.everywhere


def counted_pass(run: Callable[..., Any], *args: Any) -> tuple[Any, Pass]:
    """``run(*args)`` under :func:`counted`, an exception caught; returns its value (None if it raised) and the `Pass`.

    Every rank calls this together: it ends with a vote, so a rank-local failure does not
    leave the other ranks waiting in the next collective.
    """
    value, result = None, Pass()
    try:
        with counted() as result.stats:
            value = run(*args)
    except Exception as exc:  # noqa: BLE001 - the caller reports it
        result.error, result.stats = exc, None
    result.everywhere = all_ranks_agree(result.error is None)
    return value, result


# -- formatting ---------------------------------------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    """``1.25 MiB``, ``4.0 KiB``, ``12 B``; ``-`` for None."""
    if n is None:
        return "-"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


def first_line(error: BaseException, limit: int = 100) -> str:
    """The first sentence of the error's first line (at most ``limit`` characters)."""
    lines = str(error).strip().splitlines()
    return (lines[0].split(". ")[0].rstrip(".") if lines else "")[:limit]


# -- starting ranks -----------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """Is this process one rank of a ``torchrun`` launch?"""
    return "WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


class RanksFailed(RuntimeError):
    """A launched world did not finish: a rank raised, hung or died (the message is the pool's per-rank report)."""


def initialize(timeout_s: float | None = None) -> Any:
    """Join the process group (the pool's, torchrun's, or a new one): ``physicsnemo_shardext.initialize()``.

    With ``timeout_s``, a collective on a gloo group raises after that many seconds instead
    of waiting (a rank-local failure then ends the run instead of hanging it).
    """
    import physicsnemo_shardext

    manager = physicsnemo_shardext.initialize()
    if timeout_s is not None and dist.get_backend() == "gloo":
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_timeout(datetime.timedelta(seconds=timeout_s))
    return manager


@contextlib.contextmanager
def rank_environment(kwargs: dict[str, Any], seed: int) -> Iterator[dict[str, Any]]:
    """How :func:`launch`'s task runs on a pool rank: its standard output into a file, for ``launch`` to relay.

    The worker pool sends every rank's output to the rank's log; the tables a
    benchmark prints on rank 0 belong on the script's standard output, apart from
    its standard error.
    """
    del seed  # the bodies seed what they build themselves
    arguments = dict(kwargs)
    path = Path(arguments.pop("stdout_dir")) / f"stdout.{os.environ.get('RANK', '0')}"
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "wb") as out:
        os.dup2(out.fileno(), 1)
    try:
        yield arguments
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def launch(
    body: Callable[[Any], Any],
    args: Any,
    nproc: int,
    *,
    progress: Any = None,
    grace_s: float = 10.0,
    timeout_s: float = WORLD_TIMEOUT_S,
) -> None:
    """Run ``body(args)`` on every rank: inline under torchrun, else on a fresh ``WorkerPool`` of ``nproc`` ranks.

    ``body`` must be a module-level function of a module in ``benchmarks/`` (the ranks import
    it by name) and ``args`` picklable. ``progress``, a ``ProgressFeed``, is followed while the
    ranks run. ``grace_s``: how long the other ranks may still take once one failed or died.

    Raises:
        RanksFailed: a rank raised, hung or died (the report names which, with their output).
    """
    if launched_by_torchrun():
        body(args)
        return
    from physicsnemo_shardext.ranks.worker import RankTask
    from physicsnemo_shardext.ranks.worker_pool import WorkerPool

    file_path = inspect.getsourcefile(body) or ""
    module = body.__module__ if body.__module__ != "__main__" else Path(file_path).stem  # a script: by its name
    with tempfile.TemporaryDirectory(prefix="shardext-bench-") as stdout_dir:
        task = RankTask(
            nodeid=f"{module}.{body.__qualname__} on {nproc} ranks",
            module_name=module,
            file_path=file_path,
            qualname=body.__qualname__,
            kwargs_blob=pickle.dumps({"args": args, "stdout_dir": stdout_dir}),
            sys_path=(str(BENCHMARKS),),
            environment="_common:rank_environment",
        )
        pool = WorkerPool(nproc, startup_timeout_s=max(300.0, 60.0 * nproc), grace_s=grace_s)
        try:
            pool.start()  # before the feed draws: the pool lends its children this process's stdout/stderr
            if progress is not None:
                progress.start()
            try:
                outcome = pool.run(task, timeout_s=timeout_s)
            finally:
                if progress is not None:
                    progress.stop()
        finally:
            pool.close()
        for rank in range(nproc):
            with contextlib.suppress(OSError):
                sys.stdout.write((Path(stdout_dir) / f"stdout.{rank}").read_text(errors="replace"))
        sys.stdout.flush()
    if not outcome.ok:
        raise RanksFailed(outcome.report())
    for rank in range(nproc):
        sys.stderr.write(outcome.output.get(rank, ""))
    sys.stderr.flush()
