"""Tests of what the built distribution contains (pyproject.toml's package mapping)."""

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
    assert "physicsnemo_shardext/testing/pytest_plugin.py" in names
    assert "physicsnemo_shardext/hookspecs.py" in names
    assert "physicsnemo_shardext_pytest.py" in names  # the torch-free pytest entry point
    top_level = {name.split("/")[0] for name in names}
    dist_info = next(n for n in top_level if n.endswith(".dist-info"))
    assert top_level == {"physicsnemo_shardext", "physicsnemo_shardext_pytest.py", dist_info}
    assert not any(name.startswith(("patches/", "tests/", "entry_points/", "examples/")) for name in names)


def test_wheel_declares_plugin_pytest_and_console_entry_points(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(entry_points).decode()
    section = text.split("[physicsnemo_shardext]\n", 1)[1].split("\n\n", 1)[0].splitlines()
    families = dict(line.split(" = ") for line in section)
    for family in ("pointwise", "normalization", "convolution", "fft", "indexing_einsum", "fallback_fix"):
        assert families[family] == f"physicsnemo_shardext.patches.{family}"
    for module in families.values():  # every first-party entry point names a module the wheel ships
        assert module.replace(".", "/") + ".py" in wheel.namelist()
    assert "[pytest11]\nshardext = physicsnemo_shardext_pytest" in text
    assert "shardext = physicsnemo_shardext.cli:main" in text


def test_wheel_metadata_pins_physicsnemo_range(wheel):
    (metadata,) = [n for n in wheel.namelist() if n.endswith("METADATA")]
    text = wheel.read(metadata).decode()
    assert "Requires-Dist: nvidia-physicsnemo<2.3,>=2.2" in text
    assert "Requires-Python: >=3.11" in text
    assert "Provides-Extra: test" in text and "Provides-Extra: docs" in text
