"""The rank side of the worker pool: one long-lived process per rank that runs test bodies.

A worker joins a gloo (NCCL on GPU) process group through a ``FileStore``, lets
`physicsnemo_shardext.distributed.initialize` adopt it, then loops:
receive a `TestTask`, import the test module, materialize placeholder
fixtures, run the body inside `rank_test_environment`,
send back a `RankResult`.

For hang reports a worker records the collective each thread is in
(`physicsnemo_shardext.testing.hang_report.tracking_collectives`) and runs a
*reporter* thread that answers a ``"report"`` request on a second pipe with the
pending collectives and every thread's Python stack. That needs the GIL; when a
C call holds it, the parent falls back to ``faulthandler``, which the worker
re-arms on `STACK_DUMP_SIGNAL` before every task (a test or a library may have
taken the signal over).

This module is imported by the parent (for the process target), so it only
imports torch inside the worker.

Examples:
    What `WorkerPool` does:

    ```python
    ctx = multiprocessing.get_context("spawn")
    ctx.Process(target=worker_main, args=(WorkerConfig(...), child_conn)).start()
    ```

    A rank's result, as sent back to the parent:

    >>> RankResult(rank=1, outcome="skipped", message="needs 4 ranks")
    RankResult(rank=1, outcome='skipped', message='needs 4 ranks', duration_s=0.0, extra={})
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RankResult", "TestTask", "WorkerConfig", "run_task", "worker_main"]

#: Signal that makes a worker dump all its threads' Python stacks into its log.
STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to start."""

    rank: int
    world_size: int
    store_path: str
    log_path: str
    parent_pid: int
    sys_path: tuple[str, ...] = ()
    pg_timeout_s: float = 600.0


@dataclass(frozen=True)
class TestTask:
    """One test body to run on every rank."""

    nodeid: str
    module_name: str
    file_path: str
    qualname: str
    kwargs_blob: bytes  # pickled after the module is importable, so test-defined classes unpickle
    sys_path: tuple[str, ...] = ()
    seed: int = 1234


@dataclass
class RankResult:
    """Outcome of one rank: ``passed``, ``failed`` or ``skipped``."""

    rank: int
    outcome: str
    message: str = ""
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _extend_sys_path(paths: tuple[str, ...]) -> None:
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def _same_file(module: Any, file_path: str) -> bool:
    module_file = getattr(module, "__file__", None)
    if not module_file:
        return False
    try:
        return Path(module_file).resolve() == Path(file_path).resolve()
    except OSError:
        return False


