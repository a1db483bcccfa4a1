"""Tests of the first-party afno plugin (patches/afno.py): AFNO2DLayer with sharded scratch buffers."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.nn.module.afno_layers import AFNO2DLayer
from torch.distributed.tensor import Shard

import physicsnemo_shardext
from physicsnemo_shardext import AttributeTarget, PatchLevel
from physicsnemo_shardext.testing import ShardSpec, check_conformance

TARGET = AttributeTarget(AFNO2DLayer, "forward")


def test_wrapper_is_installed_with_provenance_and_undone_exactly():
    registry = physicsnemo_shardext.get_registry()
    record = registry.provenance(TARGET, PatchLevel.ATTRIBUTE)
    assert record is not None and record.plugin.name == "afno"
    assert record.plugin.distribution == "physicsnemo-shardext"
    original = physicsnemo_shardext.builtin_handler(TARGET, PatchLevel.ATTRIBUTE)
    installed = AFNO2DLayer.__dict__["forward"]
    assert installed is not original and installed.__wrapped__ is original
    with physicsnemo_shardext.disabled(plugins=["afno"]):
        assert AFNO2DLayer.__dict__["forward"] is original
    assert AFNO2DLayer.__dict__["forward"] is installed


def test_the_plugin_loaded_when_this_module_imported_the_layer():
    # The import at the top of this file ran afno_layers: the plugin loaded right after it.
    [report] = [r for r in physicsnemo_shardext.get_registry().reports() if r.plugin.name == "afno"]
    assert report.status.value == "loaded"


def test_the_plugin_waits_for_afno_layers_and_wraps_before_any_layer_exists(python_runner):
    code = (
        "import sys, physicsnemo_shardext as s\n"
        "status = lambda: [r.status.value for r in s.get_registry().reports() if r.plugin.name == 'afno'][0]\n"
        "print(status(), 'physicsnemo.nn' in sys.modules)\n"
        "from physicsnemo.nn.module.afno_layers import AFNO2DLayer\n"
        "print(status(), hasattr(AFNO2DLayer.__dict__['forward'], '__wrapped__'))\n"
    )
    result = python_runner(code, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-4:] == ["deferred", "False", "loaded", "True"]


def test_plain_inputs_run_the_original_forward_unchanged():
    torch.manual_seed(0)
    layer = AFNO2DLayer(hidden_size=8, num_blocks=2, hard_thresholding_fraction=0.5)
    x = torch.randn(2, 6, 8, 8)
    with physicsnemo_shardext.disabled(plugins=["afno"]):
        expected = layer(x)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


LAYERS = {
    "default": dict(hidden_size=8, num_blocks=2),
    # kept modes straddle the rank boundaries on both frequency dims; a wider hidden layer
    "thresholded-wide": dict(hidden_size=8, num_blocks=4, hard_thresholding_fraction=0.5, hidden_size_factor=2),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("config", sorted(LAYERS))
@pytest.mark.parametrize("split", [[7, 3], [10, 0]], ids=["uneven", "empty-shard"])
def test_layer_matches_single_process_and_stays_sharded(domain_mesh, config, split):
    x = torch.randn(2, 10, 12, 8)  # (B, H, W, C), sharded on H
    report = check_conformance(
        AFNO2DLayer(**LAYERS[config]), [x], ShardSpec(domain_mesh, [Shard(1)], split), rtol=1e-4, atol=1e-5
    )
    # rfft2 and irfft2 are one all-to-all each; the buffers never gather the spectrum.
    assert report.comms.forward.counts == {"c10d.alltoall_base_": 2}


@pytest.mark.multirank(4)
@pytest.mark.parametrize("config", sorted(LAYERS))
def test_layer_on_a_2x2_pencil_mesh(spatial_mesh, config):
    spec = ShardSpec(spatial_mesh, [Shard(1), Shard(2)], {0: [6, 4], 1: [5, 7]})
    report = check_conformance(AFNO2DLayer(**LAYERS[config]), [torch.randn(1, 10, 12, 8)], spec, rtol=1e-4, atol=1e-5)
    assert set(report.comms.forward.counts) == {"c10d.alltoall_base_"}
