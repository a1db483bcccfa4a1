"""``shardext new``: write a complete plugin distribution to start a patch from.

`write_plugin` renders the templates in ``physicsnemo_shardext/tools/plugin-template/``
into a new directory: a ``pyproject.toml`` publishing the plugin under the
``physicsnemo_shardext`` entry-point group, a hook module with both hooks and one
working handler (``F.hardtanh`` on the local block, in the house style), its
multi-rank tests (conformance on uneven shards and on a 2-D mesh, refusals,
delegation, docstring examples), a README and a ``ci.sh``. ``pip install -e``
of the result and its tests pass as generated; the tree is shown in
``docs/reference/cli.md``.

One name gives the three names a plugin has: the distribution (as typed), the
import package (lower case, ``-`` and ``.`` become ``_``) and the plugin, the
entry-point name users type in ``SHARDEXT_DISABLE`` (the distribution's
normalized form). A name is refused (`ScaffoldError`) when it is not a valid
distribution name, gives no valid module name, would shadow a module Python
already finds, or is already taken by a first-party family, an installed
distribution or another plugin.

This module imports neither torch nor PhysicsNeMo: ``shardext new`` answers
without them.

Examples:
    >>> names = plugin_names("shardext-hardtanh")
    >>> names.distribution, names.module, names.plugin
    ('shardext-hardtanh', 'shardext_hardtanh', 'shardext-hardtanh')
    >>> plugin_names("2d-stencil")
    Traceback (most recent call last):
    ...
    physicsnemo_shardext.tools.scaffold.ScaffoldError: '2d-stencil' gives the module name '2d_stencil', which is not a Python identifier; start the name with a letter
    >>> sorted(render_plugin(names))
    ['.gitignore', 'README.md', 'ci.sh', 'pyproject.toml', 'src/shardext_hardtanh/__init__.py', 'src/shardext_hardtanh/patches.py', 'tests/test_patches.py']
"""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from importlib.resources.abc import Traversable
from pathlib import Path

from physicsnemo_shardext.markers import DISTRIBUTION_NAME, PROJECT_NAME
from physicsnemo_shardext.settings import RENAMED_PLUGINS

__all__ = [
    "FILE_NOTES",
    "PluginNames",
    "ScaffoldError",
    "ScaffoldResult",
    "format_tree",
    "next_steps",
    "plugin_names",
    "render_plugin",
    "write_plugin",
]

#: PEP 508 distribution names (case-insensitive).
_DISTRIBUTION = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")

#: Names shown by ``shardext list`` as providers that are not plugins.
_PROVIDER_LABELS = frozenset({"physicsnemo", "external"})

#: Placeholders in the templates: ``{{name}}``.
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

#: The directory segment of the templates replaced by the module name.
_MODULE_SEGMENT = "__module__"

#: Templates stored under another name (package data globs skip dot files).
_STORED_AS = {"gitignore": ".gitignore"}

