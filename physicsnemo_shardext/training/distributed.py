"""A distributed bootstrap that works with gloo on CPU and NCCL on GPU.

PhysicsNeMo 2.2.x's ``DistributedManager.initialize()`` passes
``device_id=torch.device("cpu")`` to ``init_process_group`` on machines
without CUDA, which torch rejects with ``ValueError``. Yet ``scatter_tensor``
and ``DistributedManager.get_mesh_group`` need an initialized manager.

`initialize` runs PhysicsNeMo's own initializer (environment, SLURM or
OpenMPI discovery, manager state, its ``atexit`` cleanup) and only drops a
*CPU* ``device_id`` on its way to torch. Where PhysicsNeMo does not pass one
(on GPUs, or once it is fixed), nothing is changed at all.

Examples:
    Under ``torchrun --nproc-per-node 2 script.py``:

    ```python
    from physicsnemo_shardext.training.distributed import initialize, shutdown
    manager = initialize()          # gloo on CPU, NCCL on GPU
    mesh = manager.initialize_mesh((-1,), ("domain",))
    ...
    shutdown()
    ```
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from physicsnemo.distributed import DistributedManager

from physicsnemo_shardext.errors import ShardextWarning

__all__ = ["distributed_session", "exit_rank", "initialize", "is_cpu_device_id", "shutdown"]


def is_cpu_device_id(device_id: Any) -> bool:
    """Return whether ``device_id`` names the CPU, which torch's ``init_process_group`` refuses.

    Examples:
        >>> is_cpu_device_id(torch.device("cpu")), is_cpu_device_id(None)
        (True, False)
    """
    if device_id is None or isinstance(device_id, int):
        return False
    return torch.device(device_id).type == "cpu"


@contextlib.contextmanager
def _tolerate_cpu_device_id() -> Iterator[None]:
    """Within the block, ``dist.init_process_group`` ignores a CPU ``device_id``."""
    original: Callable[..., Any] = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if is_cpu_device_id(kwargs.get("device_id")):
            kwargs.pop("device_id")
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = original


@contextlib.contextmanager
def _slurm_variables_for_physicsnemo() -> Iterator[None]:
    """Within the block, the SLURM variables PhysicsNeMo 2.2 reads are present.

    PhysicsNeMo's SLURM path (taken when ``RANK`` is unset and ``SLURM_PROCID`` is
    set) reads ``SLURM_NPROCS`` and ``SLURM_LAUNCH_NODE_IPADDR`` and fails with a
    ``TypeError`` when either is missing, although ``SLURM_NTASKS`` is the current
    name of the first and jobs commonly export ``MASTER_ADDR`` instead of relying on
    the second. Here ``SLURM_NPROCS`` defaults to ``SLURM_NTASKS`` and
    ``SLURM_LAUNCH_NODE_IPADDR`` is ``MASTER_ADDR`` when that is set (an explicit
    rendezvous address wins over the launch node), else ``localhost`` when missing.
    The environment is restored afterwards. Outside SLURM nothing changes.
    """
    if "SLURM_PROCID" not in os.environ or "RANK" in os.environ:
        yield
        return
    saved = {name: os.environ.get(name) for name in ("SLURM_NPROCS", "SLURM_LAUNCH_NODE_IPADDR")}
    if "SLURM_NPROCS" not in os.environ and "SLURM_NTASKS" in os.environ:
        os.environ["SLURM_NPROCS"] = os.environ["SLURM_NTASKS"]
    if "MASTER_ADDR" in os.environ:
        os.environ["SLURM_LAUNCH_NODE_IPADDR"] = os.environ["MASTER_ADDR"]
    else:
        os.environ.setdefault("SLURM_LAUNCH_NODE_IPADDR", "localhost")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _adopt_existing_process_group() -> None:
    """Fill DistributedManager's state from a process group someone else created."""
    # DistributedManager.setup() would call init_process_group a second time,
    # so we record the same attributes it records, without initializing.
    DistributedManager._shared_state["_is_initialized"] = True
    manager = DistributedManager()
    manager._distributed = True
    manager._rank = dist.get_rank()
    manager._world_size = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", manager._rank))
    manager._local_rank = local_rank
    # Follow the group's backend: a gloo group on a GPU machine computes on CPU.
    on_gpu = dist.get_backend() == "nccl"
    manager._device = torch.device(f"cuda:{local_rank}" if on_gpu else "cpu")
    # PhysicsNeMo's initialize_mesh builds a CUDA mesh whenever ``cuda`` is set, which on a
    # gloo group sets a device per rank (rank 1 of 2 on one GPU: "invalid device ordinal").
    manager._cuda = on_gpu
    manager._initialization_method = "adopted"
    if on_gpu:
        torch.cuda.set_device(manager._device)


