"""The typed surface: ``mypy --strict`` is clean on the public API and the example plugin.

The files checked are the ``files`` of ``[tool.mypy]`` in ``pyproject.toml`` (the
package front door, declarations, hook specifications, markers, errors, settings,
the handler primitives, and the template plugin's ``src``). Imports are followed
silently, so only our own code is reported on; PhysicsNeMo ships no type
information and its names are ``Any``.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The public API that must stay typed, as the issue names it.
PUBLIC_API = {
    "physicsnemo_shardext/__init__.py",
    "physicsnemo_shardext/declarations.py",
    "physicsnemo_shardext/hookspecs.py",
    "physicsnemo_shardext/markers.py",
    "physicsnemo_shardext/errors.py",
    "physicsnemo_shardext/settings.py",
    "physicsnemo_shardext/primitives/__init__.py",
    "physicsnemo_shardext/primitives/arguments.py",
    "physicsnemo_shardext/primitives/graph.py",
    "physicsnemo_shardext/primitives/reductions.py",
    "physicsnemo_shardext/primitives/checks.py",
    "physicsnemo_shardext/primitives/layout.py",
    "entry_points/shardext-example-plugin/src/shardext_example_plugin",
}


def _mypy_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]


def test_mypy_checks_the_whole_public_api_strictly():
    config = _mypy_config()
    assert config.get("strict") is True
    missing = PUBLIC_API - set(config["files"])
    assert not missing, f"[tool.mypy] files: missing {sorted(missing)}"
    for path in config["files"]:
        assert (REPO / path).exists(), f"[tool.mypy] files: missing path {path}"


def test_public_api_is_mypy_strict_clean():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", "pyproject.toml", "--no-error-summary"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, f"mypy --strict reports errors (exit {result.returncode}):\n{output}"