def import_test_module(module_name: str, file_path: str) -> Any:
    """Import the test module by name (checking it is the same file), else by file path."""
    module = sys.modules.get(module_name)
    if module is not None and _same_file(module, file_path):
        return module
    try:
        module = importlib.import_module(module_name)
        if _same_file(module, file_path):
            return module
    except ImportError:
        pass
    # Fallback: load the file under a private name (e.g. rootdir-less layouts, importmode=importlib).
    alias = f"_shardext_test_{abs(hash(file_path))}"
    if alias in sys.modules:
        return sys.modules[alias]
    spec = importlib.util.spec_from_file_location(alias, file_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import test module {module_name} from {file_path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


def _resolve(module: Any, qualname: str) -> Any:
    owner: Any = module
    parts = qualname.split(".")
    for index, part in enumerate(parts):
        attribute = getattr(owner, part)
        if isinstance(attribute, type) and index < len(parts) - 1:
            owner = attribute()  # pytest instantiates test classes without arguments too
        else:
            owner = attribute
    return owner


def _format_exception(exc: BaseException) -> str:
    # Drop the frames of this module: the report starts at the test body.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _is_skip(exc: BaseException) -> bool:
    try:
        from _pytest.outcomes import Skipped
    except ImportError:  # pragma: no cover - pytest is there whenever tests run
        return False
    return isinstance(exc, Skipped)


def run_task(task: TestTask, rank: int) -> RankResult:
    """Run one test body on this rank and report what happened (never raises)."""
    from physicsnemo_shardext.testing.isolation import rank_test_environment
    from physicsnemo_shardext.testing.placeholders import materialize

    start = time.perf_counter()
    try:
        _extend_sys_path(task.sys_path)
        module = import_test_module(task.module_name, task.file_path)
        function = _resolve(module, task.qualname)
        kwargs = pickle.loads(task.kwargs_blob)
        with rank_test_environment(task.seed) as registry:
            arguments = materialize(kwargs, registry)
            try:
                function(**arguments)
            finally:
                _undo_monkeypatches(arguments)
    except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the parent
        elapsed = time.perf_counter() - start
        if _is_skip(exc):
            return RankResult(rank, "skipped", str(getattr(exc, "msg", exc)), elapsed)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return RankResult(rank, "failed", _format_exception(exc), elapsed)
    return RankResult(rank, "passed", "", time.perf_counter() - start)


def _undo_monkeypatches(arguments: dict[str, Any]) -> None:
    """Undo what a ``monkeypatch`` fixture did on this rank.

    The fixture's teardown runs in the pytest process, on the pickled original,
    so changes made through the rank's copy would otherwise leak into later
    tests run by this long-lived worker.
    """
    import pytest

    for value in arguments.values():
        if isinstance(value, pytest.MonkeyPatch):
            value.undo()


def _redirect_output(log_path: str) -> Any:
    # fd-level redirect so C++ (gloo) messages and faulthandler dumps land in the log too.
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    return log


def _watch_parent(parent_pid: int) -> None:
    # If pytest dies (even SIGKILL) a hung collective would keep us alive forever.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(70)


def _init_process_group(config: WorkerConfig) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    # NCCL needs one GPU per rank; with fewer GPUs than ranks the ranks run on CPU (gloo).
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= config.world_size else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    store = dist.FileStore(config.store_path, config.world_size)
    dist.init_process_group(
        backend,
        store=store,
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.pg_timeout_s),
    )


def _arm_stack_dump(log: Any) -> None:
    # faulthandler writes from its C signal handler, so it works while a C call holds the GIL.
    if STACK_DUMP_SIGNAL is not None:
        faulthandler.register(STACK_DUMP_SIGNAL, file=log, all_threads=True)


def _serve_reports(control: Any) -> None:
    """Answer each ``("report",)`` on ``control`` with the hang report of this process."""
    from physicsnemo_shardext.testing.hang_report import hang_report

    while True:
        try:
            request = control.recv()
        except (EOFError, OSError):
            return  # the pool went away
        if request[0] != "report":
            continue
        try:
            text = hang_report()
        except Exception as exc:  # noqa: BLE001 - say why instead of staying silent
            text = f"(the hang report failed: {exc!r})"
        try:
            control.send(text)
        except (OSError, ValueError):
            return


def worker_main(config: WorkerConfig, conn: Any, control: Any = None) -> None:
    """Process entry point: initialize, then serve tasks from ``conn`` until told to stop.

    ``control``, when given, is the pipe on which the pool asks for hang reports.
    """
    log = _redirect_output(config.log_path)
    faulthandler.enable(file=log, all_threads=True)
    _arm_stack_dump(log)
    threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True, name="shardext-watch-parent").start()
    _extend_sys_path(config.sys_path)
    os.environ.update(
        RANK=str(config.rank),
        LOCAL_RANK=str(config.rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.world_size),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)  # N ranks share a few cores; oversubscription makes tests crawl
        _init_process_group(config)
        from physicsnemo_shardext.distributed import initialize
        from physicsnemo_shardext.testing.hang_report import start_tracking

        initialize()
        # For the whole life of the worker: torch.distributed entry points record their calls.
        start_tracking()
        if control is not None:
            threading.Thread(target=_serve_reports, args=(control,), daemon=True, name="shardext-hang-reporter").start()
        conn.send(("ready", config.rank, os.getpid()))
    except BaseException as exc:  # noqa: BLE001
        conn.send(("error", config.rank, _format_exception(exc)))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # parent went away
        if message[0] == "stop":
            break
        if message[0] == "run":
            from physicsnemo_shardext.testing.hang_report import forget_asynchronous

            _arm_stack_dump(log)
            forget_asynchronous()
            conn.send(("result", run_task(message[1], config.rank)))
    try:
        from physicsnemo_shardext.distributed import shutdown

        shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    conn.close()
    log.flush()
    # Skip interpreter teardown: PhysicsNeMo's atexit cleanup would destroy the group again.
    os._exit(0)
