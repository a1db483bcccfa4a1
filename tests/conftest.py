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
from physicsnemo_shardext.registry import PatchRegistry

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


def run_python(code: str, env: dict[str, str] | None = None, path: list[str] | None = None) -> subprocess.CompletedProcess:
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
