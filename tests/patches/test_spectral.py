"""Tests of the spectral-ops plugin (patches/spectral.py) and of whole FNO spectral blocks with patches/fft.py."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.nn.module.spectral_layers import SpectralConv2d, SpectralConv3d
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives.transpose import balanced_sizes
from physicsnemo_shardext.testing import ShardSpec, check_conformance, check_delegation, shard_tensor


def _sizes(t, dim: int, mesh_dim: int = 0) -> list[int]:
    return [s[dim] for s in t._spec.sharding_shapes()[mesh_dim]]


# -- mode slicing ---------------------------------------------------------------------------
SLICES = {
    "low": (slice(None), slice(None), slice(None, 3), slice(None, 4)),
    "negative": (Ellipsis, slice(-3, None), slice(None, 4)),
    "stepped": (Ellipsis, slice(1, None, 2)),
    "empty": (Ellipsis, slice(6, 6)),
    "int-on-local-dim": (0, Ellipsis, slice(2, 7)),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("key", sorted(SLICES))
@pytest.mark.parametrize("split", [[5, 3], [8, 0]], ids=["uneven", "empty-shard"])
def test_slicing_a_sharded_dim_is_local(domain_mesh, key, split):
    x = torch.randn(2, 3, 6, 8, dtype=torch.complex64)
    index = SLICES[key]
    expected = [Shard(2)] if key == "int-on-local-dim" else [Shard(3)]
    report = check_conformance(lambda t: t[index], [x], ShardSpec(domain_mesh, [Shard(3)], split),
                               expected_placements=expected)
    assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0


@pytest.mark.multirank(2)
def test_slice_gives_uneven_shards_with_empty_ones(domain_mesh):
    xs = shard_tensor(torch.randn(1, 2, 4, 9), domain_mesh, [Shard(3)], [5, 4])
    assert _sizes(xs[..., :4], 3) == [4, 0]
    assert _sizes(xs[..., -3:], 3) == [0, 3]
    assert _sizes(xs[..., 2:8:3], 3) == [1, 1]  # rows 2 and 5


@pytest.mark.multirank(2)
def test_other_index_forms_keep_the_fallback_values(domain_mesh):
    x = torch.randn(2, 3, 6, 8)
    xs = shard_tensor(x, domain_mesh, [Shard(3)], [4, 4])
    assert torch.equal(xs[:, :, :, 6].full_tensor(), x[:, :, :, 6])  # int on the sharded dim: DTensor path


# -- einsum -----------------------------------------------------------------------------------
class ModeMix(torch.nn.Module):
    """compl_mul2d of an FNO: einsum of the retained modes with complex weights stored as real pairs."""

    def __init__(self, ci: int, co: int, m1: int, m2: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(ci, co, m1, m2, 2))
        self.m1, self.m2 = m1, m2

    def forward(self, x_ft: torch.Tensor) -> torch.Tensor:
        modes = x_ft[:, :, : self.m1, : self.m2]
        return torch.einsum("bixy,ioxy->boxy", modes, torch.view_as_complex(self.weight))


@pytest.mark.multirank(2)
@pytest.mark.parametrize("params", ["distribute", "plain"])
@pytest.mark.parametrize("split", [[3, 3], [5, 1], [0, 6]], ids=["even", "uneven", "empty"])
def test_einsum_with_replicated_weights_sums_their_gradients(domain_mesh, params, split):
    x_ft = torch.randn(2, 3, 5, 6, dtype=torch.complex64)
    report = check_conformance(ModeMix(3, 4, 4, 4), [x_ft], ShardSpec(domain_mesh, [Shard(3)], split), params=params)
    assert report.comms.forward.total_calls == 0  # the forward is local
    assert set(report.comms.backward.counts) == {"c10d.allreduce_"}  # only the weight gradient is summed


class BlockMix(torch.nn.Module):
    """AFNO's block-diagonal channel mix: an einsum with '...' over the (sharded) spatial dims."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 3, 5))
        self.b = torch.nn.Parameter(torch.randn(2, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...bd,bdk,bk->...bk", x, self.w, self.b)


@pytest.mark.multirank(2)
def test_einsum_with_ellipsis_over_sharded_dims(domain_mesh):
    x = torch.randn(2, 7, 4, 2, 3)
    check_conformance(BlockMix(), [x], ShardSpec(domain_mesh, [Shard(1)], [6, 1]))


@pytest.mark.multirank(2)
def test_einsum_refuses_to_contract_a_sharded_index(domain_mesh):
    xs = shard_tensor(torch.randn(2, 3, 6), domain_mesh, [Shard(2)], [4, 2])
    with pytest.raises(MissingShardPatch, match=r"contracts sharded index.*'y'"):
        torch.einsum("bxy->bx", xs)
    other = shard_tensor(torch.randn(2, 3, 6), domain_mesh, [Shard(2)], [3, 3])
    with pytest.raises(MissingShardPatch, match="sharded differently"):
        torch.einsum("bxy,bxy->bxy", xs, other)


PARTIAL_EINSUMS = {
    "partial-times-weight": lambda t: torch.einsum("bi,io->bo", t, torch.arange(15.0).reshape(5, 3)),
    "spectral-mix": lambda t: torch.einsum("bixy,ioxy->boxy", t.reshape(1, 5, 5, 1),
                                           torch.linspace(-1, 1, 50).reshape(5, 2, 5, 1)),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", ["partial-times-weight", "spectral-mix"])
def test_einsum_with_a_partial_operand_is_delegated(domain_mesh, rank, name):
    # Linear in the Partial(sum) operand: the DTensor fallback keeps the pending sum (forward and grads right).
    full = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    check_delegation(PARTIAL_EINSUMS[name], full, domain_mesh, rank, "spectral", (Partial(),), exact=False)


@pytest.mark.multirank(2)
def test_setitem_refusals_where_the_fallback_fails_or_is_wrong(domain_mesh, rank):
    # Measured on 2 ranks with the plugin disabled: fill_/index_put_ have no strategy, so the
    # DTensor fallback raises for these; a misaligned value is covered in the test above.
    partial = ShardTensor.from_local(torch.randn(4, 3), domain_mesh, [Partial()], sharding_shapes={})
    target = partial * 1.0
    with pytest.raises(MissingShardPatch, match="Partial placement.*fallback fails too"):
        target[1:3] = 5.0
    xs = shard_tensor(torch.randn(5, 3), domain_mesh, [Shard(0)], [3, 2]) * 1.0
    with pytest.raises(MissingShardPatch, match="int index on sharded dim 0.*fallback fails too"):
        xs[3] = 7.0
    with physicsnemo_shardext.disabled(plugins=["spectral"]), pytest.raises(NotImplementedError, match="fill_"):
        xs[3] = 7.0


# -- slice assignment -------------------------------------------------------------------------
@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[4, 2], [6, 0]], ids=["uneven", "empty"])
def test_setitem_into_a_shard_tensor_buffer(domain_mesh, split):
    def fn(t):
        out = torch.zeros_like(t)
        out[:, :, :2, :3] = t[:, :, :2, :3] * 2
        out[..., -2:, :3] = t[..., -2:, :3].tanh()
        out[:, 0, 1:2] = 5.0
        return out

    report = check_conformance(fn, [torch.randn(2, 3, 5, 6)], ShardSpec(domain_mesh, [Shard(3)], split))
    assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0


@pytest.mark.multirank(2)
def test_setitem_into_a_plain_buffer_gathers_and_misaligned_values_are_refused(domain_mesh):
    full = torch.randn(2, 3, 5, 6)
    xs = shard_tensor(full, domain_mesh, [Shard(3)], [4, 2])
    plain = torch.zeros(2, 3, 5, 6)
    plain[:, :, :2, :3] = xs[:, :, :2, :3]  # a plain buffer is replicated: it receives the global values
    assert type(plain) is torch.Tensor
    expected = torch.zeros(2, 3, 5, 6)
    expected[:, :, :2, :3] = full[:, :, :2, :3]
    torch.testing.assert_close(plain, expected, rtol=0, atol=0)
    out = torch.zeros_like(xs)
    with pytest.raises(MissingShardPatch, match="does not match the target region"):
        out[:, :, :2, 3:] = xs[:, :, :2, :3]


# -- whole FNO spectral blocks ----------------------------------------------------------------
class TextbookSpectralConv2d(torch.nn.Module):
    """The classic FNO block: buffer + slice assignment of the two mode corners, then irfft2."""

    def __init__(self, channels: int, m1: int, m2: int, buffer: str) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(channels, channels, m1, m2, 2) / channels)
        self.w2 = torch.nn.Parameter(torch.randn(channels, channels, m1, m2, 2) / channels)
        self.m1, self.m2, self.buffer = m1, m2, buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m1, m2 = self.m1, self.m2
        x_ft = torch.fft.rfft2(x)
        if self.buffer == "zeros_like":
            out_ft = torch.zeros_like(x_ft)  # sharded like the spectrum
        else:
            out_ft = torch.zeros(x_ft.shape, dtype=torch.cfloat)  # plain: refused
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], torch.view_as_complex(self.w1))
        out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], torch.view_as_complex(self.w2))
        return torch.fft.irfft2(out_ft, s=x.shape[-2:])


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[5, 5], [9, 1], [10, 0]], ids=["even", "tiny", "empty"])
def test_fno_blocks_match_single_process(domain_mesh, split):
    x = torch.randn(2, 3, 10, 12)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    for block in (TextbookSpectralConv2d(3, 3, 4, "zeros_like"), SpectralConv2d(3, 3, 3, 4)):
        report = check_conformance(block, [x], spec, atol=1e-5)
        assert report.comms.forward.counts == {"c10d.alltoall_base_": 2}


