"""Every framework module has its test file: ``tests/`` mirrors ``physicsnemo_shardext/``.

``physicsnemo_shardext/X.py`` is tested in ``tests/test_X.py`` and
``physicsnemo_shardext/WING/X.py`` in ``tests/WING/test_X.py`` for every wing
(``engine``, ``primitives``, ``ranks``, ``testing``, ``tools``, ``training``; a package's
``__init__.py`` in ``test_init.py``). Modules are discovered from the file system;
a module tested elsewhere is listed below with where, so a new module without
tests fails here by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "physicsnemo_shardext"
TESTS = REPO / "tests"

#: Sub-packages mirrored under ``tests/``; the package's top level mirrors to ``tests/`` itself.
MIRRORED_PACKAGES = ("", "engine", "primitives", "ranks", "testing", "tools", "training")

#: Modules (path relative to the package) without a mirrored test file, and where they are tested.
TESTED_ELSEWHERE: dict[str, str] = {
    "__main__.py": "a short entry point; tests/tools/test_cli.py runs `python -m physicsnemo_shardext`",
    "engine/__init__.py": "the wing's map (docstring, no code); its doctest runs in tests/test_doctests.py",
    "engine/discovery.py": "entry points, identities, name clashes; tests/engine/test_loader.py (name clash tests)",
    "engine/hook_checks.py": "hook and declaration messages; tests/engine/test_loader.py (unmarked hooks, undeclared patches)",
    "engine/baseline.py": "the built-in patches; tests/engine/test_registry.py and tests/patches/* (builtin_handler)",
    "engine/provenance.py": "report and record dataclasses; tests/engine/test_registry.py, tests/engine/test_loader.py",
    "engine/trace.py": "SHARDEXT_TRACE wrappers; tests/engine/test_registry.py (trace mode) and tests/tools/test_cli.py",
    "errors.py": "exception classes only; raised and matched throughout tests/",
    "hookspecs.py": "hook specifications; tests/test_docs.py (documented) and tests/engine/test_loader.py (called)",
    "markers.py": "the pluggy markers and project name; tests/test_docs.py and every plugin test",
    "parallel.py": "the old import path of training/parallel.py (re-exports); its doctest checks the names",
    "primitives/__init__.py": "re-exports only; every tests/primitives/* and tests/patches/* test imports it",
    "primitives/delegation.py": "delegate/fallback; tests/engine/test_registry.py and tests/testing/test_delegation.py",
    "ranks/__init__.py": "the wing's map (docstring, no code); its doctest runs in tests/test_doctests.py",
    "ranks/worker.py": "the rank process; every @pytest.mark.multirank test, tests/testing/test_pytest_plugin.py",
    "ranks/worker_pool.py": "rank processes kept across tests; tests/testing/test_pytest_plugin.py",
    "testing/__init__.py": "lazy re-exports; every test importing physicsnemo_shardext.testing",
    "testing/isolation.py": "per-test sandbox and seeding; tests/testing/test_pytest_plugin.py",
    "testing/placeholders.py": "multirank fixture values; tests/testing/test_pytest_plugin.py",
    "testing/plugin_packages.py": "throwaway plugin distributions; tests/test_init.py, tests/engine/test_loader.py",
    "tools/__init__.py": "the wing's map (docstring, no code); its doctest runs in tests/test_doctests.py",
    "tools/inventory.py": "what `shardext list`/`doctor` print; tests/tools/test_cli.py",
    "training/__init__.py": "the wing's map (docstring, no code); its doctest runs in tests/test_doctests.py",
    "verification.py": "the old import path of training/verification.py (re-exports); its doctest checks the names",
}


def _modules() -> list[str]:
    found = []
    for package in MIRRORED_PACKAGES:
        for path in sorted((PACKAGE / package).glob("*.py")):
            found.append(path.relative_to(PACKAGE).as_posix())
    return found


def _mirror(module: str) -> Path:
    path = Path(module)
    stem = "init" if path.stem == "__init__" else path.stem
    return TESTS / path.parent / f"test_{stem}.py"


MODULES = _modules()


def test_discovery_sees_every_mirrored_package():
    assert {"engine/registry.py", "primitives/layout.py", "ranks/watchdog.py", "testing/sharding.py"} <= set(MODULES)


def test_exemptions_name_real_modules_without_a_mirror():
    stale = sorted(set(TESTED_ELSEWHERE) - set(MODULES))
    assert not stale, f"TESTED_ELSEWHERE lists modules that do not exist: {stale}"
    mirrored = sorted(m for m in TESTED_ELSEWHERE if _mirror(m).exists())
    assert not mirrored, f"TESTED_ELSEWHERE lists modules that now have their own test file: {mirrored}"


@pytest.mark.parametrize("module", MODULES)
def test_module_has_a_test_file(module):
    if module in TESTED_ELSEWHERE:
        return
    expected = _mirror(module)
    assert expected.exists(), (
        f"module physicsnemo_shardext/{module}: missing path {expected.relative_to(REPO)} "
        "(or list it in TESTED_ELSEWHERE with where it is tested)"
    )
