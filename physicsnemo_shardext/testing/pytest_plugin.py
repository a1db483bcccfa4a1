"""pytest plugin implementation: run test bodies on N ranks.

pytest loads the entry point ``pytest11: shardext``, the light module
`physicsnemo_shardext_pytest` (ini values, marker, fixtures); it imports and
registers this module only once a collected test is marked ``multirank`` or
uses a multirank fixture, so other test runs never import torch or PhysicsNeMo.

Mark a test with ``@pytest.mark.multirank(N)`` (optionally ``timeout=`` seconds
and ``seed=``):

* under plain ``pytest`` the body runs on N gloo (CPU) / NCCL (GPU) worker
  processes that the plugin spawns, reuses across tests and restarts after any
  failure, hang or crash;
* under ``torchrun --nproc-per-node N -m pytest`` the body runs inline on every
  rank (a test marked for another N is skipped, naming both numbers).

Multirank fixtures (``domain_mesh``, ``ddp_domain_mesh``, ``spatial_mesh``,
``rank``, ``world_size``, ``registry_sandbox``) are created on the rank; other
fixture and parametrize values are pickled to the ranks. Parametrizing with
`split_cases` gives readable test ids (``test_op[uneven-6-11]``).

Examples:
    A test run on 2 ranks:

    ```python
    import pytest, torch
    from torch.distributed.tensor import Shard
    from physicsnemo_shardext.testing import shard_tensor

    @pytest.mark.multirank(2, timeout=60)
    def test_roundtrip(domain_mesh, rank):
        full = torch.randn(4, 17)             # same on every rank: seeded per test
        xs = shard_tensor(full, domain_mesh, [Shard(1)], sizes_by_mesh_dim=[10, 7])
        assert xs.to_local().shape[1] == (10, 7)[rank]
        assert xs.full_tensor().equal(full)
    ```

    The rank count comes from the marker:

    >>> marker_world_size(pytest.mark.multirank(2, timeout=60).mark)
    2

Timeout precedence: marker ``timeout=`` > ``SHARDEXT_TEST_TIMEOUT`` env var >
ini option ``shardext_timeout`` > 120 s. Under torchrun a rank that outlives it
prints the collective it waits in and its stacks, and exits (see
`physicsnemo_shardext.ranks.watchdog`).
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from physicsnemo_shardext.testing.isolation import (
    DEFAULT_SEED,
    RANK_TASK_ENVIRONMENT,
    rank_test_environment,
    registry_sandbox_context,
)
from physicsnemo_shardext.testing.placeholders import RankValue, build

__all__ = [
    "MultirankController",
    "fixture_value",
    "launched_by_torchrun",
    "marker_world_size",
    "registry_sandbox_values",
]

DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "SHARDEXT_TEST_TIMEOUT"
_CONTROLLER = pytest.StashKey["MultirankController"]()


def launched_by_torchrun() -> bool:
    """Whether this pytest process is one rank of a ``torchrun`` (or similar) launch."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def marker_world_size(marker: pytest.Mark) -> int:
    """The N of ``multirank(N)`` (also accepted as ``multirank(world_size=N)``)."""
    value = marker.args[0] if marker.args else marker.kwargs.get("world_size")
    if not isinstance(value, int) or value < 1:
        raise pytest.UsageError(f"@pytest.mark.multirank needs a positive rank count, got {value!r}")
    return value


class MultirankController:
    """Per-session state: the worker pools (plain pytest) or the torchrun initialization."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.torchrun = launched_by_torchrun()
        self.pools: dict[int, Any] = {}
        self._initialized = False
        self._report_fd: int | None = None

    # -- settings ---------------------------------------------------------------------
    def _ini_float(self, name: str, default: float) -> float:
        value = self.config.getini(name)
        return float(value) if value not in (None, "") else default

    def timeout_for(self, marker: pytest.Mark) -> float:
        """Marker ``timeout=`` > env ``SHARDEXT_TEST_TIMEOUT`` > ini ``shardext_timeout`` > 120 s."""
        if marker.kwargs.get("timeout") is not None:
            return float(marker.kwargs["timeout"])
        if os.environ.get(TIMEOUT_ENV):
            return float(os.environ[TIMEOUT_ENV])
        return self._ini_float("shardext_timeout", DEFAULT_TIMEOUT_S)

    # -- torchrun ---------------------------------------------------------------------
    def ensure_initialized(self) -> None:
        """Under torchrun: initialize torch.distributed + DistributedManager once per session.

        The collectives are tracked for hang reports from then on (not per test: a
        ``P2POp`` built by a fixture must meet the same ``dist.isend`` in the body).
        """
        if not self._initialized:
            from physicsnemo_shardext.ranks.hang_report import start_tracking
            from physicsnemo_shardext.training.distributed import initialize

            initialize()
            start_tracking()
            self._initialized = True

    def report_fd(self) -> int:
        """A duplicate of the real stderr for hang reports (pytest redirects fd 2 during tests)."""
        if self._report_fd is None:
            capture = self.config.pluginmanager.getplugin("capturemanager")
            capturing = capture is not None and capture.is_globally_capturing()
            if capturing:
                capture.suspend_global_capture(in_=False)
            try:
                self._report_fd = os.dup(2)
            finally:
                if capturing:
                    capture.resume_global_capture()
        return self._report_fd

    # -- spawned workers ----------------------------------------------------------------
    def pool(self, world_size: int) -> Any:
        """The (lazily started) worker pool of ``world_size`` ranks."""
        from physicsnemo_shardext.ranks.worker_pool import WorkerPool

        if world_size not in self.pools:
            self.pools[world_size] = WorkerPool(
                world_size,
                startup_timeout_s=self._ini_float("shardext_startup_timeout", 300.0),
                grace_s=self._ini_float("shardext_grace", 10.0),
            )
        return self.pools[world_size]

    def close(self) -> None:
        """Stop every pool (spawn mode) or leave the process group (torchrun mode)."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        if self._initialized:
            from physicsnemo_shardext.ranks.hang_report import stop_tracking
            from physicsnemo_shardext.training.distributed import shutdown

            stop_tracking()
            shutdown()
            self._initialized = False
        if self._report_fd is not None:
            os.close(self._report_fd)
            self._report_fd = None