@pytest.mark.multirank(2)
def test_textbook_block_with_a_plain_buffer_is_correct_and_replicated(domain_mesh):
    # out_ft = torch.zeros(...) is plain, i.e. replicated: the mode blocks are gathered into it
    # (forward: one all-gather per slice assignment, of the mode block only), irfft2 runs on the full
    # spectrum on every rank, and the skip connection's add cuts the result back to each rank's rows.
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.spectral = TextbookSpectralConv2d(3, 3, 4, "plain")
            self.skip = torch.nn.Conv2d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.spectral(x) + self.skip(x)

    x = torch.randn(2, 3, 10, 12)
    report = check_conformance(Layer(), [x], ShardSpec(domain_mesh, [Shard(2)], [6, 4]), atol=1e-5)
    assert report.comms.forward.counts.get("c10d.alltoall_base_") == 1  # rfft2 only; irfft2 is local
    assert sum(n for op, n in report.comms.forward.counts.items() if "gather" in op) >= 2


@pytest.mark.multirank(2)
def test_spectral_conv3d_matches(domain_mesh):
    x = torch.randn(1, 2, 6, 5, 8)
    check_conformance(SpectralConv3d(2, 2, 2, 2, 3), [x], ShardSpec(domain_mesh, [Shard(2)], [4, 2]), atol=1e-5)


