"""What the benchmarks share: starting ranks, per-rank peak memory, counting collectives, formatting.

* **Ranks.** :func:`launch` runs ``body(args)`` on every rank: inline when the
  script was started by ``torchrun`` (``WORLD_SIZE`` is set), else on ``nproc``
  processes it spawns itself (gloo on CPU, one thread each, like torchrun's
  ``OMP_NUM_THREADS=1``).
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
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_ranks_agree", "counted", "exit_without_teardown", "first_line", "fmt_bytes", "free_port", "heap_allocations",
    "launch",
    "launched_by_torchrun", "median_ms", "peak_memory", "pin_mmap_threshold", "sync",
]

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


# -- launching ----------------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """Is this process one rank of a ``torchrun`` launch?"""
    return "WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_rank(rank: int, world_size: int, port: int, body: Callable[[Any], Any], args: Any) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # like torchrun's OMP_NUM_THREADS=1
    body(args)
    exit_without_teardown()


def exit_without_teardown(code: int = 0) -> None:
    """Flush and leave now: PhysicsNeMo's atexit cleanup would destroy the process group a second time.

    After ``physicsnemo_shardext.shutdown()`` that second destruction aborts now and then
    (``terminate called without an active exception``, SIGABRT).
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(body: Callable[[Any], Any], args: Any, nproc: int) -> None:
    """Run ``body(args)`` on every rank: inline under torchrun, else on ``nproc`` spawned processes.

    ``body`` must be importable by name (a module-level function), since the spawned processes
    unpickle it.
    """
    if launched_by_torchrun():
        body(args)
    else:
        torch.multiprocessing.spawn(_spawned_rank, args=(nproc, free_port(), body, args), nprocs=nproc)
