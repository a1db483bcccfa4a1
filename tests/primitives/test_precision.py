"""Tests of physicsnemo_shardext.primitives.precision."""

import pytest
import torch

from physicsnemo_shardext.primitives import autocast_float32, output_dtype_under_autocast
from physicsnemo_shardext.primitives.precision import _has_autocast_rule

BF16 = torch.ones(3, dtype=torch.bfloat16)


def test_nothing_changes_outside_autocast_or_for_float32():
    assert not autocast_float32("aten::mse_loss", BF16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not autocast_float32("aten::mse_loss", torch.ones(3))
        assert output_dtype_under_autocast("aten::mse_loss", torch.ones(3)) == torch.float32


def test_the_dispatcher_decides_which_ops_have_a_rule():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_float32("aten::mse_loss", BF16)  # CPU autocast runs losses in float32
        assert output_dtype_under_autocast("aten::mse_loss", BF16) == torch.float32
        assert not autocast_float32("aten::softmax.int", BF16)  # CPU autocast has no softmax rule
        assert output_dtype_under_autocast("aten::softmax.int", BF16) == torch.bfloat16


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch build registers no CUDA autocast kernels")
def test_cuda_autocast_runs_norms_and_softmax_in_float32():
    # What the sharded norm and softmax handlers ask (measured on an H100: without it their
    # output stayed bf16 where single-process CUDA autocast returns float32).
    for op in ("aten::layer_norm", "aten::group_norm", "aten::rms_norm", "aten::softmax.int", "aten::log_softmax.int"):
        assert _has_autocast_rule(op, "cuda"), op
    assert not _has_autocast_rule("aten::batch_norm", "cuda")


def test_an_unknown_operator_has_no_rule():
    assert not _has_autocast_rule("aten::no_such_op_xyz", "cpu")
