"""Tests of ``shardext new`` (physicsnemo_shardext.tools.scaffold): the plugin it writes installs and passes its tests.

The generated distribution is really ``pip install -e``-ed (offline: ``--no-deps
--no-build-isolation --no-index``), into a throwaway virtual environment layered on
this one (it sees this environment's packages through a ``.pth`` file), so that
other processes using this environment never see the test plugin, even if this
test is killed before its finalizer uninstalls it. Its tests then run as its
``ci.sh`` runs them: under plain pytest (ranks spawned by the pytest plugin, 2 and
4) and under ``torchrun --nproc-per-node 2``.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from physicsnemo_shardext.testing.plugin_packages import write_plugin_distribution
from physicsnemo_shardext.tools import scaffold
from physicsnemo_shardext.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
NAME = "shardext-scaffold-check"
MODULE = "shardext_scaffold_check"
TEMPLATE_TESTS = REPO / "physicsnemo_shardext" / "tools" / "plugin-template" / "tests" / "test_patches.py.tmpl"
#: The name the docs use for the sample tree.
DOCS_NAMES = scaffold.PluginNames("shardext-hardtanh", "shardext_hardtanh", "shardext-hardtanh")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without plugin switches or the variables of an enclosing torchrun."""
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDEXT_", "TORCHELASTIC_", "PYTEST_")) and k not in launcher
    }
    env.update(extra)
    return env


def _new(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    out = io.StringIO()
    code = main(["new", *argv], out=out)
    return code, out.getvalue(), capsys.readouterr().err


# -- the generated distribution, installed ----------------------------------------------------
@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("scaffold") / NAME
    result = scaffold.write_plugin(NAME, target)
    assert result.directory == target
    return target


def _layered_environment(root: Path) -> Path:
    """A virtual environment that also sees this one's site-packages; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    # addsitedir (not a bare path) so that this environment's own .pth files, editable installs included, apply.
    lines = "".join(f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages())
    (Path(purelib) / "_outer_environment.pth").write_text(lines)
    return python


@pytest.fixture(scope="module")
def installed(generated: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of an environment where ``pip install -e`` of the generated plugin was run."""
    python = _layered_environment(tmp_path_factory.mktemp("venv") / "env")
    pip = [str(python), "-m", "pip"]
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", "-e", str(generated)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(),
    )
    assert install.returncode == 0, f"pip install -e failed:\n{install.stdout}\n{install.stderr}"
    yield python
    subprocess.run([*pip, "uninstall", "--yes", "--quiet", NAME], capture_output=True, timeout=120, env=_clean_env())


def _section(output: str, header: str) -> str:
    """The part of ci.sh's output after the line ``== header`` (up to the next ``== `` line)."""
    match = re.search(rf"^== {re.escape(header)}.*?$(.*?)(?=^== |\Z)", output, re.MULTILINE | re.DOTALL)
    assert match, f"ci.sh printed no '== {header}' section:\n{output[-3000:]}"
    return match[1]


def _test_names() -> tuple[set[str], set[str]]:
    """(every test function, those marked multirank(4)) of the generated test module."""
    text = TEMPLATE_TESTS.read_text()
    names = set(re.findall(r"^def (test_\w+)", text, re.MULTILINE))
    four = set(re.findall(r"^@pytest\.mark\.multirank\(4\)\n(?:@.*\n)*def (test_\w+)", text, re.MULTILINE))
    return names, four


