"""The pytest entry point (`physicsnemo_shardext_pytest`): light for projects that do not use it.

Each test runs an inner pytest in a fresh interpreter (``pytester.runpytest_subprocess``),
since what a session imports is only observable from a new process.
"""

from __future__ import annotations

import json

import pytest

HEAVY = ("torch", "physicsnemo", "physicsnemo_shardext")

# Written by the inner session at its end: the heavy modules it imported, and whether
# the entry point (and its implementation) was loaded at all.
CONFTEST = f"""
import json, sys

def pytest_sessionfinish(session):
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
    with open("modules.json", "w") as f:
        json.dump({{"heavy": heavy, "shim": "physicsnemo_shardext_pytest" in sys.modules}}, f)
"""


def _modules(pytester: pytest.Pytester) -> dict:
    return json.loads((pytester.path / "modules.json").read_text())


def test_a_project_that_does_not_use_the_plugin_imports_nothing_heavy(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_one="def test_one():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    found = _modules(pytester)
    assert found == {"heavy": [], "shim": True}, found


def test_the_marker_and_ini_values_are_declared_without_the_implementation(pytester: pytest.Pytester) -> None:
    loaded = pytester.runpytest_subprocess("--markers")
    assert any(line.startswith("@pytest.mark.multirank(n, timeout=None, seed=None)") for line in loaded.outlines)
    blocked = pytester.runpytest_subprocess("--markers", "-p", "no:shardext")
    assert not any("multirank" in line for line in blocked.outlines)
    help_text = pytester.runpytest_subprocess("--help").stdout.str()
    assert all(f"shardext_{name} (string)" in help_text for name in ("timeout", "grace", "startup_timeout"))


def test_a_multirank_test_loads_the_implementation_and_runs_on_its_ranks(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_inner="""
import pytest
import torch.distributed as dist
from physicsnemo_shardext.testing import split_cases

@pytest.mark.multirank(2)
def test_on_two_ranks(rank, world_size):
    assert world_size == 2 and dist.get_rank() == rank

@pytest.mark.parametrize("case", split_cases(17, 2, allow_empty=False))
def test_split_ids(case):
    assert sum(case) == 17
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", timeout=300)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_split_ids?balanced-9-8? PASSED*", "*test_split_ids?uneven-6-11? PASSED*"])
    assert "physicsnemo_shardext.testing.pytest_plugin" in _modules(pytester)["heavy"]


def test_a_fixture_requested_at_run_time_loads_the_implementation(pytester: pytest.Pytester) -> None:
    # No collected test names a multirank fixture: getfixturevalue reaches the entry point's fixture.
    pytester.makepyfile(
        test_inner="""
def test_sandbox(request):
    registry = request.getfixturevalue("registry_sandbox")
    assert registry is not None
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=1)


def test_the_implementation_loaded_on_its_own_brings_the_declarations(pytester: pytest.Pytester, monkeypatch) -> None:
    # The old entry point's module named with -p (or in pytest_plugins) still gives marker,
    # fixtures and ini values. Under torchrun with 3 ranks the 2-rank test is skipped: no pool.
    pytester.makeini("[pytest]\nshardext_timeout = 30\n")
    pytester.makepyfile(
        test_inner="""
import pytest

@pytest.mark.multirank(2)
def test_two(rank):
    pass

def test_sandbox(registry_sandbox, pytestconfig):
    assert registry_sandbox is not None and pytestconfig.getini("shardext_timeout") == "30"
"""
    )
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-p",
        "no:shardext",
        "-p",
        "physicsnemo_shardext.testing.pytest_plugin",
        "--strict-markers",
        "-rs",
        timeout=300,
    )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*multirank(2) test, but torchrun launched 3 ranks (WORLD_SIZE=3)*"])
