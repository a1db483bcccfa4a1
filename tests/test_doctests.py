"""Run every docstring example of the package, so documentation cannot drift.

Modules are discovered, not listed. Framework modules run in this process;
``primitives`` and the first-party ``patches`` run on 2 gloo ranks, where each
example sees ``mesh`` (a 1-D device mesh over the 2 ranks) and ``rank``.
Every module must have at least one runnable example unless it is exempted
below with the reason.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import io
import pkgutil
import re

import pytest

import physicsnemo_shardext

#: Modules whose examples need ranks: they run under ``multirank(2)``.
MULTIRANK_PREFIXES = ("physicsnemo_shardext.primitives", "physicsnemo_shardext.patches")

#: Modules not imported here at all (importing them has effects of their own).
NOT_IMPORTED = {
    "physicsnemo_shardext.__main__": "runs the command line when imported",
}

#: Modules allowed to have no runnable example, and why.
NO_EXAMPLES_NEEDED: dict[str, str] = {
    "physicsnemo_shardext.testing.delegation": (
        "every helper needs a multi-rank process and a plugin to switch off; its examples are "
        "fenced test code, run by tests/testing/test_delegation.py"
    ),
}


def _discover() -> list[str]:
    # ``patches/`` installs as ``physicsnemo_shardext.patches`` from its own directory
    # (pyproject's package-dir), so it is walked from its own path.
    patches = importlib.import_module("physicsnemo_shardext.patches")
    # The pytest entry point is a top-level module of the distribution (pyproject's py-modules).
    names = {physicsnemo_shardext.__name__, patches.__name__, "physicsnemo_shardext_pytest"}
    for package in (physicsnemo_shardext, patches):
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            names.add(info.name)
    return sorted(names - set(NOT_IMPORTED))


MODULES = _discover()
SINGLE_PROCESS = [m for m in MODULES if not m.startswith(MULTIRANK_PREFIXES)]
MULTIRANK = [m for m in MODULES if m.startswith(MULTIRANK_PREFIXES)]


def _run_examples(name: str, extraglobs: dict | None = None) -> tuple[int, int, str]:
    """(attempted, failed, report) of the docstring examples of module ``name``."""
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    for test in finder.find(module, name, extraglobs=extraglobs):
        runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    return result.attempted, result.failed, report.getvalue()


def _check(name: str, extraglobs: dict | None = None) -> None:
    attempted, failed, report = _run_examples(name, extraglobs)
    assert failed == 0, f"{name}: {failed} of {attempted} docstring examples failed:\n{report}"
    if name not in NO_EXAMPLES_NEEDED:
        assert attempted > 0, f"{name} has no runnable docstring example (add one, or exempt it with a reason)"


def test_discovery_sees_the_patches_and_primitives():
    assert "physicsnemo_shardext.primitives.layout" in MULTIRANK
    assert "physicsnemo_shardext.patches.pointwise" in MULTIRANK
    assert "physicsnemo_shardext.engine.registry" in SINGLE_PROCESS


def test_exemptions_name_real_modules():
    assert set(NO_EXAMPLES_NEEDED) <= set(MODULES), set(NO_EXAMPLES_NEEDED) - set(MODULES)


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_docstring_examples(name, registry_snapshot):
    _check(name)


@pytest.mark.multirank(2, timeout=180)
@pytest.mark.parametrize("name", MULTIRANK)
def test_docstring_examples_on_two_ranks(name, domain_mesh, rank):
    _check(name, {"mesh": domain_mesh, "rank": rank})


#: What the one docstring style (Google sections, Markdown, doctests under ``Examples:``) rules out.
FOREIGN_STYLE = {
    "a reST role (write `name` in backticks)": re.compile(r":(?:py:)?[a-z]+:`[^`]+`"),
    "a reST literal block `::` (use a fenced block under Examples:)": re.compile(r"::[ \t]*$", re.MULTILINE),
    "a singular `Example:` header (write Examples:)": re.compile(r"^[ \t]*Example:[ \t]*$", re.MULTILINE),
    "a `>>>` block outside an Examples: section": re.compile(r"(?:\A|\n\n)>>>"),
}


def _docstrings(name: str) -> list[tuple[str, str]]:
    module = importlib.import_module(name)
    tree = ast.parse(inspect.getsource(module))
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return [(getattr(n, "name", name), doc) for n in nodes if (doc := ast.get_docstring(n))]


@pytest.mark.parametrize("name", MODULES)
def test_docstrings_use_the_one_style(name):
    # The site renders docstrings with griffe's Google parser and no rewriting, so a
    # foreign construct shows up as literal text (or fails `mkdocs build --strict`).
    found = [
        f"{owner}: {what}"
        for owner, doc in _docstrings(name)
        for what, pattern in FOREIGN_STYLE.items()
        if pattern.search(doc)
    ]
    assert not found, f"{name}: " + "; ".join(found)
