"""The rank side of the worker pool: one long-lived process per rank that runs test bodies.

A worker joins a gloo (NCCL on GPU) process group through a ``FileStore``, lets
`physicsnemo_shardext.training.distributed.initialize` adopt it, then loops:
receive a `RankTask`, import the body's module, run the body inside the
environment the task names (the test kit's sandbox, seeding and fixtures),
send back a `RankResult`.

For hang reports a worker records the collective each thread is in
(`physicsnemo_shardext.ranks.hang_report.tracking_collectives`) and runs a
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

import contextlib
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RankResult", "RankTask", "TaskSkipped", "WorkerConfig", "run_task", "worker_main"]

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
class RankTask:
    """One body to run on every rank (a test, or ``shardext verify``'s check)."""

    nodeid: str
    module_name: str
    file_path: str
    qualname: str
    kwargs_blob: bytes  # pickled after the module is importable, so test-defined classes unpickle
    sys_path: tuple[str, ...] = ()
    seed: int = 1234
    #: ``"module:function"`` of a context-manager factory ``(kwargs, seed) -> arguments`` the body runs in.
    environment: str = ""


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


class TaskSkipped(Exception):
    """Raised inside a task's environment when the body skipped itself; the rank reports ``skipped``."""


@contextlib.contextmanager
def _plain_environment(kwargs: dict[str, Any], seed: int) -> Iterator[dict[str, Any]]:
    del seed  # a task without an environment is called with its arguments as sent
    yield kwargs


def _environment(task: RankTask) -> Callable[[dict[str, Any], int], contextlib.AbstractContextManager[dict[str, Any]]]:
    """The context-manager factory ``"module:function"`` that the task names (the caller's per-task setup)."""
    if not task.environment:
        return _plain_environment
    module_name, _, attribute = task.environment.partition(":")
    return getattr(importlib.import_module(module_name), attribute)  # type: ignore[no-any-return]


def run_task(task: RankTask, rank: int) -> RankResult:
    """Run one task body on this rank, inside the environment the task names, and report what happened (never raises).

    The environment is the caller's: the pytest plugin's sandboxes the registries,
    seeds every rank, builds placeholder fixtures and turns a pytest skip into
    `TaskSkipped`; this module knows nothing of pytest.
    """
    start = time.perf_counter()
    try:
        _extend_sys_path(task.sys_path)
        module = import_test_module(task.module_name, task.file_path)
        function = _resolve(module, task.qualname)
        kwargs = pickle.loads(task.kwargs_blob)
        with _environment(task)(kwargs, task.seed) as arguments:
            function(**arguments)
    except TaskSkipped as exc:
        return RankResult(rank, "skipped", str(exc), time.perf_counter() - start)
    except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the parent
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return RankResult(rank, "failed", _format_exception(exc), time.perf_counter() - start)
    return RankResult(rank, "passed", "", time.perf_counter() - start)


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
    from physicsnemo_shardext.ranks.hang_report import hang_report

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
        from physicsnemo_shardext.ranks.hang_report import start_tracking
        from physicsnemo_shardext.training.distributed import initialize

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
            from physicsnemo_shardext.ranks.hang_report import forget_asynchronous

            _arm_stack_dump(log)
            forget_asynchronous()
            conn.send(("result", run_task(message[1], config.rank)))
    try:
        from physicsnemo_shardext.training.distributed import shutdown

        shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    conn.close()
    log.flush()
    # Skip interpreter teardown: PhysicsNeMo's atexit cleanup would destroy the group again.
    os._exit(0)
