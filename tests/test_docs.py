"""The documentation site stays in step with the code, and builds without warnings.

Each reference page has a counterpart in the code: a hook needs a ``:::``
entry in ``docs/reference/hooks.md``, a ``SHARDEXT_*`` variable needs a row
in ``docs/reference/environment.md``, and a ``shardext`` subcommand needs a
section in ``docs/reference/cli.md``. Adding one to the code without
documenting it fails here. The last test runs ``mkdocs build --strict``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import physicsnemo_shardext.hookspecs as hookspecs
from physicsnemo_shardext.markers import PROJECT_NAME
from physicsnemo_shardext.settings import ENVIRONMENT_VARIABLES
from physicsnemo_shardext.tools.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
SPEC_ATTRIBUTE = f"{PROJECT_NAME}_spec"  # set by pluggy's HookspecMarker


def _hookspec_names() -> list[str]:
    return sorted(
        name for name, member in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(member, SPEC_ATTRIBUTE)
    )


def _subcommands() -> list[str]:
    parser = build_parser()
    names: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names.extend(action.choices)
    return sorted(names)


def _page(relative: str) -> str:
    return (DOCS / relative).read_text(encoding="utf-8")


def test_hookspecs_are_discovered() -> None:
    # Guard against the checks below passing vacuously.
    assert {"shardext_requirements", "shardext_declare_patches"} <= set(_hookspec_names())


@pytest.mark.parametrize("hook", _hookspec_names())
def test_every_hook_has_a_reference_entry(hook: str) -> None:
    entry = re.compile(rf"^:::\s+physicsnemo_shardext\.hookspecs\.{re.escape(hook)}\s*$", re.MULTILINE)
    assert entry.search(_page("reference/hooks.md")), (
        f"hook {hook!r} has no '::: physicsnemo_shardext.hookspecs.{hook}' entry in docs/reference/hooks.md"
    )


@pytest.mark.parametrize("variable", sorted(ENVIRONMENT_VARIABLES))
def test_every_environment_variable_is_documented(variable: str) -> None:
    text = _page("reference/environment.md")
    assert re.search(rf"\b{re.escape(variable)}\b", text), f"{variable} is missing from docs/reference/environment.md"
    row = re.compile(rf"^\|\s*`{re.escape(variable)}`\s*\|", re.MULTILINE)
    assert row.search(text), f"{variable} has no row in the table of docs/reference/environment.md"


def test_subcommands_are_discovered() -> None:
    assert {"list", "doctor"} <= set(_subcommands())


@pytest.mark.parametrize("command", _subcommands())
def test_every_cli_subcommand_is_documented(command: str) -> None:
    text = _page("reference/cli.md")
    assert re.search(rf"\bshardext {re.escape(command)}\b", text), (
        f"'shardext {command}' is missing from docs/reference/cli.md"
    )


def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    # The docs extra is part of the test environment (.ci/setup): a missing one fails, never skips.
    import mkdocs  # noqa: F401
    import mkdocstrings  # noqa: F401

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
