"""Every first-party patch family follows the house conventions, checked from the running code.

The families are the ``[project.entry-points.physicsnemo_shardext]`` table of
``pyproject.toml`` (what the loader installs), never a list kept here. Each
family gets one case per convention, so a new family that misses something fails
with the exact path or text that is missing ("family X: missing path Y"):

* its module ``patches/<name>.py`` (or, for a family split into modules by job, its
  package ``patches/<name>/__init__.py``) exists and imports;
* ``tests/patches/test_<name>.py`` exists;
* ``docs/patches/<name-with-hyphens>.md`` exists and is in the ``mkdocs.yml`` nav,
  or the family is in :data:`DOCUMENTED_ELSEWHERE` with the page that documents it;
* the module has ``__all__`` and its docstring a paragraph starting "Refused";
* it imports only ``physicsnemo_shardext`` and ``physicsnemo_shardext.primitives``
  from this project (and the shared ``shardext_requirements`` hook from
  ``physicsnemo_shardext.patches``): no other family, no framework submodule. The
  modules of a family package may import each other;
* it reads no ``._spec`` (the accessors ``mesh_of``, ``placements_of``,
  ``shard_shapes_of``, ``tensor_meta_of``, ``spec_of`` do) and reaches
  ``torch.distributed`` only for its public types (``Shard``, ``DTensor``,
  ``DeviceMesh``...), never for a raw collective (the named exchanges do), unless
  :data:`DTENSOR_INTERNALS` names the DTensor internals it patches; the example
  plugins under ``entry_points/`` are held to the same.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import tomllib
from collections.abc import Collection
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
    """``patches/<name>.py``, or ``patches/<name>/__init__.py`` where the family is a package."""
    module = FAMILIES[name]
    assert module.startswith(f"{PATCHES_PACKAGE}."), (
        f"family {name}: entry point {module} is not under {PATCHES_PACKAGE}"
    )
    base = REPO / "patches" / module.removeprefix(PATCHES_PACKAGE + ".").replace(".", "/")
    package = base / "__init__.py"
    return package if package.exists() else base.parent / f"{base.name}.py"


def _family_modules(name: str) -> list[tuple[str, Path]]:
    """(module name, path) of every module of the family: its one module, or each module of its package."""
    path = _module_path(name)
    if path.name != "__init__.py":
        return [(FAMILIES[name], path)]
    found = []
    for file in sorted(path.parent.rglob("*.py")):
        parts = file.relative_to(path.parent).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        found.append((".".join((FAMILIES[name], *parts)), file))
    return found


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
    stem = path.parent.name if path.name == "__init__.py" else path.stem
    assert stem == name, f"family {name}: module {path.relative_to(REPO)} is not named after the family"
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


def _project_imports(tree: ast.Module, module: str, is_package: bool = False) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import from this project (name ``None`` for ``import m``).

    Relative imports are resolved against ``module``'s package (``module`` itself where it is
    a package's ``__init__``).
    """
    package = module if is_package else module.rpartition(".")[0]
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
    family = FAMILIES[name]
    bad = []
    for module, path in _family_modules(name):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, imported, member in _project_imports(tree, module, is_package=path.name == "__init__.py"):
            if imported == family or imported.startswith(f"{family}."):
                continue  # the modules of one family package import each other
            if (why := _refusal(imported, member)) is not None:
                bad.append((path.relative_to(REPO), line, why))
    assert not bad, (
        f"family {name}: imports {', '.join(f'{why} ({path} line {line})' for path, line, why in bad)}; import from "
        "physicsnemo_shardext or physicsnemo_shardext.primitives only (no other family, no framework submodule)"
    )


#: Modules of ``torch.distributed`` whose public names (their ``__all__``) are vocabulary types, not collectives.
PUBLIC_DISTRIBUTED = (
    "torch.distributed.tensor",
    "torch.distributed.tensor.placement_types",
    "torch.distributed.device_mesh",
)

#: family -> the DTensor internals it exists to patch (and must agree with), imported by name; each needs its reason.
DTENSOR_INTERNALS: dict[str, set[tuple[str, str]]] = {
    # Wraps `redistribute_local_tensor` in the three modules that bind it, and reads torch.chunk's local
    # shape with DTensor's own function so that its check agrees with DTensor's redistribution exactly.
    "uneven_redistribute": {
        ("torch.distributed.tensor", "_api"),
        ("torch.distributed.tensor", "_dispatch"),
        ("torch.distributed.tensor", "_redistribute"),
        ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    },
}