@pytest.mark.multirank(4)
def test_fno_block_on_four_ranks_and_on_a_ddp_domain_mesh(domain_mesh, ddp_domain_mesh):
    x = torch.randn(2, 3, 11, 12)
    check_conformance(SpectralConv2d(3, 2, 3, 4), [x], ShardSpec(domain_mesh, [Shard(2)], [5, 3, 2, 1]), atol=1e-5)
    spec = ShardSpec(ddp_domain_mesh, [Shard(0), Shard(2)], {1: [8, 3]})
    check_conformance(SpectralConv2d(3, 2, 3, 4), [x], spec, atol=1e-5)


@pytest.mark.multirank(4)
def test_fno_blocks_on_a_2x2_pencil_mesh(spatial_mesh):
    # rfft2 of [Shard(H), Shard(W)] gives [Shard(W_f), Shard(H_f)]: slicing both mode corners, the
    # channel-contracting einsum, setitem into zeros_like and zeros + F.pad add all run on it.
    x = torch.randn(2, 3, 10, 12)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [6, 4], 1: [7, 5]})
    # 3 all-to-alls per pencil transform; SpectralConv2d adds one: the F.pad-ded high-H-mode block is
    # split differently on H_f from the low one, and the add moves its rows (replicated_add).
    for block, calls in ((TextbookSpectralConv2d(3, 3, 4, "zeros_like"), 6), (SpectralConv2d(3, 3, 3, 4), 7)):
        report = check_conformance(block, [x], spec, atol=1e-5, expected_placements=[Shard(2), Shard(3)])
        assert report.comms.forward.counts == {"c10d.alltoall_base_": calls}


