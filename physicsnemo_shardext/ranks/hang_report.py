"""What a hung rank was doing: the collective it waits in, and every thread's Python stack.

A rank that hangs is almost always waiting in a collective that a peer never
joined. `tracking_collectives` wraps the collective entry points of
``torch.distributed`` (and the wait of functional collectives) so that each call
records, for its thread, a `PendingCollective`: the op, its tensors' dtypes and
shapes, the process group's size, the peer of a point-to-point op, and the
source line that issued it (the first frame outside ``torch.distributed``). The
record is dropped when the call returns; an asynchronous call (``isend``,
``irecv``, ``batch_isend_irecv``, ``async_op=True``) stays listed until its
``Work`` reports completion. The wrappers are installed only in the worker
processes of the multirank pool and, under ``torchrun``, in the pytest process
of each rank once a multirank test ran (and while the watchdog guards a body);
under ``torch.compile`` they step aside. torch compares a ``P2POp``'s ``op``
with ``dist.isend``/``dist.irecv`` by identity, so a ``P2POp`` built before the
wrapping started cannot be used while it is on (build them where they are sent).

`hang_report` formats the pending collectives and the Python stacks of every
thread (innermost call last, as in a traceback). `reformat_faulthandler` turns
a ``faulthandler`` dump (innermost call first), the fallback when a C call
holds the GIL so that no Python code can run, into the same layout.

Examples:
    ```python
    with tracking_collectives():
        ...                      # another thread may call hang_report() meanwhile
    ```

    A record, as the report shows it:

    >>> call = PendingCollective("all_reduce", ("float32[4, 3]",), 2, None,
    ...                          ("test_x.py", 12, "test_body"), "MainThread", started=0.0)
    >>> call.describe(now=5.0)
    'all_reduce(float32[4, 3]) over a process group of 2 ranks, issued at test_x.py:12 in test_body (thread MainThread, waiting 5.0 s)'
"""

from __future__ import annotations

import collections
import contextlib
import functools
import linecache
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENTRY_POINTS",
    "PendingCollective",
    "forget_asynchronous",
    "format_thread_stacks",
    "hang_report",
    "pending_collectives",
    "reformat_faulthandler",
    "start_tracking",
    "stop_tracking",
    "tracking_collectives",
]

#: ``torch.distributed`` functions that are wrapped (those missing from the installed torch are skipped).
ENTRY_POINTS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "monitored_barrier",
)

#: Positional index and name of the peer argument of the rooted and point-to-point ops.
_PEER_ARGUMENT = {
    "send": (1, "dst"),
    "isend": (1, "dst"),
    "recv": (1, "src"),
    "irecv": (1, "src"),
    "broadcast": (1, "src"),
    "reduce": (1, "dst"),
    "gather": (2, "dst"),
    "scatter": (2, "src"),
}

#: How many unfinished asynchronous calls are remembered (the oldest are forgotten).
_ASYNC_LIMIT = 64
#: Tensors described per call (the rest are counted).
_TENSOR_LIMIT = 4

_DISTRIBUTED_DIR = os.sep + os.path.join("torch", "distributed") + os.sep


@dataclass(eq=False)
class PendingCollective:
    """One collective call in flight on a thread (or issued asynchronously and not completed)."""

    op: str
    tensors: tuple[str, ...]
    group_size: int | None
    peer: str | None
    caller: tuple[str, int, str] | None  # file, line, function
    thread: str
    started: float  # time.monotonic()
    asynchronous: bool = False
    works: list[Any] = field(default_factory=list, repr=False)

    def describe(self, now: float | None = None) -> str:
        """One line: op, tensors, group size, peer, the issuing source line, the thread and the wait."""
        arguments = ", ".join([*self.tensors, *([self.peer] if self.peer else [])])
        text = f"{self.op}({arguments})"
        if self.group_size is not None:
            text += f" over a process group of {self.group_size} rank{'s' if self.group_size != 1 else ''}"
        if self.caller is not None:
            text += f", issued at {self.caller[0]}:{self.caller[1]} in {self.caller[2]}"
        elapsed = (time.monotonic() if now is None else now) - self.started
        state = "asynchronous, not completed" if self.asynchronous else "waiting"
        return f"{text} (thread {self.thread}, {state} {elapsed:.1f} s)"

    def source_line(self) -> str:
        """The text of the issuing source line, or ``""``."""
        if self.caller is None:
            return ""
        return linecache.getline(self.caller[0], self.caller[1]).strip()


