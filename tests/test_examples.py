"""The example scripts run on CPU ranks and report a match with the single-process run.

The torchrun scripts run as their docstrings say; ``examples/verify_models.py`` runs
through ``shardext verify`` with the very commands of its docstring (README.md, the
getting-started page and the CLI reference cite them).
"""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
VERIFY_MODELS = EXAMPLES / "verify_models.py"


@pytest.mark.parametrize(("ranks", "height", "expected_heights"), [(2, 33, "[17, 16]"), (3, 37, "[13, 13, 11]")])
def test_domain_parallel_example_matches_single_process(ranks, height, expected_heights):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(EXAMPLES / "domain_parallel_cpu.py"),
            "--height",
            str(height),
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"ranks {ranks} (cpu), shard heights {expected_heights}" in result.stdout
    assert "pointwise (physicsnemo-shardext)" in result.stdout  # plugins were loaded
    worst = float(re.search(r"worst difference (\S+) -> MATCH", result.stdout).group(1))
    assert worst < 1e-5


def test_minimal_example_from_getting_started():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "minimal_shardtensor.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "rank 0: local rows (5, 16), matches single-process" in result.stdout
    assert "rank 1: local rows (5, 16), matches single-process" in result.stdout


@pytest.mark.parametrize(
    ("options", "model", "heights", "plugins"),
    [
        ([], "fno", "[17, 16]", {"fft", "indexing_einsum", "layout_ops"}),
        (["--model", "afno", "--height", "36"], "afno", "[20, 16]", {"fft", "indexing_einsum", "afno"}),
    ],
    ids=["fno", "afno"],
)
def test_fno_training_example_tracks_single_process(options, model, heights, plugins):
    """examples/fno_training_cpu.py trains PhysicsNeMo's FNO (defaults) or AFNO on 2 uneven ranks like one process."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "fno_training_cpu.py"),
            "--steps",
            "6",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"{model}: ranks 2 (cpu), shard heights {heights}" in result.stdout
    loaded = re.search(r"plugins: (.*)", result.stdout).group(1).split(", ")
    assert plugins <= set(loaded)  # loaded, so the spectral ops are not on the fallback
    curves = re.findall(r"loss curve (?:sharded|single-process): +(.*)", result.stdout)
    assert len(curves) == 2 and len(curves[0].split()) == 6
    match = re.search(r"worst relative loss difference (\S+), max weight difference (\S+) -> TRACKS", result.stdout)
    assert match and float(match.group(1)) < 1e-4 and float(match.group(2)) < 1e-4


@pytest.mark.parametrize(
    ("ranks", "options", "header"),
    [
        (2, ["--model", "vit"], "vit: ranks 2 (cpu), ddp 1, domain split [16, 16]"),
        (4, ["--model", "lm", "--ddp", "2"], "lm: ranks 4 (cpu), ddp 2, domain split [50, 49]"),
    ],
    ids=["vit", "lm-ddp2"],
)
def test_transformer_example_verifies_and_trains(ranks, options, header):
    """examples/transformer_cpu.py (docs/transformers.md): the check against one process passes, then it trains."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(EXAMPLES / "transformer_cpu.py"),
            "--steps",
            "2",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert header in result.stdout
    assert "training check ok" in result.stdout
    assert re.search(r"step 1: loss \d", result.stdout)


def _verify_commands() -> dict[str, list[str]]:
    """The ``shardext verify`` lines of examples/verify_models.py's docstring: flags by factory."""
    docstring = ast.get_docstring(ast.parse(VERIFY_MODELS.read_text(encoding="utf-8"))) or ""
    commands = {}
    for line in docstring.splitlines():
        words = line.split()
        if words[:2] == ["shardext", "verify"]:
            commands[words[2].partition(":")[2]] = words[3:]
    return commands


def _factories() -> set[str]:
    spec = importlib.util.spec_from_file_location("verify_models_example", VERIFY_MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {
        name
        for name, value in vars(module).items()
        if callable(value) and not name.startswith("_") and getattr(value, "__module__", "") == module.__name__
    }


VERIFY_COMMANDS = _verify_commands()
#: Factories whose run CI leaves out (``--run-slow`` runs them): each run costs 15-25 s, mostly starting ranks.
SLOW_VERIFY = {"transolver"}
#: The launcher's and the suite's variables, which a user's shell does not have.
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_verify_models_docstring_has_a_command_for_every_factory_and_the_docs_cite_only_those():
    assert set(VERIFY_COMMANDS) == _factories()
    cited = set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        cited |= set(re.findall(r"examples/verify_models\.py:(\w+)", page.read_text(encoding="utf-8")))
    assert cited and cited <= set(VERIFY_COMMANDS), sorted(cited - set(VERIFY_COMMANDS))


@pytest.mark.parametrize(
    "factory", [pytest.param(f, marks=(pytest.mark.slow,) if f in SLOW_VERIFY else ()) for f in VERIFY_COMMANDS]
)
def test_verify_models_example_matches(factory, tmp_path):
    """``shardext verify examples/verify_models.py:<factory> ...`` as documented: exit 0, MATCH, no gather."""
    flags = VERIFY_COMMANDS[factory]
    # An --html page lands in tmp_path, not in the checkout.
    flags = [str(tmp_path / flag) if before == "--html" else flag for before, flag in zip(["", *flags], flags)]
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "physicsnemo_shardext",
        "verify",
        f"{VERIFY_MODELS}:{factory}",
        *flags,
        "--json",
        str(report),
        "--no-progress",
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDEXT_", "TORCHELASTIC_", "PYTEST_")) and k not in LAUNCHER
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "MATCH:" in result.stdout
    data = json.loads(report.read_text())
    assert data["status"] == "match" and data["totals"]["activation_gathers"] == 0
    assert data["comparison"] and all(row["ok"] for row in data["comparison"])
    if "--html" in flags:
        assert (tmp_path / flags[flags.index("--html") + 1]).read_text().startswith("<!DOCTYPE html>")