def _type_checking_imports(tree: ast.Module) -> set[int]:
    """``id`` of every import under ``if TYPE_CHECKING:`` (type hints only: nothing runs)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skipped


def _distributed_refusal(imported: str, name: str | None, allowed: Collection[tuple[str, str]]) -> str | None:
    """Why importing ``name`` from ``imported`` (``None``: ``import imported``) reaches past the vocabulary."""
    if imported != "torch.distributed" and not imported.startswith("torch.distributed."):
        return None
    if name is not None and (imported, name) in allowed:
        return None
    if name is not None and imported in PUBLIC_DISTRIBUTED:
        if name in importlib.import_module(imported).__all__:
            return None
        return f"{imported}.{name} (not in {imported}.__all__)"
    if name in ("tensor", "device_mesh") and imported == "torch.distributed":
        return None
    return f"import {imported}" if name is None else f"{imported}.{name}"


def _past_the_vocabulary(path: Path, allowed: Collection[tuple[str, str]] = ()) -> list[str]:
    """Where ``path`` reads a ShardTensor's private ``._spec`` or reaches ``torch.distributed`` past its public types.

    Refused: any ``._spec`` attribute (read the spec with ``mesh_of``, ``placements_of``,
    ``shard_shapes_of``, ``tensor_meta_of``; pass it on with ``spec_of``); ``import torch.distributed``
    in any form and ``torch.distributed.<name>`` in code (raw collectives: use the named exchanges of
    ``physicsnemo_shardext.primitives``); a private module or name of ``torch.distributed``. Allowed:
    the public names of :data:`PUBLIC_DISTRIBUTED` (``Shard``, ``Replicate``, ``DTensor``,
    ``DeviceMesh``...), imports under ``if TYPE_CHECKING:``, and the ``allowed`` pairs.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    hints = _type_checking_imports(tree)
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if id(node) in hints:
            continue
        whys: list[str | None] = []
        if isinstance(node, ast.Attribute) and node.attr == "_spec":
            whys = ["._spec"]
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.distributed":
            whys = [None if node.attr in ("tensor", "device_mesh") else f"torch.distributed.{node.attr}"]
        elif isinstance(node, ast.Import):
            whys = [_distributed_refusal(alias.name, None, allowed) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            whys = [_distributed_refusal(node.module or "", alias.name, allowed) for alias in node.names]
        found += [(node.lineno, node.col_offset, f"{why} (line {node.lineno})") for why in whys if why is not None]
    return [text for _, _, text in sorted(found)]


def test_the_vocabulary_check_sees_spec_reads_and_raw_collectives(tmp_path):
    source = tmp_path / "family.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed import ReduceOp\n"
        "from torch.distributed.tensor import Shard, Replicate, _api\n"
        "from torch.distributed.device_mesh import DeviceMesh\n"
        "if TYPE_CHECKING:\n"
        "    from torch.distributed.tensor._dtensor_spec import DTensorSpec\n"
        "def f(x):\n"
        "    torch.distributed.all_reduce(x._spec.mesh)\n"
        "    return torch.distributed.tensor.Shard(0)\n"
    )
    refused = [
        "import torch.distributed (line 3)",
        "torch.distributed.ReduceOp (line 4)",
        "torch.distributed.tensor._api (not in torch.distributed.tensor.__all__) (line 5)",
        "torch.distributed.all_reduce (line 10)",
        "._spec (line 10)",
    ]
    assert _past_the_vocabulary(source) == refused
    # A family's declared DTensor internals pass; nothing else does.
    assert _past_the_vocabulary(source, {("torch.distributed.tensor", "_api")}) == refused[:2] + refused[3:]


def test_dtensor_internals_name_real_families():
    stale = sorted(set(DTENSOR_INTERNALS) - set(FAMILIES))
    assert not stale, f"DTENSOR_INTERNALS lists families that are not entry points: {stale}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_reads_no_spec_and_calls_no_raw_collective(name):
    found = [
        f"{path.relative_to(REPO)}: {where}"
        for _, path in _family_modules(name)
        for where in _past_the_vocabulary(path, DTENSOR_INTERNALS.get(name, set()))
    ]
    assert not found, (
        f"family {name}: reaches past the handler vocabulary at {'; '.join(found)}; read the spec with "
        "mesh_of / placements_of / shard_shapes_of / tensor_meta_of (spec_of to pass it on) and exchange with the "
        "named primitives (all_reduce_sum, max_over, all_gather_rows, ...) of physicsnemo_shardext.primitives"
    )


def _example_plugin_modules() -> list[Path]:
    return sorted(
        path
        for path in (REPO / "entry_points").glob("*/src/**/*.py")
        if not any(part.endswith(".egg-info") for part in path.parts)
    )


def test_example_plugins_are_found():
    assert any(path.name == "clamp.py" for path in _example_plugin_modules())


@pytest.mark.parametrize("path", _example_plugin_modules(), ids=lambda p: str(p.relative_to(REPO / "entry_points")))
def test_example_plugin_reads_no_spec_and_calls_no_raw_collective(path):
    found = _past_the_vocabulary(path)
    assert not found, (
        f"{path.relative_to(REPO)}: reaches past the handler vocabulary at {'; '.join(found)}; a third-party "
        "plugin learns from this one: use the accessors and exchanges of physicsnemo_shardext.primitives"
    )


def test_the_scaffold_template_reads_no_spec_and_calls_no_raw_collective(tmp_path):
    # What `shardext new` writes is the first patch many authors see: it teaches the same vocabulary.
    from physicsnemo_shardext.tools.scaffold import write_plugin

    write_plugin("shardext-vocabulary-probe", tmp_path / "probe")
    written = sorted((tmp_path / "probe").rglob("*.py"))
    assert any(path.name == "patches.py" for path in written)
    found = [f"{path.relative_to(tmp_path)}: {where}" for path in written for where in _past_the_vocabulary(path)]
    assert not found, f"the plugin template reaches past the handler vocabulary at {'; '.join(found)}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_states_the_physicsnemo_versions_it_relies_on(name):
    # One range for every family (patches/__init__.py); a family with more needs declares its own.
    from physicsnemo_shardext.patches import PHYSICSNEMO_DISTRIBUTION, PHYSICSNEMO_REQUIREMENT

    module = importlib.import_module(FAMILIES[name])
    hook = getattr(module, "shardext_requirements", None)
    assert hook is not None, (
        f"family {name}: missing shardext_requirements (import the shared one from the patches package)"
    )
    assert hook().get(PHYSICSNEMO_DISTRIBUTION) == PHYSICSNEMO_REQUIREMENT, (
        f"family {name}: requires {hook()} instead of the shared {PHYSICSNEMO_DISTRIBUTION}{PHYSICSNEMO_REQUIREMENT}"
    )
