"""Tests of the spectral-ops plugin (patches/indexing_einsum.py) and of whole FNO spectral blocks with patches/fft.py."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.nn.module.spectral_layers import SpectralConv2d, SpectralConv3d
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives import balanced_split_sizes
from physicsnemo_shardext.testing import ShardSpec, check_conformance, check_delegation, shard_tensor
from physicsnemo_shardext.torch_support import torch_in


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
    report = check_conformance(
        lambda t: t[index], [x], ShardSpec(domain_mesh, [Shard(3)], split), expected_placements=expected
    )
    assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0


@pytest.mark.multirank(2)
def test_slice_gives_uneven_shards_with_empty_ones(domain_mesh):
    xs = shard_tensor(torch.randn(1, 2, 4, 9), domain_mesh, [Shard(3)], [5, 4])
    assert _sizes(xs[..., :4], 3) == [4, 0]
    assert _sizes(xs[..., -3:], 3) == [0, 3]
    assert _sizes(xs[..., 2:8:3], 3) == [1, 1]  # rows 2 and 5


@pytest.mark.multirank(2)
def test_an_einsum_of_an_empty_mode_slice_does_not_pin_the_block(domain_mesh, rank):
    # FNO's mode product: rank 1 holds none of the low modes, so its slice is an empty view of
    # its whole block. The einsum must not save that view for the backward (it would keep
    # the block alive); the slice itself stays a view (torch's semantics).
    xs = shard_tensor(torch.randn(1, 2, 4, 9), domain_mesh, [Shard(3)], [5, 4], requires_grad=True)
    weight = torch.randn(2, 3, 4, requires_grad=True)
    low = xs[..., :4].contiguous()
    saved: list[int] = []

    def pack(t):
        local = t.to_local() if isinstance(t, ShardTensor) else t
        saved.append(local.untyped_storage().nbytes() if local.numel() == 0 else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.einsum("bixy,ioy->boxy", low, weight)
    assert sum(saved) == 0, saved  # no empty tensor saved that holds bytes
    (out * 2).sum().backward()
    full = xs.full_tensor().detach().requires_grad_(True)
    plain_weight = weight.detach().clone().requires_grad_(True)
    (torch.einsum("bixy,ioy->boxy", full[..., :4], plain_weight) * 2).sum().backward()
    torch.testing.assert_close(xs.grad.full_tensor(), full.grad)
    torch.testing.assert_close(weight.grad, plain_weight.grad)


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
@pytest.mark.parametrize("split", [[4, 2], [6, 0]], ids=["uneven", "empty"])
def test_einsum_contracting_a_sharded_index_sums_over_the_ranks(domain_mesh, split):
    # Each rank holds the sum over its own rows; one all-reduce makes the total, Replicate.
    report = check_conformance(
        lambda x: torch.einsum("bxy->bx", x),
        [torch.randn(2, 3, 6)],
        ShardSpec(domain_mesh, [Shard(2)], split),
        expected_placements=[Replicate()],
    )
    assert report.comms.forward.counts == {"c10d.allreduce_": 1}


@pytest.mark.multirank(2)
def test_einsum_with_an_index_sharded_differently_in_two_operands_is_refused(domain_mesh):
    xs = shard_tensor(torch.randn(2, 3, 6), domain_mesh, [Shard(2)], [4, 2])
    other = shard_tensor(torch.randn(2, 3, 6), domain_mesh, [Shard(2)], [3, 3])
    with pytest.raises(MissingShardPatch, match="sharded differently"):
        torch.einsum("bxy,bxy->bxy", xs, other)


PARTIAL_EINSUMS = {
    "partial-times-weight": lambda t: torch.einsum("bi,io->bo", t, torch.arange(15.0).reshape(5, 3)),
    "spectral-mix": lambda t: torch.einsum(
        "bixy,ioxy->boxy", t.reshape(1, 5, 5, 1), torch.linspace(-1, 1, 50).reshape(5, 2, 5, 1)
    ),
    "three-operands": lambda t: torch.einsum("bi,io,o->b", t, torch.arange(15.0).reshape(5, 3), torch.ones(3)),
    "two-partial-operands": lambda t: torch.einsum("bi,bi->b", t, t),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(PARTIAL_EINSUMS))
def test_einsum_with_a_partial_operand_is_delegated(domain_mesh, rank, name):
    # Linear in the Partial(sum) operand: the DTensor fallback keeps the pending sum (forward and grads right).
    full = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    check_delegation(PARTIAL_EINSUMS[name], full, domain_mesh, rank, "indexing_einsum", (Partial(),), exact=False)


# Einsums the local-block path cannot run, on torch.chunk splits (DTensor's own layout), where the
# DTensor fallback is right: (equation, [(shape, placement or None for a Partial(sum) operand, split)]).
CHUNK_LAYOUT_EINSUMS = {
    "partial-next-to-sharded": ("bi,bi->bi", [((4, 5), None, None), ((4, 5), Shard(0), [2, 2])]),
    "partial-next-to-sharded-weight": ("bi,io->bo", [((4, 5), None, None), ((5, 3), Shard(0), [3, 2])]),
}


def _einsum_operands(specs, mesh, rank, fulls, shares):
    ops, leaves = [], []
    for (_shape, placement, split), full, share in zip(specs, fulls, shares):
        if placement is None:
            local = (full * share if rank == 0 else full * (1 - share)).requires_grad_(True)
            ops.append(ShardTensor.from_local(local, mesh, [Partial()], sharding_shapes={}))
            leaves.append((local, False))
        else:
            ops.append(shard_tensor(full, mesh, [placement], split, requires_grad=True))
            leaves.append((ops[-1], True))
    return ops, leaves


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(CHUNK_LAYOUT_EINSUMS))
def test_einsums_on_torch_chunk_layouts_are_delegated(domain_mesh, rank, name):
    equation, specs = CHUNK_LAYOUT_EINSUMS[name]
    torch.manual_seed(0)
    fulls = [torch.randn(shape) for shape, _, _ in specs]
    shares = [torch.rand(shape) for shape, _, _ in specs]
    refs = [f.clone().requires_grad_(True) for f in fulls]
    ref = torch.einsum(equation, *refs)
    weight = torch.randn(ref.shape)
    (ref * weight).sum().backward()
    runs = []
    for disabled in (False, True):
        ops, leaves = _einsum_operands(specs, domain_mesh, rank, fulls, shares)
        if disabled:
            with physicsnemo_shardext.disabled(plugins=["indexing_einsum"]):
                out = torch.einsum(equation, *ops)
        else:
            out = torch.einsum(equation, *ops)
        torch.testing.assert_close(out.full_tensor(), ref)
        (out.full_tensor() * weight).sum().backward()
        grads = [leaf.grad.full_tensor() if sharded else leaf.grad for leaf, sharded in leaves]
        for grad, r in zip(grads, refs):
            torch.testing.assert_close(grad, r.grad)
        runs.append((tuple(out._spec.placements), out.to_local()))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1])


@pytest.mark.multirank(2)
@pytest.mark.parametrize("weight_dim", [0, 1], ids=["contracted", "output-index"])
def test_a_sharded_plain_dtensor_operand_is_delegated_on_chunk_layouts(domain_mesh, weight_dim):
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    x, w = torch.randn(4, 6), torch.randn(6, 4)
    x_ref = x.clone().requires_grad_(True)
    ref = torch.einsum("bi,io->bo", x_ref, w)
    weight = torch.randn(ref.shape)
    (ref * weight).sum().backward()
    xs = shard_tensor(x, domain_mesh, [Shard(0)], [2, 2], requires_grad=True)
    out = torch.einsum("bi,io->bo", xs, distribute_tensor(w, domain_mesh, [Shard(weight_dim)]))
    torch.testing.assert_close(out.full_tensor(), ref)
    (out.full_tensor() * weight).sum().backward()
    torch.testing.assert_close(xs.grad.full_tensor(), x_ref.grad)
    uneven = shard_tensor(x, domain_mesh, [Shard(0)], [3, 1])
    with pytest.raises(MissingShardPatch, match="a plain DTensor operand with placements"):
        torch.einsum("bi,io->bo", uneven, distribute_tensor(w, domain_mesh, [Shard(weight_dim)]))


@pytest.mark.multirank(2)
@pytest.mark.parametrize("splits", [([3, 1], [2, 3]), ([2, 2], [3, 2])], ids=["uneven", "chunk"])
def test_two_indices_on_one_mesh_dim_gather_the_second_operand(domain_mesh, splits):
    # "bi,ci->bci" with both operands sharded over the one mesh dim: the local blocks alone would give
    # only the diagonal blocks of the outer product. The output keeps b's split; y is gathered.
    specs = [ShardSpec(domain_mesh, [Shard(0)], splits[0]), ShardSpec(domain_mesh, [Shard(0)], splits[1])]
    report = check_conformance(
        lambda x, y: torch.einsum("bi,ci->bci", x, y), [torch.randn(4, 6), torch.randn(5, 6)], specs
    )
    assert report.comms.forward.counts, "y must be gathered"


@pytest.mark.multirank(2)
def test_operands_sharded_on_different_indices_of_one_mesh_dim(domain_mesh):
    # "bi,bi->bi", x split on i, y on b: y is gathered, the output keeps x's split of i.
    specs = [ShardSpec(domain_mesh, [Shard(1)], [5, 1]), ShardSpec(domain_mesh, [Shard(0)], [1, 3])]
    check_conformance(lambda x, y: torch.einsum("bi,bi->bi", x, y), [torch.randn(4, 6), torch.randn(4, 6)], specs)


@pytest.mark.multirank(2, timeout=60)
def test_a_partial_operand_next_to_an_uneven_shard_is_refused(domain_mesh, rank):
    # Measured with the plugin off: "bi,bi->bi" with a Shard(0) 3/1 operand makes one rank raise while
    # the other hangs; "bi,io->bo" with a Shard(0) 4/1 weight raises on both.
    partial = ShardTensor.from_local(torch.randn(4, 5), domain_mesh, [Partial()], sharding_shapes={})
    with pytest.raises(MissingShardPatch, match=r"a Partial operand next to a sharded one.*raises or hangs"):
        torch.einsum("bi,bi->bi", partial, shard_tensor(torch.randn(4, 5), domain_mesh, [Shard(0)], [3, 1]))
    with pytest.raises(MissingShardPatch, match="a Partial operand next to a sharded one"):
        torch.einsum("bi,io->bo", partial, shard_tensor(torch.randn(5, 3), domain_mesh, [Shard(0)], [4, 1]))


@pytest.mark.multirank(2)
def test_setitem_refusals_where_the_fallback_fails_or_is_wrong(domain_mesh, rank):
    # A misaligned value is covered in the test above.
    partial = ShardTensor.from_local(torch.randn(4, 3), domain_mesh, [Partial()], sharding_shapes={})
    target = partial * 1.0
    with pytest.raises(MissingShardPatch, match="Partial placement.*fallback fails too"):
        target[1:3] = 5.0
    xs = shard_tensor(torch.randn(5, 3), domain_mesh, [Shard(0)], [3, 2]) * 1.0
    with pytest.raises(MissingShardPatch, match="int index on sharded dim 0.*fallback fails too"):
        xs[3] = 7.0
    # What the refusal spares the user differs by torch (measured on 2 ranks, plugin disabled):
    # up to 2.14 the fallback raises; from 2.15 it completes and writes the wrong rows.
    expected = xs.full_tensor()
    expected[3] = 7.0
    with physicsnemo_shardext.disabled(plugins=["indexing_einsum"]):
        if torch_in("<2.15"):
            with pytest.raises(NotImplementedError, match="fill_"):
                xs[3] = 7.0
        else:
            xs[3] = 7.0
            assert not torch.equal(xs.full_tensor(), expected)


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
    # 3 all-to-alls per pencil transform and nothing else: SpectralConv2d's F.pad-ded low- and
    # high-H-mode blocks take the same balanced split on H_f (a constant pad moves no row), so their
    # add moves nothing (with the padding all on the last rank, it moved the high block's rows).
    for block in (TextbookSpectralConv2d(3, 3, 4, "zeros_like"), SpectralConv2d(3, 3, 3, 4)):
        report = check_conformance(block, [x], spec, atol=1e-5, expected_placements=[Shard(2), Shard(3)])
        assert report.comms.forward.counts == {"c10d.alltoall_base_": 6}, report.comms.forward.counts


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
    freq_split = balanced_split_sizes(wf, 2)
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
        with physicsnemo_shardext.disabled(plugins=["fft", "indexing_einsum"]), CommDebugMode() as fallback:
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
    report = check_conformance(
        AddsEmbedding(shape, reverse), [torch.randn(2, 11, 4)], ShardSpec(domain_mesh, [Shard(1)], [8, 3])
    )
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


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    "target_placement, split",
    [("replicate", [2, 2]), ("replicate", [3, 1]), ("shard", [2, 2])],
    ids=["replicate-even", "replicate-uneven", "shard-chunks"],
)
def test_setitem_into_a_plain_dtensor_is_delegated_where_the_fallback_is_right(domain_mesh, target_placement, split):
    from torch.distributed.tensor import Replicate, distribute_tensor

    base, value = torch.zeros(4, 6), torch.randn(4, 2)
    expected = base.clone()
    expected[:, 1:3] = value
    results = []
    for disabled in (False, True):
        target = distribute_tensor(
            base.clone(), domain_mesh, [Replicate() if target_placement == "replicate" else Shard(0)]
        )
        vs = shard_tensor(value, domain_mesh, [Shard(0)], split)
        if disabled:
            with physicsnemo_shardext.disabled(plugins=["indexing_einsum"]):
                target[:, 1:3] = vs
        else:
            target[:, 1:3] = vs
        torch.testing.assert_close(target.full_tensor(), expected)
        results.append((tuple(target.placements), target.to_local()))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.multirank(2)
def test_setitem_into_a_shard_dtensor_with_an_uneven_value_is_refused(domain_mesh):
    from torch.distributed.tensor import distribute_tensor

    target = distribute_tensor(torch.zeros(4, 6), domain_mesh, [Shard(0)])
    with pytest.raises(MissingShardPatch, match="cannot write into a DTensor target.*hangs one rank"):
        target[:, 1:3] = shard_tensor(torch.randn(4, 2), domain_mesh, [Shard(0)], [3, 1])


# -- matmul / bmm -------------------------------------------------------------------------
def _slice_tokens(w, x):  # Transolver's physics attention: points -> slice tokens (contracts the points)
    return torch.matmul(w.transpose(-1, -2), x)


def _hand_written_attention(q, k, v):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # q's rows against every key: k gathered
    return torch.softmax(scores, dim=-1) @ v  # the probabilities keep q's rows; v gathered


MATMULS = {
    # name: (fn, shapes, sharded dim per operand (None: plain), expected output placement)
    "contract-points": (_slice_tokens, [(1, 2, 9, 3), (1, 2, 9, 4)], [2, 2], Replicate()),
    "rows-times-plain-weight": (torch.matmul, [(1, 9, 4), (4, 3)], [1, None], Shard(1)),
    "plain-weight-times-columns": (torch.matmul, [(3, 9), (2, 9, 5)], [None, 1], Replicate()),
    "bmm-contract": (lambda a, b: torch.bmm(a.transpose(1, 2), b), [(2, 9, 3), (2, 9, 4)], [1, 1], Replicate()),
    "batch-sharded-bmm": (torch.bmm, [(9, 3, 4), (9, 4, 2)], [0, 0], Shard(0)),
    "vector-dot": (torch.matmul, [(9,), (9,)], [0, 0], Replicate()),
    "hand-written-attention": (_hand_written_attention, [(1, 2, 9, 4)] * 3, [2, 2, 2], Shard(2)),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(MATMULS))
@pytest.mark.parametrize("split", [[5, 4], [9, 0]], ids=["uneven", "empty"])
def test_matmul_matches_single_process(domain_mesh, name, split):
    fn, shapes, dims, placement = MATMULS[name]
    inputs = [torch.randn(*shape) for shape in shapes]
    specs = [None if d is None else ShardSpec(domain_mesh, [Shard(d)], split) for d in dims]
    check_conformance(fn, inputs, specs, expected_placements=[placement])


@pytest.mark.multirank(2)
def test_matmul_operator_forms(domain_mesh):
    w, x = torch.randn(9, 3), torch.randn(9, 4)
    spec = ShardSpec(domain_mesh, [Shard(0)], [6, 3])
    check_conformance(lambda a, b: a.transpose(0, 1) @ b, [w, x], spec, expected_placements=[Replicate()])
    check_conformance(lambda a, b: a.transpose(0, 1).matmul(b), [w, x], spec, expected_placements=[Replicate()])
    # plain @ ShardTensor goes through __rmatmul__ on the ShardTensor side
    check_conformance(lambda b: torch.ones(2, 9) @ b, [x], spec, expected_placements=[Replicate()])


@pytest.mark.multirank(4)
def test_slice_tokens_on_four_ranks_and_a_2x2_mesh(domain_mesh, spatial_mesh):
    w, x = torch.randn(2, 2, 13, 3), torch.randn(2, 2, 13, 4)
    check_conformance(
        _slice_tokens, [w, x], ShardSpec(domain_mesh, [Shard(2)], [0, 6, 4, 3]), expected_placements=[Replicate()]
    )
    # batch over mesh dim 0, points over mesh dim 1: the sum runs over mesh dim 1 only
    spec = ShardSpec(spatial_mesh, [Shard(0), Shard(2)], {0: [1, 1], 1: [8, 5]})
    check_conformance(_slice_tokens, [w, x], spec, expected_placements=[Shard(0), Replicate()])
    check_conformance(_hand_written_attention, [torch.randn(2, 2, 13, 4) for _ in range(3)], spec)


@pytest.mark.multirank(2)
def test_matmul_broadcasting_a_batch_dim_keeps_the_fallback(domain_mesh):
    # (2, 8, 4) @ (1, 4, 3): a size-1 batch dim broadcast is no einsum; the fallback runs it, as before.
    a, b = torch.randn(2, 8, 4), torch.randn(1, 4, 3)
    outs = []
    for disabled in (False, True):
        with physicsnemo_shardext.disabled(plugins=["indexing_einsum"] if disabled else []):
            out = torch.matmul(shard_tensor(a, domain_mesh, [Shard(1)], [4, 4]), b)
        torch.testing.assert_close(out.full_tensor(), a @ b)
        outs.append((tuple(out.placements), out.to_local()))
    assert outs[0][0] == outs[1][0]
    assert torch.equal(outs[0][1], outs[1][1])