#: Used when this package runs from a source tree that is not installed (no metadata to read).
_DEFAULT_RANGES = {"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}

#: What each generated file is for, shown in the tree (``{module}`` stands for the module name).
FILE_NOTES: dict[str, str] = {
    ".gitignore": "",
    "README.md": "install, test, what to change",
    "ci.sh": "install, ruff, pytest (2 and 4 ranks), torchrun",
    "pyproject.toml": "the physicsnemo_shardext entry point",
    "src/{module}/__init__.py": "",
    "src/{module}/patches.py": "the hook module: both hooks and the handler",
    "tests/test_patches.py": "conformance (uneven shards, 2-D mesh), refusals, delegation",
}


class ScaffoldError(ValueError):
    """A name or target directory ``shardext new`` cannot use; the message says why."""


@dataclass(frozen=True)
class PluginNames:
    """The three names of a plugin, derived from the one given to ``shardext new``."""

    distribution: str
    """The distribution name, as given (``pip install``, ``pyproject.toml``)."""
    module: str
    """The import package under ``src/``."""
    plugin: str
    """The entry-point name: shown by ``shardext list``, typed in ``SHARDEXT_DISABLE``."""


@dataclass(frozen=True)
class ScaffoldResult:
    """What `write_plugin` wrote."""

    directory: Path
    names: PluginNames
    files: tuple[str, ...]
    """The files written, relative to ``directory``, sorted."""


def _normalized(name: str) -> str:
    """PEP 503 form, which is also how plugin selectors compare names (``_`` and ``-`` alike)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _first_party_plugins() -> set[str]:
    try:
        distribution = metadata.distribution(DISTRIBUTION_NAME)
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return set()
    return {_normalized(ep.name) for ep in distribution.entry_points if ep.group == PROJECT_NAME}


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _shadowed_module(module: str) -> str | None:
    """Where a module of that name already comes from (standard library, installed), else ``None``."""
    if module in sys.stdlib_module_names:
        return "the standard library"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    # A bare directory on sys.path (a namespace package, e.g. an empty target dir) shadows nothing.
    if spec is None or spec.origin is None or spec.origin == "namespace":
        return None
    return spec.origin


def plugin_names(name: str) -> PluginNames:
    """Check ``name`` and derive the distribution, module and plugin names from it.

    Args:
        name: the distribution name, e.g. ``shardext-hardtanh``.

    Returns:
        The three names.

    Raises:
        ScaffoldError: if ``name`` is not a valid distribution name, gives no valid
            module name, or is taken (see the module docstring).

    Examples:
        >>> plugin_names("My.Stencil")
        PluginNames(distribution='My.Stencil', module='my_stencil', plugin='my-stencil')
        >>> plugin_names("pointwise")
        Traceback (most recent call last):
        ...
        physicsnemo_shardext.tools.scaffold.ScaffoldError: 'pointwise' is the name of a first-party plugin of physicsnemo-shardext; pick another name
    """
    if not _DISTRIBUTION.match(name):
        raise ScaffoldError(
            f"{name!r} is not a valid distribution name: use letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit"
        )
    module = re.sub(r"[-.]+", "_", name).lower()
    if not (module.isidentifier() and module.isascii()):
        hint = "start the name with a letter" if module[0].isdigit() else "pick another name"
        raise ScaffoldError(f"{name!r} gives the module name {module!r}, which is not a Python identifier; {hint}")
    if keyword.iskeyword(module):
        raise ScaffoldError(f"{name!r} gives the module name {module!r}, which is a Python keyword; pick another name")
    plugin = _normalized(name)
    if plugin == _normalized(DISTRIBUTION_NAME):
        raise ScaffoldError(f"{name!r} is the framework's own distribution; pick another name")
    reserved = _first_party_plugins() | {_normalized(old) for old in RENAMED_PLUGINS}
    if plugin in reserved:
        raise ScaffoldError(f"{name!r} is the name of a first-party plugin of {DISTRIBUTION_NAME}; pick another name")
    if plugin in _PROVIDER_LABELS:
        raise ScaffoldError(
            f"{name!r} is what `shardext list` calls handlers that no plugin provides; pick another name"
        )
    version = _installed_version(name)
    if version is not None:
        raise ScaffoldError(
            f"a distribution named {name!r} is already installed (version {version}); pick another name"
        )
    owners = sorted(
        ep.dist.name if ep.dist is not None else "?"
        for ep in metadata.entry_points(group=PROJECT_NAME)
        if _normalized(ep.name) == plugin
    )
    if owners:
        raise ScaffoldError(
            f"the plugin name {plugin!r} is already published by {', '.join(owners)}; pick another name"
        )
    origin = _shadowed_module(module)
    if origin is not None:
        raise ScaffoldError(f"the module name {module!r} would shadow the module from {origin}; pick another name")
    return PluginNames(distribution=name, module=module, plugin=plugin)


def _framework_ranges() -> dict[str, str]:
    """PhysicsNeMo's and torch's ranges as this package declares them: what it is tested with."""
    from packaging.requirements import InvalidRequirement, Requirement

    ranges = dict(_DEFAULT_RANGES)
    declared = metadata.requires(DISTRIBUTION_NAME) if _installed_version(DISTRIBUTION_NAME) else None
    for line in declared or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is None and requirement.name in ranges and requirement.specifier:
            specifiers = sorted((str(s) for s in requirement.specifier), key=lambda s: (not s.startswith(">"), s))
            ranges[requirement.name] = ",".join(specifiers)
    return ranges


def _framework_requirement() -> str:
    version = _installed_version(DISTRIBUTION_NAME)
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{DISTRIBUTION_NAME}>={match[1]}.{match[2]}" if match else DISTRIBUTION_NAME


def _template_files(root: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        path = f"{prefix}{entry.name}"
        if entry.is_dir():
            yield from _template_files(entry, f"{path}/")
        elif entry.name.endswith(".tmpl"):
            yield path.removesuffix(".tmpl"), entry


def _relative_paths(names: PluginNames) -> list[str]:
    return sorted(note.format(module=names.module) for note in FILE_NOTES)


def format_tree(names: PluginNames, files: Sequence[str] | None = None, *, notes: bool = True) -> str:
    """The generated tree as ``tree`` draws it, with what each file is for.

    Args:
        names: the plugin's names (the root is the distribution name).
        files: paths relative to the root (default: the files `render_plugin` writes).
        notes: append `FILE_NOTES` as ``# ...`` comments.

    Returns:
        The tree, one line per directory or file, without a final newline.

    Examples:
        >>> print(format_tree(plugin_names("my-op"), ["a.txt", "src/my_op/b.py"], notes=False))
        my-op/
        ├── a.txt
        └── src/
            └── my_op/
                └── b.py
    """
    paths = sorted(files if files is not None else _relative_paths(names))
    comments = {path.format(module=names.module): note for path, note in FILE_NOTES.items() if note} if notes else {}
    entries: list[tuple[str, str]] = []

    def walk(prefix: str, indent: str) -> None:
        children = sorted({p[len(prefix) :].split("/")[0] for p in paths if p.startswith(prefix)})
        for index, child in enumerate(children):
            last = index == len(children) - 1
            full = prefix + child
            is_dir = any(p.startswith(full + "/") for p in paths)
            entries.append((f"{indent}{'└── ' if last else '├── '}{child}{'/' if is_dir else ''}", full))
            if is_dir:
                walk(full + "/", indent + ("    " if last else "│   "))

    walk("", "")
    width = max(len(text) for text, _ in entries)
    lines = [f"{names.distribution}/"]
    for text, full in entries:
        note = comments.get(full)
        lines.append(f"{text.ljust(width)}  # {note}" if note else text)
    return "\n".join(lines)


def render_plugin(names: PluginNames) -> dict[str, str]:
    """The generated files' contents by path relative to the distribution's root.

    Examples:
        >>> files = render_plugin(plugin_names("my-op"))
        >>> print(files["pyproject.toml"].split("[project.entry-points.physicsnemo_shardext]")[1].split()[:3])
        ['my-op', '=', '"my_op.patches"']
    """
    ranges = _framework_ranges()
    values = {
        "distribution": names.distribution,
        "module": names.module,
        "plugin": names.plugin,
        "framework_requirement": _framework_requirement(),
        "requirements": "{" + ", ".join(f'"{name}": "{spec}"' for name, spec in ranges.items()) + "}",
        "tree": format_tree(names),
    }

    def substitute(match: re.Match[str]) -> str:
        if match[1] not in values:
            raise KeyError(f"template placeholder {{{{{match[1]}}}}} has no value")
        return values[match[1]]

    root = resources.files("physicsnemo_shardext.tools") / "plugin-template"
    rendered: dict[str, str] = {}
    for path, template in _template_files(root):
        parts = [names.module if part == _MODULE_SEGMENT else part for part in path.split("/")]
        target = "/".join(parts[:-1] + [_STORED_AS.get(parts[-1], parts[-1])])
        rendered[target] = _PLACEHOLDER.sub(substitute, template.read_text(encoding="utf-8"))
    return rendered


def _check_target(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise ScaffoldError(f"{directory} exists and is not a directory; pick another --dir")
    if directory.is_dir() and any(directory.iterdir()):
        raise ScaffoldError(f"{directory} exists and is not empty; pick another --dir, or remove it first")


def write_plugin(name: str, directory: str | os.PathLike[str] | None = None) -> ScaffoldResult:
    """Write the plugin distribution ``name`` into ``directory`` (default: ``./name``).

    Args:
        name: the distribution name (see `plugin_names`).
        directory: where to write; it must not exist, or be an empty directory.

    Returns:
        What was written.

    Raises:
        ScaffoldError: for a refused name, or a target that is a file or a non-empty directory.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     result = write_plugin("my-op", Path(tmp) / "my-op")
        ...     (result.directory / "src/my_op/patches.py").is_file(), os.access(result.directory / "ci.sh", os.X_OK)
        (True, True)
    """
    names = plugin_names(name)
    target = Path(directory) if directory is not None else Path.cwd() / name
    _check_target(target)
    files = render_plugin(names)
    for path, text in files.items():
        destination = target / path
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(text, encoding="utf-8")
        if destination.suffix == ".sh":
            destination.chmod(0o755)
    return ScaffoldResult(directory=target, names=names, files=tuple(sorted(files)))


def next_steps(result: ScaffoldResult, cwd: str | os.PathLike[str] | None = None) -> str:
    """What ``shardext new`` prints after writing: the tree, then the commands to run.

    Examples:
        >>> names = plugin_names("my-op")
        >>> result = ScaffoldResult(Path("/work/my-op"), names, tuple(render_plugin(names)))
        >>> lines = next_steps(result, cwd="/work").splitlines()
        >>> lines[0]
        "Wrote plugin 'my-op' (distribution my-op, module my_op) in my-op:"
        >>> "  cd my-op" in lines, "  pip install -e ." in lines
        (True, True)
    """
    where = Path(os.path.relpath(result.directory, cwd if cwd is not None else Path.cwd()))
    names = result.names
    commands: Mapping[str, str] = {
        f"cd {where}": "",
        "pip install -e .": "",
        f"shardext list --plugin {names.plugin}": "the handler, with its provenance",
        "pytest -q": "2 and 4 ranks, started by the pytest plugin",
        "torchrun --nproc-per-node 2 -m pytest -q": "the same tests on torchrun's ranks",
    }
    width = max(len(command) for command in commands)
    lines = [
        f"Wrote plugin {names.plugin!r} (distribution {names.distribution}, module {names.module}) in {where}:",
        "",
        format_tree(names, result.files),
        "",
        "Next:",
        *(f"  {command.ljust(width)}  # {note}" if note else f"  {command}" for command, note in commands.items()),
        f"Then replace F.hardtanh in src/{names.module}/patches.py with your op (README.md: What to change).",
    ]
    return "\n".join(lines)
