"""Tests of physicsnemo_shardext/primitives/meta.py: output shapes from torch's own checks, cached."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_shardext.primitives import meta, meta_output_shape


def test_shapes_equal_the_real_calls_and_repeat_calls_hit_the_cache():
    x, w, b = torch.randn(2, 3, 11, 8), torch.randn(5, 3, 3, 3), torch.randn(5)
    meta._cached.cache_clear()
    for stride, padding in [(1, 1), ([2, 1], "valid"), ((1, 2), (0, 1))]:
        got = meta_output_shape(F.conv2d, (x, w, b, stride, padding))
        assert got == F.conv2d(x, w, b, stride, padding).shape
    values, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    assert meta_output_shape(
        F.max_pool2d, (x,), {"kernel_size": 3, "stride": 2, "padding": 1, "return_indices": True}
    ) == (values.shape, indices.shape)
    misses = meta._cached.cache_info().misses
    meta_output_shape(F.conv2d, (x, w, b, [2, 1], "valid"))
    meta_output_shape(F.conv2d, (x.clone(), w, b, [2, 1], "valid"))  # another tensor, same shape: same key
    assert meta._cached.cache_info().misses == misses


def test_a_wrong_call_raises_torch_error_every_time():
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 2, 3, 3)  # 3 input channels, weight expects 2
    for _ in range(2):
        with pytest.raises(RuntimeError, match="channel"):
            meta_output_shape(F.conv2d, (x, w))


def test_dtype_override_and_unhashable_arguments():
    x = torch.randn(2, 4)
    seen = []

    def op(t, options):
        seen.append(t.dtype)
        return t.sum(options["dim"])

    assert meta_output_shape(op, (x, {"dim": 0}), dtype=torch.bfloat16) == torch.Size([4])
    assert meta_output_shape(op, (x, {"dim": 0}), dtype=torch.bfloat16) == torch.Size([4])
    assert seen == [torch.bfloat16, torch.bfloat16]  # a dict argument: computed, not cached
