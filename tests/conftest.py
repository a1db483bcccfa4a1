"""Shared fixtures of the project's own test-suite."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import physicsnemo_shardext
from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.engine.registry import PatchRegistry

# pytester drives inner pytest runs in tests/testing/test_pytest_plugin.py.
pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pristine_registries() -> Iterator[shard_registries.RegistrySnapshot]:
    """PhysicsNeMo's built-ins only: the autoloaded plugins are switched off for the test.

    The framework's tests declare sample patches for ops (``torch.roll``, ``torch.cumsum``
    ...) that first-party families also patch; they test the mechanism, so they start
    from the built-in registries. Everything is restored afterwards.
    """
    registry = physicsnemo_shardext.get_registry()
    autoloaded = [report.plugin.name for report in registry.reports()]
    with registry.disabled(plugins=autoloaded):
        before = shard_registries.snapshot()
        try:
            yield before
        finally:
            shard_registries.restore(before)


@pytest.fixture
def registry_snapshot() -> Iterator[shard_registries.RegistrySnapshot]:
    """Snapshot ShardTensor's registries (autoloaded plugins included) and restore them after the test."""
    before = shard_registries.snapshot()
    try:
        yield before
    finally:
        shard_registries.restore(before)


@pytest.fixture
def fresh_registry(pristine_registries: shard_registries.RegistrySnapshot) -> PatchRegistry:
    """A private PatchRegistry over sandboxed ShardTensor registries."""
    return PatchRegistry()


def run_python(
    code: str, env: dict[str, str] | None = None, path: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (import-time behaviour needs a new process)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDEXT_")}
    full_env.update(env or {})
    if path:
        full_env["PYTHONPATH"] = os.pathsep.join(path + [full_env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300, check=False
    )


@pytest.fixture
def python_runner():
    """The :func:`run_python` helper, as a fixture."""
    return run_python


# -- long cells -------------------------------------------------------------------------------
# CI runs a representative subset; `pytest --run-slow` (or SHARDEXT_RUN_SLOW=1) runs every cell.
# Slow cells are deselected, not skipped, so a skip in the summary always means a missing
# capability (a GPU), never a cell left out on purpose; the count left out is printed.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run cells marked slow")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a long cell, deselected unless --run-slow or SHARDEXT_RUN_SLOW=1")


def _run_slow(config: pytest.Config) -> bool:
    return bool(config.getoption("--run-slow")) or os.environ.get("SHARDEXT_RUN_SLOW", "") not in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _run_slow(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config._shardext_slow_deselected = len(slow)  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    left_out = getattr(config, "_shardext_slow_deselected", 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} slow cells deselected; run them with --run-slow (see README)")