def test_generated_plugin_installs_and_its_tests_pass_under_pytest_and_torchrun(generated, installed):
    listing = subprocess.run(
        [
            str(installed),
            "-c",
            "from importlib import metadata; "
            "print([(e.name, e.value) for e in metadata.entry_points(group='physicsnemo_shardext') if e.dist.name == "
            f"{NAME!r}])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert listing.stdout.strip() == f"[('{NAME}', '{MODULE}.patches')]", listing.stderr
    env = _clean_env(PYTHON=str(installed), SKIP_INSTALL="1", TORCHRUN_RANKS="2", PYTEST_ADDOPTS="-rA")
    result = subprocess.run(["bash", str(generated / "ci.sh")], capture_output=True, text=True, timeout=1200, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"ci.sh failed (exit {result.returncode}):\n{output[-6000:]}"
    names, four_ranks = _test_names()
    assert four_ranks and names > four_ranks

    spawned = _section(output, "pytest (ranks started by the pytest plugin)")
    passed = set(re.findall(r"^PASSED tests/test_patches\.py::(test_\w+)", spawned, re.MULTILINE))
    assert passed == names, f"not passed under plain pytest: {sorted(names - passed)}\n{spawned[-3000:]}"
    assert not re.search(r"^(SKIPPED|FAILED|ERROR|XFAIL)", spawned, re.MULTILINE), spawned[-3000:]

    torchrun = _section(output, "torchrun --nproc-per-node 2")
    found = re.findall(r"PASSED tests/test_patches\.py::(test_\w+)", torchrun)
    for name in names - four_ranks:  # ran inline on both ranks
        assert found.count(name) >= 2, f"{name} did not pass on both torchrun ranks:\n{torchrun[-3000:]}"
    assert not set(found) & four_ranks
    skips = re.findall(r"multirank\(4\) test, but torchrun launched 2 ranks", torchrun)
    assert len(skips) == 2 * len(four_ranks), torchrun[-3000:]  # one per rank, nothing else skipped
    assert len(re.findall(r"^SKIPPED", torchrun, re.MULTILINE)) == 2
    assert not re.search(r"^(FAILED|ERROR)", torchrun, re.MULTILINE)


# -- what is written ---------------------------------------------------------------------------
def test_generated_files(tmp_path):
    generated = scaffold.write_plugin(NAME, tmp_path / NAME).directory
    files = sorted(p.relative_to(generated).as_posix() for p in generated.rglob("*") if p.is_file())
    assert files == sorted(path.format(module=MODULE) for path in scaffold.FILE_NOTES)
    pyproject = tomllib.loads((generated / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == NAME
    assert pyproject["project"]["entry-points"]["physicsnemo_shardext"] == {NAME: f"{MODULE}.patches"}
    assert pyproject["project"]["dependencies"][0].startswith("physicsnemo-shardext")
    for path in files:
        text = (generated / path).read_text()
        assert "{{" not in text and "__module__" not in text, path
        if path.endswith(".py"):
            compile(text, path, "exec")
    hooks = (generated / "src" / MODULE / "patches.py").read_text()
    assert "def shardext_declare_patches(patches: PatchSet) -> None:" in hooks
    assert "def shardext_requirements() -> Mapping[str, str]:" in hooks
    assert '"nvidia-physicsnemo": ">=2.2,<2.3"' in hooks
    assert scaffold.format_tree(scaffold.PluginNames(NAME, MODULE, NAME)) in (generated / "README.md").read_text()
    ci = generated / "ci.sh"
    assert os.access(ci, os.X_OK)
    assert subprocess.run(["bash", "-n", str(ci)], capture_output=True).returncode == 0


def _ruff() -> list[str] | None:
    if shutil.which("ruff"):
        return ["ruff"]
    probe = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    return [sys.executable, "-m", "ruff"] if probe.returncode == 0 else None


def test_generated_code_passes_ruff(generated):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed")
    for command in (["check"], ["format", "--check"]):
        result = subprocess.run([*ruff, *command, "."], cwd=generated, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}\n{result.stderr}"


def test_new_prints_the_tree_and_next_steps(tmp_path, capsys):
    code, out, err = _new("my-op", "--dir", str(tmp_path / "here"), capsys=capsys)
    assert code == 0, err
    assert f"Wrote plugin 'my-op' (distribution my-op, module my_op) in {os.path.relpath(tmp_path / 'here')}" in out
    assert scaffold.format_tree(scaffold.plugin_names("my-op")) in out
    assert "pip install -e ." in out and "torchrun --nproc-per-node 2 -m pytest -q" in out
    assert (tmp_path / "here" / "src" / "my_op" / "patches.py").is_file()


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "is not a valid distribution name"),
        ("my plugin", "is not a valid distribution name"),
        ("my-op-", "is not a valid distribution name"),
        ("op!", "is not a valid distribution name"),
        ("2d-stencil", "gives the module name '2d_stencil', which is not a Python identifier; start the name"),
        ("class", "gives the module name 'class', which is a Python keyword"),
        ("pointwise", "is the name of a first-party plugin of physicsnemo-shardext"),
        ("Misc-Ops", "is the name of a first-party plugin"),  # the old name of layout_ops
        ("Physicsnemo_Shardext", "is the framework's own distribution"),
        ("external", "what `shardext list` calls handlers that no plugin provides"),
        ("pytest", "a distribution named 'pytest' is already installed"),
        ("json", "the module name 'json' would shadow the module from the standard library"),
        ("My.Op", None),  # valid: the control case
    ],
)
def test_names(name, message, tmp_path, capsys):
    target = tmp_path / "out"
    code, out, err = _new(name, "--dir", str(target), capsys=capsys)
    if message is None:
        assert code == 0, err
        return
    assert code == 2 and out == ""
    assert err.startswith("shardext new: error: ") and message in err, err
    assert not target.exists()


def test_plugin_name_taken_by_an_installed_plugin_is_refused(capsys, tmp_path, monkeypatch):
    write_plugin_distribution(tmp_path, "left-dist", "1.0", {"left_op": "left_hooks"}, {"left_hooks": ""})
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _new("Left-Op", "--dir", str(tmp_path / "out"), capsys=capsys)
    assert code == 2
    assert (
        err == "shardext new: error: the plugin name 'left-op' is already published by left-dist; pick another name\n"
    )


def test_existing_directory_is_refused_unless_empty(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    code, out, err = _new("my-op", "--dir", str(full), capsys=capsys)
    assert code == 2 and out == ""
    assert err == f"shardext new: error: {full} exists and is not empty; pick another --dir, or remove it first\n"
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"

    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = _new("my-op", "--dir", str(a_file), capsys=capsys)
    assert code == 2 and "exists and is not a directory" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _new("my-op", "--dir", str(empty), capsys=capsys)
    assert code == 0, err
    assert (empty / "pyproject.toml").is_file()


def test_default_directory_is_the_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, _ = _new("my-op", capsys=capsys)
    assert code == 0 and (tmp_path / "my-op" / "ci.sh").is_file()
    assert "  cd my-op" in out
    code, _, err = _new("my-op", capsys=capsys)
    assert code == 2 and "my-op exists and is not empty" in err


# -- no torch ----------------------------------------------------------------------------------
def _imported_modules(stderr: str) -> set[str]:
    """Top-level names of the modules ``-X importtime`` reports."""
    return {m.split(".")[0] for m in re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", stderr, re.MULTILINE)}


@pytest.mark.parametrize(
    "command",
    [
        ["{script}", "new", "no-torch-op", "--dir", "{dir}"],
        ["{python}", "-m", "physicsnemo_shardext_cli", "new", "no-torch-op", "--dir", "{dir}"],
        ["{script}", "--help"],
        ["{script}", "new", "--help"],
        ["{script}"],
    ],
    ids=["new", "python -m new", "--help", "new --help", "no arguments"],
)
def test_new_and_help_answer_without_importing_torch(command, tmp_path):
    values = {
        "script": str(Path(sys.executable).with_name("shardext")),
        "python": sys.executable,
        "dir": str(tmp_path / "d"),
    }
    argv = [part.format(**values) for part in command]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env=_clean_env(PYTHONPROFILEIMPORTTIME="1")
    )
    modules = _imported_modules(result.stderr)
    assert "physicsnemo_shardext" in modules, result.stderr[-2000:]
    heavy = modules & {"torch", "physicsnemo", "numpy", "warp"}
    assert not heavy, f"{' '.join(argv)} imported {sorted(heavy)}"
    if argv[-1] == str(tmp_path / "d"):
        assert result.returncode == 0 and (tmp_path / "d" / "src" / "no_torch_op" / "patches.py").is_file()
    elif len(argv) == 1:
        assert result.returncode == 2 and "required: command" in result.stderr
    else:
        assert result.returncode == 0 and "usage: shardext" in result.stdout


# -- documentation -----------------------------------------------------------------------------
@pytest.mark.parametrize("page", ["docs/reference/cli.md", "docs/writing-a-plugin.md"])
def test_docs_show_the_generated_tree(page):
    tree = scaffold.format_tree(DOCS_NAMES)
    assert tree in (REPO / page).read_text(), f"{page}: the tree of `shardext new shardext-hardtanh` is not:\n{tree}"