def initialize() -> DistributedManager:
    """Initialize ``torch.distributed`` and PhysicsNeMo's ``DistributedManager``.

    * Already-initialized manager: returned as is.
    * A process group created elsewhere (e.g. by a test harness): adopted.
    * Otherwise PhysicsNeMo's ``DistributedManager.initialize()`` runs, with a
      CPU ``device_id`` dropped; gloo is chosen on CPU, NCCL on GPU. It reads
      torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
      ``MASTER_ADDR``/``MASTER_PORT``) or, without ``RANK``, SLURM's
      (``SLURM_PROCID``, ``SLURM_NTASKS`` or ``SLURM_NPROCS``, ``SLURM_LOCALID``,
      with ``MASTER_ADDR`` else ``SLURM_LAUNCH_NODE_IPADDR``, and ``MASTER_PORT``).

    Also installs PhysicsNeMo's built-in shard patches, which PhysicsNeMo only
    does by itself when CUDA is available.

    Returns:
        The initialized ``DistributedManager`` singleton.

    Examples:
        >>> manager = initialize()  # doctest: +SKIP
        >>> manager.world_size      # doctest: +SKIP
        2
    """
    from physicsnemo_shardext.engine.baseline import ensure_builtin_patches

    ensure_builtin_patches()
    if DistributedManager.is_initialized():
        return DistributedManager()
    if dist.is_available() and dist.is_initialized():
        _adopt_existing_process_group()
        return DistributedManager()
    # Without LOCAL_RANK PhysicsNeMo computes ``rank % cuda.device_count()``,
    # a division by zero on CPU: default it to the rank, as torchrun would.
    if "RANK" in os.environ and "LOCAL_RANK" not in os.environ and not torch.cuda.is_available():
        os.environ["LOCAL_RANK"] = os.environ["RANK"]
    if _fewer_gpus_than_local_ranks():
        # NCCL would give this process cuda:<local_rank>, which does not exist: every rank of
        # the node goes to gloo on CPU instead (all alike, or the group would mix backends).
        warnings.warn(_fewer_gpus_message(), ShardextWarning, stacklevel=2)
        dist.init_process_group("gloo")
        _adopt_existing_process_group()
        return DistributedManager()
    with _tolerate_cpu_device_id(), _slurm_variables_for_physicsnemo():
        DistributedManager.initialize()
    return DistributedManager()


def _fewer_gpus_than_local_ranks() -> bool:
    """Whether this node runs more ranks than it has GPUs (torchrun's ``LOCAL_WORLD_SIZE``, else ``LOCAL_RANK``).

    Examples:
        >>> _fewer_gpus_than_local_ranks() if "LOCAL_WORLD_SIZE" not in os.environ else False
        False
    """
    if not torch.cuda.is_available():
        return False
    gpus = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return local_world > gpus or local_rank >= gpus


def _fewer_gpus_message() -> str:
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "?")
    return (
        f"{local_world} ranks on this node but {torch.cuda.device_count()} visible GPU(s): NCCL needs one GPU per "
        "rank, so every rank of this node uses gloo on CPU. Launch at most one rank per GPU "
        "(torchrun --nproc-per-node <= the GPU count) to run on GPUs."
    )


def shutdown(barrier: bool = True) -> None:
    """Destroy the process groups and reset ``DistributedManager`` (safe to call twice).

    With ``barrier`` (the default) every rank first waits for the others: a rank that
    tears its gloo group down while a peer still talks to it makes that peer's
    transport thread abort the process at exit ("terminate called without an active
    exception", seen about once in six 2-rank runs of a script ending right after a
    collective). Pass ``barrier=False`` on an error path, where a peer may never arrive.
    """
    if DistributedManager.is_initialized():
        live = dist.is_available() and dist.is_initialized()
        if barrier and live and dist.get_backend() != "nccl":
            # PhysicsNeMo's cleanup barrier names device_ids=[local_rank]: on a GPU machine
            # whose ranks fell back to gloo (more ranks than GPUs), rank 1 has no cuda:1.
            dist.barrier()
            barrier = False
        DistributedManager.cleanup(barrier=barrier and live)
    elif dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int | None = 0) -> NoReturn:
    """End a rank that has finished and shut down: flush its output, then leave without interpreter teardown.

    The last line of a script that ``torchrun`` starts, instead of ``sys.exit``. At
    interpreter teardown a C++ object of gloo can still own a joinable transport
    thread; destroying it aborts the process ("terminate called without an active
    exception", SIGABRT) after the work is done and reported, in about one of thirty
    2-rank CPU runs, and torchrun then fails the whole job. Leaving with ``os._exit``
    skips that teardown (and with it ``atexit`` handlers: flush your own files first).
    Outside a distributed run (no ``WORLD_SIZE``) this is ``sys.exit(code)``.

    Examples:
        ```python
        if __name__ == "__main__":
            physicsnemo_shardext.exit_rank(main())   # main() ends with physicsnemo_shardext.shutdown()
        ```

        >>> import pytest
        >>> with pytest.raises(SystemExit):   # not under torchrun here: an ordinary exit
        ...     exit_rank(0)
    """
    if "WORLD_SIZE" not in os.environ:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if isinstance(code, int) else 1)


@contextlib.contextmanager
def distributed_session() -> Iterator[DistributedManager]:
    """Context manager: `initialize` on entry, `shutdown` on exit (also on error).

    Examples:
        Under ``torchrun``:

        ```python
        with distributed_session() as manager:
            print(manager.rank, manager.world_size)
        ```
    """
    manager = initialize()
    try:
        yield manager
    except BaseException:
        shutdown(barrier=False)  # a peer may never reach the barrier
        raise
    shutdown()
