"""Shared fixtures of the project's own test-suite."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.registry import PatchRegistry

# pytester drives inner pytest runs in tests/testing/test_pytest_plugin.py.
pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pristine_registries() -> Iterator[shard_registries.RegistrySnapshot]:
    """Snapshot ShardTensor's registries before the test and restore them after it."""
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