# Per thread (ident), the calls in progress, outermost first; each thread only touches its own list.
_active: dict[int, list[PendingCollective]] = {}
# Asynchronous calls whose Work was not complete when last looked at.
_outstanding: collections.deque[PendingCollective] = collections.deque(maxlen=_ASYNC_LIMIT)
_install_lock = threading.Lock()
_installed: list[tuple[Any, str, Any]] = []  # (module, name, original)
_users = 0


def _describe_tensor(value: Any) -> str:
    shape = ", ".join(str(int(size)) for size in value.shape)
    return f"{str(value.dtype).removeprefix('torch.')}[{shape}]"


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, ...]:
    import torch

    found: list[str] = []
    total = 0
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            tensor = getattr(item, "tensor", item)  # a P2POp carries its tensor
            if isinstance(tensor, torch.Tensor):
                total += 1
                if len(found) < _TENSOR_LIMIT:
                    described = _describe_tensor(tensor)
                    op = getattr(getattr(item, "op", None), "__name__", None)
                    peer = getattr(item, "peer", None)
                    found.append(f"{op} {described} with rank {peer}" if op and peer is not None else described)
    if total > len(found):
        found.append(f"... {total - len(found)} more")
    return tuple(found)


def _group(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs.get("group") is not None:
        return kwargs["group"]
    for value in (*args, *kwargs.values()):
        if type(value).__name__ == "ProcessGroup":
            return value
        if isinstance(value, (list, tuple)) and value and getattr(value[0], "group", None) is not None:
            return value[0].group  # batch_isend_irecv's P2POps
    return None


def _group_size(group: Any) -> int | None:
    try:
        import torch.distributed as dist

        return int(group.size()) if group is not None else int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a description must never fail the collective
        return None


def _peer(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if op not in _PEER_ARGUMENT:
        return None
    index, name = _PEER_ARGUMENT[op]
    for key in (name, f"group_{name}"):
        if kwargs.get(key) is not None:
            return f"{key}={kwargs[key]}"
    if len(args) > index and isinstance(args[index], int):
        return f"{name}={args[index]}"
    return None


def _caller(frame: Any) -> tuple[str, int, str] | None:
    while frame is not None:
        filename = frame.f_code.co_filename
        if _DISTRIBUTED_DIR not in filename and filename != __file__:
            return filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


def _record(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PendingCollective:
    try:
        return PendingCollective(
            op,
            _tensors(args, kwargs),
            _group_size(_group(args, kwargs)) if op != "wait_tensor" else None,
            _peer(op, args, kwargs),
            _caller(sys._getframe(2)),
            threading.current_thread().name,
            time.monotonic(),
        )
    except Exception:  # noqa: BLE001 - a description must never fail the collective
        return PendingCollective(op, (), None, None, None, threading.current_thread().name, time.monotonic())


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - an unknown state counts as not completed
        return False


def _remember_async(record: PendingCollective, result: Any) -> None:
    works = [w for w in (result if isinstance(result, list) else [result]) if hasattr(w, "is_completed")]
    if not works:
        return
    record.asynchronous, record.works = True, works
    for old in list(_outstanding):
        if all(_completed(w) for w in old.works):
            with contextlib.suppress(ValueError):
                _outstanding.remove(old)
    _outstanding.append(record)


def _wrap(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    @functools.wraps(original)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        record = _record(op, args, kwargs)
        calls = _active.setdefault(threading.get_ident(), [])
        calls.append(record)
        try:
            result = original(*args, **kwargs)
        finally:
            calls.remove(record)
        if result is not None and op != "wait_tensor" and not calls:  # nested: the outer call waits
            _remember_async(record, result)
        return result

    tracked.__shardext_tracked__ = True  # type: ignore[attr-defined]
    return tracked


def _install() -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    targets: list[tuple[str, list[Any], Any]] = [
        (name, [dist, c10d], getattr(c10d, name, None)) for name in ENTRY_POINTS
    ]
    targets.append(("wait_tensor", [funcol], getattr(funcol, "wait_tensor", None)))
    for name, modules, original in targets:
        if original is None or getattr(original, "__shardext_tracked__", False):
            continue
        wrapper = _wrap(name, original)
        for module in modules:
            if getattr(module, name, None) is original:
                _installed.append((module, name, original))
                setattr(module, name, wrapper)


def _uninstall() -> None:
    while _installed:
        module, name, original = _installed.pop()
        setattr(module, name, original)
    _active.clear()
    _outstanding.clear()


def start_tracking() -> None:
    """Wrap the entry points (counted: each call needs one `stop_tracking`)."""
    global _users
    with _install_lock:
        _users += 1
        if _users == 1:
            _install()


def stop_tracking() -> None:
    """Undo one `start_tracking`; the last one restores the original functions."""
    global _users
    with _install_lock:
        _users = max(0, _users - 1)
        if _users == 0:
            _uninstall()


@contextlib.contextmanager
def tracking_collectives() -> Iterator[None]:
    """Record the collectives called inside (on any thread); nests, and undoes the wrapping on exit.

    Examples:
        >>> with tracking_collectives():
        ...     import torch.distributed as dist
        ...     hasattr(dist.all_reduce, "__shardext_tracked__")
        True
        >>> hasattr(dist.all_reduce, "__shardext_tracked__")
        False
    """
    start_tracking()
    try:
        yield
    finally:
        stop_tracking()


def forget_asynchronous() -> None:
    """Drop the remembered asynchronous calls (a new test starts)."""
    _outstanding.clear()


def pending_collectives() -> list[PendingCollective]:
    """The calls in flight on every thread, then the asynchronous ones not completed.

    Examples:
        >>> pending_collectives()
        []
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    found = []
    for ident, calls in list(_active.items()):
        for call in list(calls):
            call.thread = names.get(ident, call.thread)
            found.append(call)
    found.extend(call for call in list(_outstanding) if not all(_completed(w) for w in call.works))
    return found


def format_thread_stacks(skip_current: bool = True) -> str:
    """The Python stack of every thread of this process, innermost call last, with thread names.

    Examples:
        >>> "Thread MainThread" in format_thread_stacks(skip_current=False)
        True
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if skip_current and ident == threading.get_ident():
            continue
        parts.append(f"Thread {names.get(ident, hex(ident))}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def hang_report() -> str:
    """The pending collectives, then every thread's Python stack (innermost last); run from another thread.

    Examples:
        >>> print(hang_report().splitlines()[0])
        pending collective: none recorded
    """
    now = time.monotonic()
    pending = pending_collectives()
    if pending:
        lines = []
        for call in pending:
            lines.append(f"pending collective: {call.describe(now)}")
            if call.source_line():
                lines.append(f"    {call.source_line()}")
    else:
        lines = ["pending collective: none recorded"]
    lines.append("Python stacks of every thread (most recent call last):")
    return "\n".join(lines) + "\n" + format_thread_stacks()


_FAULTHANDLER_THREAD = re.compile(r"^(.*)\(most recent call first\):$")
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def reformat_faulthandler(text: str) -> str:
    """A ``faulthandler`` dump (innermost call first) in traceback order (innermost last), with source lines.

    Examples:
        >>> dump = '''Thread 0x00007f01 (most recent call first):
        ...   File "/x/dist.py", line 9 in all_reduce
        ...   File "/x/test_a.py", line 3 in test_body
        ... '''
        >>> print(reformat_faulthandler(dump))
        Thread 0x00007f01 (most recent call last):
          File "/x/test_a.py", line 3, in test_body
          File "/x/dist.py", line 9, in all_reduce
    """
    out: list[str] = []
    frames: list[tuple[str, int, str]] = []

    def flush() -> None:
        for filename, lineno, function in reversed(frames):
            out.append(f'  File "{filename}", line {lineno}, in {function}')
            source = linecache.getline(filename, lineno).strip()
            if source:
                out.append(f"    {source}")
        frames.clear()

    for line in text.splitlines():
        header, frame = _FAULTHANDLER_THREAD.match(line), _FAULTHANDLER_FRAME.match(line)
        if frame:
            frames.append((frame.group(1), int(frame.group(2)), frame.group(3)))
            continue
        flush()
        if header:
            if out:
                out.append("")
            out.append(f"{header.group(1)}(most recent call last):")
        elif line.strip():
            out.append(line)
    flush()
    return "\n".join(out)
