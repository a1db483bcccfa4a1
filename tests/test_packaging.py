"""Tests of what the built distribution contains (pyproject.toml's package mapping)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (path,) = out.glob("physicsnemo_shardext-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_maps_patches_into_the_package_namespace(wheel):
    names = wheel.namelist()
    assert "physicsnemo_shardext/patches/pointwise.py" in names
    # a family split into a package by job ships every module of it
    for module in ("__init__", "ring", "sdpa", "mha"):
        assert f"physicsnemo_shardext/patches/attention/{module}.py" in names
    assert "physicsnemo_shardext/testing/pytest_plugin.py" in names
    assert "physicsnemo_shardext/hookspecs.py" in names
    assert "physicsnemo_shardext_pytest.py" in names  # the torch-free pytest entry point
    assert "physicsnemo_shardext_cli.py" in names  # the torch-free console script
    for wing_module in ("engine/loader.py", "tools/cli.py", "training/parallel.py", "ranks/worker.py"):
        assert f"physicsnemo_shardext/{wing_module}" in names  # every wing ships
    assert any(n.startswith("physicsnemo_shardext/tools/plugin-template/") and n.endswith(".tmpl") for n in names)
    top_level = {name.split("/")[0] for name in names}
    dist_info = next(n for n in top_level if n.endswith(".dist-info"))
    assert top_level == {
        "physicsnemo_shardext",
        "physicsnemo_shardext_pytest.py",
        "physicsnemo_shardext_cli.py",
        dist_info,
    }
    assert not any(name.startswith(("patches/", "tests/", "entry_points/", "examples/")) for name in names)


def test_wheel_declares_plugin_pytest_and_console_entry_points(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(entry_points).decode()
    section = text.split("[physicsnemo_shardext]\n", 1)[1].split("\n\n", 1)[0].splitlines()
    families = dict(line.split(" = ") for line in section)
    for family in ("pointwise", "normalization", "convolution", "fft", "indexing_einsum", "fallback_fix"):
        assert families[family] == f"physicsnemo_shardext.patches.{family}"
    for module in families.values():  # every first-party entry point names a module (or package) the wheel ships
        path = module.replace(".", "/")
        assert f"{path}.py" in wheel.namelist() or f"{path}/__init__.py" in wheel.namelist(), module
    assert "[pytest11]\nshardext = physicsnemo_shardext_pytest" in text
    assert "shardext = physicsnemo_shardext_cli:main" in text


def test_wheel_metadata_pins_physicsnemo_range(wheel):
    (metadata,) = [n for n in wheel.namelist() if n.endswith("METADATA")]
    text = wheel.read(metadata).decode()
    assert "Requires-Dist: nvidia-physicsnemo<2.3,>=2.2" in text
    assert "Requires-Python: >=3.11" in text
    assert "Provides-Extra: test" in text and "Provides-Extra: docs" in text


def _fake_distribution(site: Path, name: str, version: str) -> None:
    """Metadata alone: pip's resolver sees ``name`` ``version`` as installed."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


@pytest.mark.parametrize(
    ("torch_version", "accepted"),
    [
        ("2.12.0a0+79aa17489c.nv26.04", True),  # NVIDIA's 26.04 container
        ("2.14.0a0+3bcc3cd.nv26.08", True),  # NVIDIA's 26.08 container
        ("2.15.0", True),
        ("2.11.0", False),
        ("2.16.0", False),
    ],
)
def test_pip_installs_the_wheel_beside_a_declared_torch_and_nothing_else(wheel, tmp_path, torch_version, accepted):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python3*/site-packages")
    for name, version in [
        ("torch", torch_version),
        ("nvidia-physicsnemo", "2.2.2"),
        ("pluggy", "1.6.0"),
        ("packaging", "25.0"),
    ]:
        _fake_distribution(site, name, version)
    report = tmp_path / "report.json"
    no_constraints = tmp_path / "constraints.txt"  # this machine's pip configuration caps torch; users' has no cap
    no_constraints.write_text("")
    env = {**os.environ, "PIP_CONSTRAINT": str(no_constraints), "PIP_FIND_LINKS": ""}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--dry-run",
            "--no-index",
            "--report",
            str(report),
            wheel.filename,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    if not accepted:  # with no index, pip cannot replace the torch it refuses
        assert result.returncode != 0 and "torch" in result.stderr, result.stderr
        return
    assert result.returncode == 0, result.stderr
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["physicsnemo-shardext"]
