"""Tests of the padding plugin (patches/padding.py): F.pad on sharded dims, circular included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.padding import sharded_pad
from physicsnemo_shardext.testing import ShardSpec, check_conformance, measure_comms, shard_tensor


def test_plugin_overrides_the_builtin_pad():
    record = physicsnemo_shardext.get_registry().provenance(F.pad)
    assert record is not None and record.declaration.handler is sharded_pad


def _pad(pad, mode, value=None):
    def fn(x):
        return F.pad(x, pad, mode=mode, value=value) if mode == "constant" else F.pad(x, pad, mode=mode)

    fn.__name__ = f"pad_{mode}"
    return fn


def _sizes(y: ShardTensor, mesh_dim: int, dim: int) -> list[int]:
    return [s[dim] for s in y._spec.sharding_shapes()[mesh_dim]]


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    ("mode", "split"),
    [("circular", [16, 1]), ("circular", [1, 16]), ("reflect", [1, 16]), ("replicate", [16, 1]), ("constant", [10, 7])],
    ids=["circular-tiny-last", "circular-tiny-first", "reflect-tiny-first", "replicate-tiny-last", "constant-uneven"],
)
def test_pad_along_sharded_and_unsharded_dims(domain_mesh, mode, split):
    # Pads of 3 on the sharded dim reach past a 1-row boundary shard: rows come from the far rank.
    x = torch.randn(2, 3, 17, 5, dtype=torch.float64)
    report = check_conformance(_pad((1, 2, 3, 2), mode, 0.5), [x], ShardSpec(domain_mesh, [Shard(2)], split))
    assert report.output_placements == [(Shard(2),)]


@pytest.mark.multirank(2)
def test_circular_output_grows_on_boundary_shards_and_moves_only_wrap_rows(domain_mesh):
    x = torch.randn(1, 4, 17, 6)
    spec = ShardSpec(domain_mesh, [Shard(2)], [10, 7])
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [10, 7])
    y = F.pad(xs, (0, 0, 2, 3), mode="circular")
    assert _sizes(y, 0, 2) == [12, 10] and y.shape == (1, 4, 22, 6)
    torch.testing.assert_close(y.full_tensor(), F.pad(x, (0, 0, 2, 3), mode="circular"))
    comms = measure_comms(_pad((0, 0, 2, 3), "circular"), [x], spec)
    # Bound: rank 0 sends its 3 first rows to rank 1; rank 1 sends its 2 last rows (row = 4*6 floats).
    row_bytes = 4 * 6 * 4
    assert comms.forward.counts == {"c10d.alltoall_base_": 1}
    assert comms.forward.total_bytes <= 3 * row_bytes
    assert comms.backward.total_bytes <= 3 * row_bytes
    # The built-in refuses circular padding outright.
    with physicsnemo_shardext.disabled(plugins=["padding"]):
        with pytest.raises(Exception, match="[Cc]ircular"):
            F.pad(xs, (0, 0, 2, 3), mode="circular")


@pytest.mark.multirank(2)
def test_dtensor_fallback_is_no_alternative(domain_mesh):
    # What the patch replaces, without it and without the built-in (pure DTensor fallback):
    # circular pad comes back Replicate and wrong (each rank wraps its own shard) unless the
    # uneven_redistribute plugin refuses DTensor's redistribution of the 10/7 split; reflect and
    # replicate have no sharding strategy at all.
    x = torch.randn(1, 4, 17, 6)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [10, 7])
    with physicsnemo_shardext.disabled(targets=[F.pad]):
        with pytest.raises(MissingShardPatch, match="DTensor would compute wrong values"):
            F.pad(xs, (0, 0, 3, 3), mode="circular")
        with physicsnemo_shardext.disabled(plugins=["uneven_redistribute"]):
            y = F.pad(xs, (0, 0, 3, 3), mode="circular")
        assert not torch.allclose(y.full_tensor(), F.pad(x, (0, 0, 3, 3), mode="circular"))
        for mode in ("reflect", "replicate"):
            with pytest.raises(NotImplementedError, match="sharding strategy"):
                F.pad(xs, (0, 0, 3, 3), mode=mode)
    y = F.pad(xs, (0, 0, 3, 3), mode="reflect")
    torch.testing.assert_close(y.full_tensor(), F.pad(x, (0, 0, 3, 3), mode="reflect"))


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[5, 4, 4, 4], [1, 14, 1, 1]], ids=["even-ish", "tiny"])
def test_circular_on_four_ranks_wider_than_neighbours(domain_mesh, split):
    x = torch.randn(2, 2, 17)
    check_conformance(_pad((3, 2), "circular"), [x], ShardSpec(domain_mesh, [Shard(2)], split))


@pytest.mark.multirank(4)
@pytest.mark.parametrize("mode", ["circular", "reflect", "constant"])
def test_pad_both_dims_of_a_2d_mesh(spatial_mesh, mode):
    x = torch.randn(1, 2, 9, 7)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [6, 3], 1: [2, 5]})
    report = check_conformance(
        _pad((2, 1, 1, 2), mode) if mode != "constant" else _pad((2, 9, 1, 2), mode, 0.5), [x], spec
    )
    assert report.output_placements == [(Shard(2), Shard(3))]


@pytest.mark.multirank(4)
def test_pad_on_ddp_domain_mesh(ddp_domain_mesh):
    x = torch.randn(2, 2, 11, 6)
    spec = ShardSpec(ddp_domain_mesh, [Replicate(), Shard(2)], {1: [8, 3]})
    check_conformance(_pad((1, 1, 2, 2), "circular"), [x], spec)
    check_conformance(_pad((1, 1, 2, 2), "constant", 0.0), [x], spec)


@pytest.mark.multirank(2)
def test_complex_spectrum_padding(domain_mesh):
    # FNO-style: zero-pad a complex spectrum along a sharded dim (local), and a periodic variant.
    x = torch.randn(1, 2, 9, 5, dtype=torch.complex64)
    spec = ShardSpec(domain_mesh, [Shard(2)], [6, 3])
    report = check_conformance(_pad((0, 3, 0, 4), "constant", 0.0), [x], spec)
    assert report.comms.forward.total_calls == 0
    check_conformance(_pad((0, 3, 2, 4), "circular"), [x], spec)


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    "split,pad,expected",
    [([16, 0], (0, 113), [65, 64]), ([3, 3], (2, 2), [5, 5]), ([4, 0], (0, 6), [5, 5]), ([9, 7], (1, 1), [10, 8])],
    ids=["fno-spectrum", "even", "empty-last", "data-would-move"],
)
def test_constant_pad_takes_the_balanced_split_where_no_row_moves(domain_mesh, split, pad, expected):
    # An FNO pads its 16 kept modes back to 129 columns: the empty rank holds padding, not the
    # last rank all 113 columns. Where a rank's rows would have to move, the first coordinate
    # takes the left pad and the last the right (the last case: 10/8, not 9/9).
    x = torch.randn(1, 2, sum(split), 3, dtype=torch.complex64)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    report = check_conformance(_pad((0, 0, *pad), "constant", 0.0), [x], spec)
    assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0
    out = F.pad(shard_tensor(x, domain_mesh, [Shard(2)], split), (0, 0, *pad))
    assert [s[2] for s in out._spec.sharding_shapes()[0]] == expected
    torch.testing.assert_close(out.full_tensor(), F.pad(x, (0, 0, *pad)), rtol=0, atol=0)


@pytest.mark.multirank(2)
def test_constant_crop_on_sharded_dim(domain_mesh):
    x = torch.randn(1, 2, 17, 5)
    # Plain crop; a crop wider than the first shard (11 > 10 rows); crop and pad mixed.
    for pad in [(0, 0, -3, -8), (0, 0, -11, 2), (1, -2, 2, -1)]:
        report = check_conformance(_pad(pad, "constant", 1.5), [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
        assert report.comms.forward.total_calls == 0


@pytest.mark.multirank(2)
def test_refusals(domain_mesh, rank):
    xs = shard_tensor(torch.randn(1, 2, 9, 4), domain_mesh, [Shard(2)], [5, 4])
    with pytest.raises(MissingShardPatch, match="negative pads.*circular"):
        F.pad(xs, (0, 0, -1, 2), mode="circular")
    partial = ShardTensor.from_local(torch.randn(1, 2, 3, 4), domain_mesh, [Partial()], sharding_shapes={})
    with pytest.raises(MissingShardPatch, match=r"value=1.0\): input has a Partial placement"):
        F.pad(partial, (1, 1), mode="constant", value=1.0)  # would add the 1 once per rank
    with pytest.raises(MissingShardPatch, match=r"mode='circular'.*Partial"):
        F.pad(partial, (1, 1), mode="circular")
    with pytest.raises(RuntimeError, match="wrapping around more than once"):
        F.pad(xs, (0, 0, 10, 0), mode="circular")  # torch's own error, from the global shape


@pytest.mark.multirank(2)
@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_partial_input_is_delegated_to_the_builtin(domain_mesh, rank, mode):
    # Zero, mirrored or repeated padding is linear in the input: the built-in pads each rank's term.
    torch.manual_seed(0)
    full = torch.randn(2, 3, 5)
    share = torch.rand(full.shape)
    local = (full * share if rank == 0 else full * (1 - share)).requires_grad_(True)
    partial = ShardTensor.from_local(local, domain_mesh, [Partial()], sharding_shapes={})
    out = F.pad(partial, (1, 2), mode=mode)
    torch.testing.assert_close(out.full_tensor(), F.pad(full, (1, 2), mode=mode))
    with physicsnemo_shardext.disabled(plugins=["padding"]):
        builtin = F.pad(partial, (1, 2), mode=mode)
    assert tuple(out._spec.placements) == tuple(builtin._spec.placements) == (Partial(),)
    torch.testing.assert_close(out.to_local(), builtin.to_local())


def _saved_bytes(fn, x) -> int:
    """Bytes saved for the backward by ``fn(x)``, each storage once (a ShardTensor counted by its block)."""
    seen: dict[int, int] = {}

    def pack(t):
        local = t.to_local() if isinstance(t, ShardTensor) else t
        if local.is_floating_point():
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


@pytest.mark.multirank(1)
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "constant"])
def test_one_rank_mesh_pads_like_plain_tensors(domain_mesh, mode):
    # Nothing is split: one F.pad of the block, bit for bit the plain result and gradient,
    # saving no more than a plain F.pad (the Pix2Pix one-rank cost came from a two-step pad).
    full = torch.randn(1, 4, 12, 9, dtype=torch.float64)
    fn = _pad((3, 2, 3, 1), mode, 0.5)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [12], requires_grad=True)
    plain = full.clone().requires_grad_(True)
    out, expected = fn(x), fn(plain)
    assert torch.equal(out.full_tensor(), expected)
    cotangent = torch.randn_like(expected)
    out.backward(shard_tensor(cotangent, domain_mesh, [Shard(2)], [expected.shape[2]]))
    expected.backward(cotangent)
    assert torch.equal(x.grad.full_tensor(), plain.grad)
    assert _saved_bytes(fn, x) <= _saved_bytes(fn, plain)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("mode", ["reflect", "circular"])
def test_pad_along_both_dims_saves_only_the_block(domain_mesh, mode):
    # The unsharded dim pads first (saving the block, as plain F.pad saves its input); the
    # exchange after it saves nothing, so no padded copy lives on until the backward.
    full = torch.randn(1, 4, 16, 9, dtype=torch.float64)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [10, 6], requires_grad=True)
    block_bytes = x.to_local().untyped_storage().nbytes()
    assert _saved_bytes(_pad((2, 2, 1, 1), mode), x) <= block_bytes
    check_conformance(_pad((2, 2, 1, 1), mode), [full], ShardSpec(domain_mesh, [Shard(2)], [10, 6]))