# -- communication of a spectral layer --------------------------------------------------------
class SpectralLayer(torch.nn.Module):
    """rfft2 -> low-mode slice -> einsum -> irfft2 (the truncated spectrum is zero-filled by s=)."""

    def __init__(self, ci: int, co: int, m1: int, m2: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(ci, co, m1, m2, dtype=torch.cfloat))
        self.m1, self.m2 = m1, m2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ft = torch.fft.rfft2(x)
        y = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, : self.m1, : self.m2], self.w)
        return torch.fft.irfft2(y, s=x.shape[-2:])


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[8, 8], [13, 3]], ids=["even", "uneven"])
def test_spectral_layer_moves_each_local_spectrum_once_per_transpose(domain_mesh, rank, split):
    B, CI, CO, H, W, M1, M2 = 2, 3, 3, 16, 32, 4, 5
    x = torch.randn(B, CI, H, W)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    layer = SpectralLayer(CI, CO, M1, M2)
    report = check_conformance(layer, [x], spec, atol=1e-5)
    forward = report.comms.forward
    assert forward.counts == {"c10d.alltoall_base_": 2}  # all-to-alls only, one per transform
    # Analytic payload (complex64 = 8 bytes), a rank never sends the piece it keeps:
    #   rfft2 : local spectrum (B, CI, h_r, W//2+1) minus its own frequency columns w_r
    #   irfft2: local spectrum (B, CO, H, m2_r) after the H-ifft, minus its own rows h_r
    wf = W // 2 + 1
    freq_split = balanced_sizes(wf, 2)
    h_r, w_r = split[rank], freq_split[rank]
    m2_r = max(0, min(M2, sum(freq_split[: rank + 1])) - sum(freq_split[:rank]))
    analytic = 8 * (B * CI * h_r * (wf - w_r) + B * CO * m2_r * (H - h_r))
    local_spectra = 8 * (B * CI * h_r * wf + B * CO * m2_r * H)  # each local spectrum moved whole, once
    assert forward.total_bytes == analytic
    assert forward.total_bytes <= 1.25 * local_spectra
    if split[0] == split[1]:
        # The DTensor fallback (forward only: its backward is broken in 2.2.2, and uneven splits
        # desynchronize its collectives) all-gathers the field. Its collectives run inside DTensor's
        # dispatch, where CommCounter (a dispatch mode) can't see them, so CommDebugMode counts the
        # calls; an all-gather hands over at least this rank's field block, 4 * B*CI*h_r*W bytes.
        from torch.distributed.tensor.debug import CommDebugMode

        xs = shard_tensor(x, domain_mesh, [Shard(2)], split)
        with physicsnemo_shardext.disabled(plugins=["fft", "spectral"]), CommDebugMode() as fallback:
            layer(xs)
        counts = {str(op): n for op, n in fallback.get_comm_counts().items()}
        assert any("all_gather" in op for op in counts), counts
        assert forward.total_bytes < 4 * B * CI * h_r * W


# -- adding replicated tensors ----------------------------------------------------------------
class AddsEmbedding(torch.nn.Module):
    """AFNO's ``x + self.pos_embed``: a trainable replicated tensor broadcast against the shards."""

    def __init__(self, shape: tuple[int, ...], reverse: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(shape))
        self.reverse = reverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.add(self.embed, x) if self.reverse else x + self.embed


@pytest.mark.multirank(2)
@pytest.mark.parametrize("shape", [(1, 11, 4), (11, 1), (4,)], ids=["rows", "broadcast-rows", "trailing"])
@pytest.mark.parametrize("reverse", [False, True], ids=["x+e", "add(e,x)"])
def test_replicated_operand_is_cut_to_the_split_and_its_gradient_is_whole(domain_mesh, shape, reverse):
    # 11 rows split 8/3: the DTensor fallback re-cuts the replicated operand as 6/5 and fails.
    report = check_conformance(AddsEmbedding(shape, reverse), [torch.randn(2, 11, 4)],
                               ShardSpec(domain_mesh, [Shard(1)], [8, 3]))
    assert report.comms.forward.total_calls == 0


@pytest.mark.multirank(4)
def test_replicated_operand_on_a_2d_mesh(spatial_mesh):
    spec = ShardSpec(spatial_mesh, [Shard(1), Shard(2)], {0: [8, 3], 1: [1, 3]})
    check_conformance(AddsEmbedding((11, 4), False), [torch.randn(2, 11, 4)], spec)


class WritesATable(torch.nn.Module):
    """``out[...] = table``: a trainable replicated value written into a sharded buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(11, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        out[:, :, :2] = self.table
        return out * x


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[8, 3], [11, 0]], ids=["uneven", "empty-shard"])
def test_setitem_of_a_trainable_replicated_value_sums_its_gradient(domain_mesh, split):
    # Each rank writes only its rows of the table, so the table's gradient is summed over the shards.
    check_conformance(WritesATable(), [torch.randn(2, 11, 4)], ShardSpec(domain_mesh, [Shard(1)], split))
