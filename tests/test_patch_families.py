"""Every first-party patch family follows the house conventions, checked from the running code.

The families are the ``[project.entry-points.physicsnemo_shardext]`` table of
``pyproject.toml`` (what the loader installs), never a list kept here. Each
family gets one case per convention, so a new family that misses something fails
with the exact path or text that is missing ("family X: missing path Y"):

* its module ``patches/<name>.py`` exists and imports;
* ``tests/patches/test_<name>.py`` exists;
* ``docs/patches/<name-with-hyphens>.md`` exists and is in the ``mkdocs.yml`` nav,
  or the family is in :data:`DOCUMENTED_ELSEWHERE` with the page that documents it;
* the module has ``__all__`` and its docstring a paragraph starting "Refused";
* it imports only ``physicsnemo_shardext`` and ``physicsnemo_shardext.primitives``
  from this project (and the shared ``shardext_requirements`` hook from
  ``physicsnemo_shardext.patches``): no other family, no framework submodule.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PATCHES_PACKAGE = "physicsnemo_shardext.patches"

#: Families without a page of their own -> the page (under docs/) that documents them.
DOCUMENTED_ELSEWHERE: dict[str, str] = {
    "pointwise": "patches/index.md",
}

#: What a family may import from this project (from the patches package: only its `__all__`, the shared
#: `shardext_requirements` hook; never another family).
ALLOWED_IMPORTS = {"physicsnemo_shardext", "physicsnemo_shardext.primitives", "physicsnemo_shardext.patches"}


def _families() -> dict[str, str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return dict(pyproject["project"]["entry-points"]["physicsnemo_shardext"])


def _nav_pages(node: object) -> set[str]:
    if isinstance(node, str):
        return {node}
    if isinstance(node, list):
        return set().union(*(_nav_pages(item) for item in node)) if node else set()
    if isinstance(node, dict):
        return set().union(*(_nav_pages(value) for value in node.values())) if node else set()
    return set()


FAMILIES = _families()
NAV = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])


def _module_path(name: str) -> Path:
    module = FAMILIES[name]
    assert module.startswith(f"{PATCHES_PACKAGE}."), f"family {name}: entry point {module} is not under {PATCHES_PACKAGE}"
    return REPO / "patches" / f"{module.removeprefix(PATCHES_PACKAGE + '.').replace('.', '/')}.py"


def _tree(name: str) -> ast.Module:
    return ast.parse(_module_path(name).read_text(), filename=str(_module_path(name)))


def _docs_page(name: str) -> str:
    return DOCUMENTED_ELSEWHERE.get(name, f"patches/{name.replace('_', '-')}.md")


def test_families_are_read_from_the_entry_point_table():
    assert {"pointwise", "convolution", "layout_ops"} <= set(FAMILIES)


def test_exemptions_name_real_families_without_a_page():
    stale = sorted(set(DOCUMENTED_ELSEWHERE) - set(FAMILIES))
    assert not stale, f"DOCUMENTED_ELSEWHERE lists families that are not entry points: {stale}"
    own = sorted(n for n in DOCUMENTED_ELSEWHERE if (REPO / "docs" / "patches" / f"{n.replace('_', '-')}.md").exists())
    assert not own, f"DOCUMENTED_ELSEWHERE lists families that now have their own page: {own}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_module_exists_and_imports(name):
    path = _module_path(name)
    assert path.exists(), f"family {name}: missing path {path.relative_to(REPO)}"
    assert path.stem == name, f"family {name}: module {path.relative_to(REPO)} is not named after the family"
    importlib.import_module(FAMILIES[name])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_has_a_test_file(name):
    path = REPO / "tests" / "patches" / f"test_{name}.py"
    assert path.exists(), f"family {name}: missing path {path.relative_to(REPO)}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_has_a_docs_page_in_the_nav(name):
    page = _docs_page(name)
    assert (REPO / "docs" / page).exists(), f"family {name}: missing path docs/{page}"
    assert page in NAV, f"family {name}: missing nav entry {page} in mkdocs.yml"
    if name in DOCUMENTED_ELSEWHERE:
        text = (REPO / "docs" / page).read_text()
        assert f"`{name}`" in text, f"family {name}: docs/{page} does not mention `{name}`"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_declares_all_and_what_it_refuses(name):
    module = importlib.import_module(FAMILIES[name])
    assert isinstance(getattr(module, "__all__", None), (list, tuple)), f"family {name}: missing __all__"
    missing = sorted(set(module.__all__) - set(vars(module)))
    assert not missing, f"family {name}: __all__ names missing attributes {missing}"
    paragraphs = inspect.cleandoc(module.__doc__ or "").split("\n\n")
    assert any(p.strip().startswith("Refused") for p in paragraphs), (
        f'family {name}: missing a docstring paragraph starting "Refused" (what raises MissingShardPatch, and why)'
    )


def _project_imports(tree: ast.Module, module: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import from this project (name ``None`` for ``import m``).

    Relative imports are resolved against ``module``'s package.
    """
    package = module.rpartition(".")[0]
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                source = f"{base}.{source}" if source else base
            found += [(node.lineno, source, alias.name) for alias in node.names]
    return [item for item in found if item[1].split(".")[0] == "physicsnemo_shardext"]


def _refusal(imported: str, name: str | None) -> str | None:
    """Why this import breaks the rule, or ``None`` if it is allowed."""
    if imported not in ALLOWED_IMPORTS:
        return imported
    if name is None:
        return None
    # ``from physicsnemo_shardext import registry`` would reach a submodule all the same.
    public = importlib.import_module(imported).__all__
    return None if name in public else f"{imported}.{name} (not in {imported}.__all__)"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_imports_only_the_public_vocabulary(name):
    bad = [
        (line, why)
        for line, imported, member in _project_imports(_tree(name), FAMILIES[name])
        if (why := _refusal(imported, member)) is not None
    ]
    assert not bad, (
        f"family {name}: imports {', '.join(f'{why} (line {line})' for line, why in bad)}; import from "
        "physicsnemo_shardext or physicsnemo_shardext.primitives only (no other family, no framework submodule)"
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_states_the_physicsnemo_versions_it_relies_on(name):
    # One range for every family (patches/__init__.py); a family with more needs declares its own.
    from physicsnemo_shardext.patches import PHYSICSNEMO_DISTRIBUTION, PHYSICSNEMO_REQUIREMENT

    module = importlib.import_module(FAMILIES[name])
    hook = getattr(module, "shardext_requirements", None)
    assert hook is not None, f"family {name}: missing shardext_requirements (import the shared one from the patches package)"
    assert hook().get(PHYSICSNEMO_DISTRIBUTION) == PHYSICSNEMO_REQUIREMENT, (
        f"family {name}: requires {hook()} instead of the shared {PHYSICSNEMO_DISTRIBUTION}{PHYSICSNEMO_REQUIREMENT}"
    )