def _controller(config: pytest.Config) -> MultirankController:
    return config.stash[_CONTROLLER]


# -- hooks ------------------------------------------------------------------------------
# Ini values, the marker line, fixtures and SplitCase ids are declared by the entry
# point (`physicsnemo_shardext_pytest`), which registers this module when needed.
def pytest_configure(config: pytest.Config) -> None:
    # Loaded on its own (`-p physicsnemo_shardext.testing.pytest_plugin`, `pytest_plugins`,
    # stale metadata naming the old entry point): the declarations come with it.
    import physicsnemo_shardext_pytest as entry_point

    if not config.pluginmanager.is_registered(entry_point):
        config.pluginmanager.register(entry_point, entry_point.__name__)
    config.stash[_CONTROLLER] = MultirankController(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CONTROLLER in config.stash:
        _controller(config).close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("multirank")
    controller = _controller(item.config)
    if marker is None or not controller.torchrun:
        return
    wanted, launched = marker_world_size(marker), int(os.environ.get("WORLD_SIZE", "1"))
    if wanted != launched:
        pytest.skip(f"multirank({wanted}) test, but torchrun launched {launched} ranks (WORLD_SIZE={launched})")
    controller.ensure_initialized()


def _test_kwargs(item: pytest.Function) -> dict[str, Any]:
    return {name: item.funcargs[name] for name in item._fixtureinfo.argnames}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("multirank")
    if marker is None:
        return None
    controller = _controller(pyfuncitem.config)
    seed = int(marker.kwargs.get("seed", DEFAULT_SEED))
    if controller.torchrun:
        from physicsnemo_shardext.ranks.watchdog import rank_watchdog

        rank = int(os.environ.get("RANK", "0"))
        timeout = controller.timeout_for(marker)
        watchdog = rank_watchdog(timeout, pyfuncitem.nodeid, rank, report_fd=controller.report_fd())
        with watchdog, rank_test_environment(seed):
            pyfuncitem.obj(**_test_kwargs(pyfuncitem))
        return True
    _run_on_pool(pyfuncitem, controller, marker, seed)
    return True


def _run_on_pool(item: pytest.Function, controller: MultirankController, marker: pytest.Mark, seed: int) -> None:
    from physicsnemo_shardext.ranks.worker import RankTask
    from physicsnemo_shardext.ranks.worker_pool import PoolStartupError

    kwargs = _test_kwargs(item)
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any pickling error means the same thing
            pytest.fail(
                f"argument {name!r} of multirank test cannot be sent to the ranks ({exc!r}); "
                "create it inside the test or use a multirank fixture",
                pytrace=False,
            )
    function = getattr(item.obj, "__func__", item.obj)
    task = RankTask(
        nodeid=item.nodeid,
        module_name=item.module.__name__,
        file_path=str(item.path),
        qualname=function.__qualname__,
        kwargs_blob=pickle.dumps(kwargs),
        sys_path=tuple(sys.path),
        seed=seed,
        environment=RANK_TASK_ENVIRONMENT,
    )
    try:
        outcome = controller.pool(marker_world_size(marker)).run(task, controller.timeout_for(marker))
    except PoolStartupError as exc:
        pytest.fail(str(exc), pytrace=False)
    if outcome.ok:
        if outcome.skipped is not None:
            pytest.skip(outcome.skipped)
        return
    pytest.fail(outcome.report(), pytrace=False)


# -- fixture bodies (the fixtures are declared in physicsnemo_shardext_pytest) ----------
def fixture_value(request: pytest.FixtureRequest, kind: str) -> Any:
    """The value of multirank fixture ``kind``: built on the rank (torchrun) or a placeholder for the workers."""
    controller = _controller(request.config)
    if controller.torchrun:
        controller.ensure_initialized()
        return build(kind)
    if request.node.get_closest_marker("multirank") is None:
        pytest.fail(f"fixture {kind!r} only exists in @pytest.mark.multirank tests", pytrace=False)
    return RankValue(kind)


def registry_sandbox_values(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The ``registry_sandbox`` fixture: a placeholder for spawned ranks, else a sandboxed registry."""
    controller = _controller(request.config)
    if not controller.torchrun and request.node.get_closest_marker("multirank") is not None:
        yield RankValue("registry_sandbox")
        return
    with registry_sandbox_context() as registry:
        yield registry
