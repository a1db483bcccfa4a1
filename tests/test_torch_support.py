"""Tests of physicsnemo_shardext.torch_support."""

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from physicsnemo_shardext import torch_support

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.14.0a0+3bcc3cd.nv26.08", "2.14.0"),  # NVIDIA's PyTorch container, 26.08
        ("2.13.0a0+6c8c5ad.nv26.06", "2.13.0"),  # PhysicsNeMo's Dockerfile base
        ("2.15.0+cu132", "2.15.0"),
        ("2.12.1", "2.12.1"),
    ],
)
def test_a_release_drops_pre_release_and_local_tags(version, release):
    assert str(torch_support.torch_release(version)) == release


def test_container_builds_are_inside_the_range_their_release_is_in():
    assert torch_support.torch_in(">=2.14", "2.14.0a0+3bcc3cd.nv26.08")
    assert not torch_support.torch_in("<2.14", "2.14.0a0+3bcc3cd.nv26.08")
    assert not torch_support.torch_in(">=2.12.0a0,<2.16", "2.11.0a0+git")


def test_the_declared_range_is_pyprojects_and_admits_container_builds():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (declared,) = [Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "torch"]
    assert torch_support.declared_torch_range() == str(declared.specifier)
    # pip itself compares the full version: NVIDIA's pre-release builds must satisfy the range as written.
    for container_torch in ("2.12.0a0+git.nv26.04", "2.13.0a0+6c8c5ad.nv26.06", "2.14.0a0+3bcc3cd.nv26.08"):
        assert declared.specifier.contains(container_torch), container_torch
    assert declared.specifier.contains("2.15.0") and not declared.specifier.contains("2.16.0")
    assert not declared.specifier.contains("2.11.0")


def test_the_installed_torch_is_a_declared_one():
    report = torch_support.support_report()
    assert report["torch"] == torch.__version__
    assert report["in_declared_range"] is True, report


def test_a_strategy_probe_tells_registered_ops_from_others():
    assert torch_support.has_dtensor_strategy(torch.ops.aten.add.Tensor)
    assert not torch_support.has_dtensor_strategy(torch.ops.aten.add)  # a packet, not an overload


def test_local_tensor_mode_probe_matches_importability():
    try:
        import torch.distributed._local_tensor as local_tensor

        expected = hasattr(local_tensor, "LocalTensorMode")
    except ImportError:
        expected = False
    assert torch_support.has_local_tensor_mode() is expected


def test_the_package_metadata_and_pyproject_agree():
    assert any(r.startswith("torch") for r in metadata.requires("physicsnemo-shardext") or [])
