"""The typed surface: ``mypy --strict`` is clean on the public API and the example plugin.

The files checked are the ``files`` of ``[tool.mypy]`` in ``pyproject.toml``: every
module the package docstring calls public (the plugin-author surface at the top of the
package, ``primitives/``, ``testing/``, ``training/`` and the old paths that re-export
it), the torch-free entry points, the tools behind ``shardext verify`` and ``shardext
new``, and the template plugin's ``src``. Imports are followed silently, so only our own
code is reported on; PhysicsNeMo ships no type information and its names are ``Any``.
The pre-commit hook of ``.pre-commit-config.yaml`` runs the same command.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The public API that must stay typed: the package docstring's public modules (a directory
#: covers every module under it) and the example plugin.
PUBLIC_API = {
    "physicsnemo_shardext/__init__.py",
    "physicsnemo_shardext/comparison.py",
    "physicsnemo_shardext/declarations.py",
    "physicsnemo_shardext/errors.py",
    "physicsnemo_shardext/hookspecs.py",
    "physicsnemo_shardext/markers.py",
    "physicsnemo_shardext/settings.py",
    "physicsnemo_shardext/shard_registries.py",
    "physicsnemo_shardext/targets.py",
    "physicsnemo_shardext/torch_support.py",
    "physicsnemo_shardext/parallel.py",
    "physicsnemo_shardext/verification.py",
    "physicsnemo_shardext/primitives/",
    "physicsnemo_shardext/testing/",
    "physicsnemo_shardext/training/",
    "physicsnemo_shardext_cli.py",
    "physicsnemo_shardext_pytest.py",
    "entry_points/shardext-example-plugin/src/shardext_example_plugin",
}


#: ``python -m`` these: the command this test and the pre-commit hook run.
MYPY_ARGS = ("mypy", "--strict", "--config-file", "pyproject.toml", "--no-error-summary")


def _mypy_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]


def _covered(path: str, files: list[str]) -> bool:
    """Whether mypy checks ``path``: listed itself, or under a listed directory."""
    return any(path == entry or (entry.endswith("/") and path.startswith(entry)) for entry in files)


def test_mypy_checks_the_whole_public_api_strictly():
    config = _mypy_config()
    assert config.get("strict") is True
    missing = {path for path in PUBLIC_API if not _covered(path, config["files"])}
    assert not missing, f"[tool.mypy] files: missing {sorted(missing)}"
    for path in config["files"]:
        assert (REPO / path).exists(), f"[tool.mypy] files: missing path {path}"


def test_public_api_is_mypy_strict_clean():
    result = subprocess.run(
        [sys.executable, "-m", *MYPY_ARGS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, f"mypy --strict reports errors (exit {result.returncode}):\n{output}"


def test_the_pre_commit_hook_runs_the_same_mypy_command():
    config = (REPO / ".pre-commit-config.yaml").read_text(encoding="utf-8")
    assert f"entry: .venv/bin/python -m {' '.join(MYPY_ARGS)}\n" in config
