"""Tests of the resampling plugin (patches/resampling.py): pixel (un)shuffle and interpolate on uneven shards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.resampling import cubic_source_rows, interpolate_handler, source_rows
from physicsnemo_shardext.testing import (
    CommCounter,
    ShardSpec,
    check_conformance,
    check_delegation,
    measure_comms,
    shard_tensor,
)
from physicsnemo_shardext.torch_support import torch_in


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_source_rows_reproduce_pytorch_1d_kernels(dtype):
    # Gathering the full signal at our global source rows must give F.interpolate's result.
    x = torch.randn(2, 3, 13, dtype=dtype)
    for mode, align in [("nearest", None), ("nearest-exact", None), ("linear", False), ("linear", True)]:
        for kwargs in [
            {"size": 13},
            {"size": 29},
            {"size": 5},
            {"scale_factor": 1.7},
            {"scale_factor": 0.45},
            {"scale_factor": 2.0},
            {"scale_factor": 1.7, "recompute_scale_factor": True},
            {"size": 1},
            {"scale_factor": 1.05},
        ]:  # size unchanged, scale not 1: copies, except nearest-exact
            expected = F.interpolate(x, mode=mode, align_corners=align, **kwargs)
            use_scale = "scale_factor" in kwargs and not kwargs.get("recompute_scale_factor")
            i0, i1, w0, w1 = source_rows(
                mode, 13, expected.shape[-1], kwargs["scale_factor"] if use_scale else None, bool(align), dtype
            )
            got = x[..., i0] * w0 + x[..., i1] * w1
            torch.testing.assert_close(got, expected, msg=f"{mode} align={align} {kwargs}")
    # Nearest kernels differ by rank (2-D copies rows for an unchanged size; 1-D and 3-D apply the scale).
    for spatial_dims in (2, 3):
        probe = x.reshape(2, 3, 13, *[1] * (spatial_dims - 1))
        for mode in ("nearest", "nearest-exact"):
            expected = F.interpolate(probe, scale_factor=[1.05] + [1.0] * (spatial_dims - 1), mode=mode).reshape(
                2, 3, 13
            )
            i0, _, _, _ = source_rows(mode, 13, 13, 1.05, False, dtype, spatial_dims)
            torch.testing.assert_close(x[..., i0], expected)
    for align in (False, True):
        for kwargs in [
            {"size": (13, 2)},
            {"size": (29, 2)},
            {"size": (5, 2)},
            {"scale_factor": (1.7, 1.0)},
            {"scale_factor": (0.45, 1.0)},
            {"scale_factor": (1.05, 1.0)},
            {"size": (1, 2)},
        ]:
            expected = F.interpolate(x.unsqueeze(-1).expand(2, 3, 13, 2), mode="bicubic", align_corners=align, **kwargs)
            rows, weights = cubic_source_rows(
                13, expected.shape[2], kwargs.get("scale_factor", (None,))[0], align, dtype
            )
            got = sum(x[..., rows[:, k]] * weights[:, k] for k in range(4))
            torch.testing.assert_close(got, expected[..., 0], msg=f"bicubic align={align} {kwargs}")


def test_interpolate_overrides_the_builtin():
    record = physicsnemo_shardext.get_registry().provenance(F.interpolate)
    assert record.declaration.handler is interpolate_handler and record.overrides_builtin


INTERPOLATE = {
    "nearest-x2": dict(scale_factor=2, mode="nearest"),
    "nearest-size": dict(size=(12, 9), mode="nearest"),
    "nearest-exact-1.5": dict(scale_factor=1.5, mode="nearest-exact"),
    "bilinear-align-1.5": dict(scale_factor=1.5, mode="bilinear", align_corners=True),
    "bilinear-size-down": dict(size=(7, 11), mode="bilinear", align_corners=False),
    "bilinear-0.6-recompute": dict(scale_factor=(1.3, 0.6), mode="bilinear", recompute_scale_factor=True),
    "bilinear-x2": dict(scale_factor=2, mode="bilinear"),
    "area-down": dict(size=(6, 4), mode="area"),
    "bicubic-align-1.5": dict(scale_factor=1.5, mode="bicubic", align_corners=True),
    "bicubic-size": dict(size=(23, 5), mode="bicubic"),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(INTERPOLATE))
@pytest.mark.parametrize("split", [[10, 7], [16, 1]], ids=["uneven", "tiny"])
def test_interpolate_matches_single_process(domain_mesh, name, split):
    x = torch.randn(2, 3, 17, 6, dtype=torch.float64)
    kwargs = INTERPOLATE[name]
    report = check_conformance(lambda t: F.interpolate(t, **kwargs), [x], ShardSpec(domain_mesh, [Shard(2)], split))
    row_bytes = 2 * 3 * 6 * 8  # a source row: batch x channels x width, doubles
    if kwargs["mode"].startswith("nearest"):
        assert report.comms.forward.total_calls == 0  # each output row lives with its source row
    elif kwargs["mode"] == "bicubic":
        assert report.comms.forward.total_bytes <= 3 * row_bytes  # taps reach 1 row left, 2 right
    elif kwargs["mode"] != "area":
        assert report.comms.forward.total_bytes <= row_bytes  # at most the right neighbour row


@pytest.mark.multirank(2)
def test_interpolate_1d_3d_and_upsample_module(domain_mesh):
    check_conformance(
        lambda t: F.interpolate(t, scale_factor=2.5, mode="linear", align_corners=True),
        [torch.randn(2, 3, 11)],
        ShardSpec(domain_mesh, [Shard(2)], [3, 8]),
    )
    check_conformance(
        torch.nn.Upsample(size=(9, 5, 4), mode="trilinear"),
        [torch.randn(1, 2, 7, 3, 5)],
        ShardSpec(domain_mesh, [Shard(3)], [1, 2]),
    )
    check_conformance(
        torch.nn.Upsample(scale_factor=3, mode="nearest"),
        [torch.randn(1, 2, 5, 4)],
        ShardSpec(domain_mesh, [Shard(3)], [3, 1]),
    )
    # 3-D nearest-exact with an unchanged size but scale 1.05: the kernel shifts rows (forward and backward).
    check_conformance(
        lambda t: F.interpolate(t, scale_factor=1.05, mode="nearest-exact"),
        [torch.randn(1, 2, 13, 3, 2)],
        ShardSpec(domain_mesh, [Shard(2)], [6, 7]),
    )


@pytest.mark.multirank(2)
def test_unsharded_spatial_dims_delegate_to_builtin(domain_mesh):
    # Batch-sharded: PhysicsNeMo's built-in runs the local op (scale_factor); size= is handled here.
    x = torch.randn(3, 2, 5, 4)
    spec = ShardSpec(domain_mesh, [Shard(0)], [2, 1])
    report = check_conformance(lambda t: F.interpolate(t, scale_factor=1.5, mode="bicubic"), [x], spec)
    assert report.comms.forward.total_calls == 0
    check_conformance(lambda t: F.interpolate(t, size=(7, 3), mode="bilinear", antialias=True), [x], spec)


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[1, 8, 0, 8], [15, 1, 0, 1]], ids=["empty-shard", "tiny"])
def test_interpolate_and_shuffle_on_four_ranks(domain_mesh, split):
    x = torch.randn(1, 4, 17, 5, dtype=torch.float64)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    check_conformance(lambda t: F.interpolate(t, scale_factor=1.7, mode="bilinear", align_corners=True), [x], spec)
    check_conformance(lambda t: F.interpolate(t, size=(6, 5), mode="nearest"), [x], spec)
    check_conformance(lambda t: F.pixel_shuffle(t, 2), [x], spec)
    check_conformance(lambda t: F.pixel_unshuffle(t[..., :16, :4], 2), [x], spec)


@pytest.mark.multirank(4)
def test_resampling_on_2d_spatial_mesh(spatial_mesh):
    x = torch.randn(1, 4, 11, 10, dtype=torch.float64)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [6, 5], 1: [3, 7]})
    check_conformance(lambda t: F.interpolate(t, size=(15, 4), mode="bilinear", align_corners=True), [x], spec)
    check_conformance(lambda t: F.interpolate(t, scale_factor=(0.5, 1.6), mode="nearest-exact"), [x], spec)
    check_conformance(lambda t: F.pixel_shuffle(t, 2), [x], spec)
    check_conformance(lambda t: F.pixel_unshuffle(t, (1)), [x], spec)
    check_conformance(
        torch.nn.PixelUnshuffle(2),
        [torch.randn(1, 1, 10, 12, dtype=torch.float64)],
        ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [3, 7], 1: [5, 7]}),
    )


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [8, 9]], ids=["uneven", "tiny", "odd"])
def test_pixel_shuffle_and_unshuffle_on_uneven_rows(domain_mesh, rank, split):
    x = torch.randn(2, 8, 17, 6, dtype=torch.float64)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    report = check_conformance(torch.nn.PixelShuffle(2), [x], spec)
    assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0
    report = check_conformance(lambda t: F.pixel_unshuffle(t[:, :, 1:], 2), [x], spec)  # 16 rows, groups of 2
    # Rows 1.. of each shard: a shard of odd length splits one group; its row moves (one row of 2x8x6 doubles).
    assert report.comms.forward.total_bytes <= 2 * 8 * 6 * 8


@pytest.mark.multirank(2)
def test_pixel_shuffle_channel_shards(domain_mesh):
    x = torch.randn(1, 12, 3, 5, dtype=torch.float64)
    check_conformance(lambda t: F.pixel_shuffle(t, 2), [x], ShardSpec(domain_mesh, [Shard(1)], [8, 4]))
    check_conformance(lambda t: F.pixel_unshuffle(t, 1), [x], ShardSpec(domain_mesh, [Shard(1)], [7, 5]))
    check_conformance(lambda t: F.pixel_unshuffle(t[..., :2, :4], 2), [x], ShardSpec(domain_mesh, [Shard(1)], [7, 5]))
    xs = shard_tensor(x, domain_mesh, [Shard(1)], [6, 6])
    with pytest.raises(MissingShardPatch, match="split groups of upscale_factor"):
        F.pixel_shuffle(xs, 2)


@pytest.mark.multirank(2)
def test_patch_moves_less_than_dtensor_fallback(domain_mesh):
    x = torch.randn(2, 4, 16, 8)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [8, 8])  # even: the fallback's forward works here
    spec = ShardSpec(domain_mesh, [Shard(2)], [8, 8])
    for fn, target in [
        (lambda t: F.interpolate(t, scale_factor=1.5, mode="bilinear", align_corners=True), F.interpolate),
        (lambda t: F.interpolate(t, size=(20, 8), mode="nearest"), F.interpolate),
    ]:
        patched = measure_comms(fn, [x], spec)
        with physicsnemo_shardext.disabled(targets=[target]), torch.no_grad(), CommCounter() as counted:
            fallback = fn(xs)
        # CommCounter sees the all-gather DTensor issues inside its dispatch: at least this rank's shard.
        assert counted.stats.total_bytes >= xs.to_local().nbytes
        assert patched.forward.total_bytes < counted.stats.total_bytes
        # Replicate output: the fallback gathered the whole input.
        assert fallback._spec.placements == (Replicate(),)
        torch.testing.assert_close(fallback.full_tensor(), fn(x))
        assert patched.forward.total_bytes <= xs.to_local().nbytes / 8  # at most one row of eight


@pytest.mark.multirank(2)
def test_unsupported_configurations_are_refused(domain_mesh):
    xs = shard_tensor(torch.randn(1, 2, 9, 4), domain_mesh, [Shard(2)], [5, 4])
    # 3-D nearest, size kept, scale 1.05: PyTorch's forward shifts rows but its backward copies them.
    x3 = shard_tensor(torch.randn(1, 2, 13, 3, 2), domain_mesh, [Shard(2)], [6, 7])
    with pytest.raises(MissingShardPatch, match="forward and backward disagree"):
        F.interpolate(x3, scale_factor=1.05, mode="nearest")
    with pytest.raises(MissingShardPatch, match="forward and backward disagree"):
        F.interpolate(xs, scale_factor=1.1, mode="bicubic")  # 9 rows stay 9 (bicubic's backward copies)
    with pytest.raises(MissingShardPatch, match="antialias=True"):
        F.interpolate(xs, size=(4, 4), mode="bilinear", antialias=True)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_partial_input_of_interpolate_is_delegated_to_the_builtin(domain_mesh, rank, mode):
    # Interpolation is linear in the input: the built-in resizes each rank's term of the Partial(sum).
    torch.manual_seed(0)
    full = torch.randn(1, 2, 4, 5)
    share = torch.rand(full.shape)
    local = full * share if rank == 0 else full * (1 - share)
    partial = ShardTensor.from_local(local, domain_mesh, [Partial()], sharding_shapes={})
    out = F.interpolate(partial, scale_factor=2, mode=mode)
    torch.testing.assert_close(out.full_tensor(), F.interpolate(full, scale_factor=2, mode=mode))
    with physicsnemo_shardext.disabled(plugins=["resampling"]):
        builtin = F.interpolate(partial, scale_factor=2, mode=mode)
    torch.testing.assert_close(out.to_local(), builtin.to_local())


PARTIAL_DELEGATED = {
    # name: (fn, input shape); a permutation (fallback) or linear resize (built-in): the Partial(sum) stays.
    "pixel_shuffle": (lambda t: F.pixel_shuffle(t, 2), (1, 8, 3, 3)),
    "pixel_unshuffle": (lambda t: F.pixel_unshuffle(t, 2), (1, 2, 4, 6)),
    "interpolate-bilinear": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), (1, 2, 4, 6)),
    "interpolate-bicubic-size": (lambda t: F.interpolate(t, size=(5, 9), mode="bicubic"), (1, 2, 4, 6)),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(PARTIAL_DELEGATED))
def test_partial_input_is_delegated_values_and_gradients(domain_mesh, rank, name):
    fn, shape = PARTIAL_DELEGATED[name]
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    # torch 2.13's fallback sums a pixel (un)shuffle's terms first; from 2.14 the Partial(sum) stays.
    summed_first = name.startswith("pixel") and torch_in("<2.14")
    check_delegation(fn, full, domain_mesh, rank, "resampling", (Replicate(),) if summed_first else (Partial(),))


CHUNKED = {
    "bilinear-x2": dict(scale_factor=2, mode="bilinear"),
    "bilinear-align-size-down": dict(size=(7, 11), mode="bilinear", align_corners=True),
    "bicubic-size": dict(size=(23, 5), mode="bicubic"),
    "nearest-exact-1.5": dict(scale_factor=1.5, mode="nearest-exact"),
}


def _one_row_chunks() -> Any:
    """Form the output one row at a time (every chunk boundary, halo piece and tap split exercised)."""
    from physicsnemo_shardext.patches import resampling

    saved = resampling._CHUNK_BYTES, resampling._CHUNKS
    resampling._CHUNK_BYTES, resampling._CHUNKS = 0, 10**9
    return resampling, saved


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(CHUNKED))
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [0, 17]], ids=["uneven", "tiny", "empty"])
def test_interpolate_in_row_chunks_with_second_order(domain_mesh, name, split):
    kwargs = CHUNKED[name]
    full = torch.randn(2, 3, 17, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def terms(x: Any) -> list[Any]:
        y = F.interpolate(x * x, **kwargs)
        (g,) = torch.autograd.grad(torch.sin(y).sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad((g * g).sum(), x)
        return [y, g, g2]

    expected = terms(full.clone().requires_grad_(True))
    module, saved = _one_row_chunks()
    try:
        check_conformance(lambda t: F.interpolate(t, **kwargs), [full], ShardSpec(domain_mesh, [Shard(2)], split))
        got = terms(shard_tensor(full, domain_mesh, [Shard(2)], split, requires_grad=True))
    finally:
        module._CHUNK_BYTES, module._CHUNKS = saved
    for what, a, e in zip(("output", "gradient", "second-order gradient"), got, expected):
        torch.testing.assert_close(a.full_tensor(), e, rtol=1e-9, atol=1e-11, msg=what)


@pytest.mark.multirank(4)
def test_interpolate_in_row_chunks_on_four_ranks_and_2d_mesh(domain_mesh):
    module, saved = _one_row_chunks()
    try:
        x = torch.randn(1, 4, 17, 5, dtype=torch.float64)
        for split in ([1, 8, 0, 8], [15, 1, 0, 1]):
            spec = ShardSpec(domain_mesh, [Shard(2)], split)
            check_conformance(
                lambda t: F.interpolate(t, scale_factor=1.7, mode="bicubic", align_corners=True), [x], spec
            )
            check_conformance(lambda t: F.interpolate(t, size=(6, 9), mode="bilinear"), [x], spec)
    finally:
        module._CHUNK_BYTES, module._CHUNKS = saved


@pytest.mark.multirank(2)
def test_interpolate_saves_no_block_sized_tensor(domain_mesh):
    # The output rows are formed from the block and its halo rows in chunks: the backward needs no data.
    x = shard_tensor(torch.randn(1, 4, 32, 16), domain_mesh, [Shard(2)], [17, 15], requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = F.interpolate(x, scale_factor=2, mode="bilinear")
    assert sum(t.numel() for t in saved) < x.to_local().numel() // 8, [tuple(t.shape) for t in saved]
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad.full_tensor(), torch.full((1, 4, 32, 16), 4.0))
