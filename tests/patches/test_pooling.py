"""Tests of the pooling plugin (patches/pooling.py): windows across uneven shards, adaptive pooling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.pooling import adaptive_pool_handler, pool_handler
from physicsnemo_shardext.testing import (
    CommCounter,
    ShardSpec,
    check_conformance,
    check_delegation,
    measure_comms,
    partial_terms,
    shard_tensor,
)
from physicsnemo_shardext.torch_support import torch_in

POOLS = {
    "max-k2-odd-shards": lambda x: F.max_pool2d(x, 2),
    "max-k3-s2-p1": lambda x: F.max_pool2d(x, 3, stride=2, padding=1),
    "max-k3-s1-dil2-ceil": lambda x: F.max_pool2d(x, (3, 2), stride=(1, 2), dilation=(2, 1), ceil_mode=True),
    "avg-k3-s2-p1-nopad-ceil": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    "avg-k4-s3-p2-incl-ceil": lambda x: F.avg_pool2d(x, 4, 3, 2, ceil_mode=True),
    "avg-k2-s1-divisor": lambda x: F.avg_pool2d(x, 2, 1, divisor_override=3),
    # Floor mode: the halo-strip average pool, its edge divisors counting padding or not.
    "avg-k3-s2-p1-nopad": lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
    "avg-k5-s1-p2-incl": lambda x: F.avg_pool2d(x, 5, 1, 2),
}


def test_every_pool_is_installed_by_the_plugin():
    registry = physicsnemo_shardext.get_registry()
    for target, handler in [
        (F.max_pool2d, pool_handler),
        (F.avg_pool3d, pool_handler),
        (F.max_pool1d_with_indices, pool_handler),
        (F.adaptive_max_pool3d, adaptive_pool_handler),
        (F.adaptive_avg_pool1d, adaptive_pool_handler),
    ]:
        record = registry.provenance(target)
        assert record is not None and record.declaration.handler is handler
    assert registry.provenance(F.max_pool2d).overrides_builtin


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(POOLS))
@pytest.mark.parametrize("split", [[10, 7], [16, 1]], ids=["uneven", "tiny"])
def test_pool_matches_single_process(domain_mesh, name, split):
    x = torch.randn(2, 3, 17, 6, dtype=torch.float64)
    report = check_conformance(POOLS[name], [x], ShardSpec(domain_mesh, [Shard(2)], split))
    # Windows only reach right: at most (effective kernel - 1) rows of 2*3*6 doubles cross.
    row_bytes = 2 * 3 * 6 * 8
    assert report.comms.forward.total_bytes <= 4 * row_bytes


@pytest.mark.multirank(2)
@pytest.mark.parametrize("dims", [1, 3])
def test_1d_and_3d_pools_and_unbatched_input(domain_mesh, dims):
    if dims == 1:
        x, spec_dim = torch.randn(3, 13, dtype=torch.float64), 1  # unbatched (C, L)
        fns = [
            lambda t: F.max_pool1d(t, 3, 2, 1, ceil_mode=True),
            lambda t: F.avg_pool1d(t, 3, 2, 1, count_include_pad=False),
        ]
    else:
        x, spec_dim = torch.randn(1, 2, 9, 4, 5, dtype=torch.float64), 2
        fns = [lambda t: F.max_pool3d(t, 3, 2, 1), lambda t: F.avg_pool3d(t, (2, 3, 2), (3, 1, 2), ceil_mode=True)]
    for fn in fns:
        check_conformance(fn, [x], ShardSpec(domain_mesh, [Shard(spec_dim)], [x.shape[spec_dim] - 2, 2]))


@pytest.mark.multirank(2)
def test_max_pool_indices_are_global_and_modules_work(domain_mesh):
    x = torch.randn(2, 3, 17, 6, dtype=torch.float64)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [10, 7])
    values, indices = F.max_pool2d(xs, 3, 2, 1, return_indices=True)
    ref_values, ref_indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    assert torch.equal(values.full_tensor(), ref_values) and torch.equal(indices.full_tensor(), ref_indices)
    assert (
        indices.to_local().shape[2] == [5, 4][xs._spec.mesh.get_coordinate()[0]]
    )  # window centres 0,2,..,8 / 10,..,16
    # Round trip through max_unpool with global indices (a plain-tensor op on the full tensors).
    torch.testing.assert_close(
        F.max_unpool2d(values.full_tensor(), indices.full_tensor(), 3, 2, 1, output_size=x.shape[2:]),
        F.max_unpool2d(ref_values, ref_indices, 3, 2, 1, output_size=x.shape[2:]),
    )
    check_conformance(
        torch.nn.MaxPool1d(3, 2, return_indices=True),
        [torch.randn(2, 3, 11)],
        ShardSpec(domain_mesh, [Shard(2)], [4, 7]),
    )


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[5, 4, 4, 4], [1, 8, 0, 8], [15, 1, 0, 1]], ids=["even-ish", "empty-shard", "tiny"])
def test_pools_on_four_ranks_with_empty_and_one_row_shards(domain_mesh, split):
    x = torch.randn(1, 2, 17, 5, dtype=torch.float64)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    check_conformance(POOLS["max-k3-s1-dil2-ceil"], [x], spec)
    check_conformance(POOLS["avg-k3-s2-p1-nopad-ceil"], [x], spec)


@pytest.mark.multirank(4)
def test_pools_on_2d_spatial_mesh(spatial_mesh):
    x = torch.randn(1, 2, 11, 9, dtype=torch.float64)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [6, 5], 1: [2, 7]})
    check_conformance(POOLS["max-k3-s2-p1"], [x], spec)
    check_conformance(POOLS["avg-k4-s3-p2-incl-ceil"], [x], spec)
    check_conformance(lambda t: F.adaptive_max_pool2d(t, (4, 3), return_indices=True), [x], spec)
    check_conformance(lambda t: F.adaptive_avg_pool2d(t, 1), [x], spec, expected_placements=[Replicate(), Replicate()])


ADAPTIVE = {
    "avg-5": lambda x: F.adaptive_avg_pool2d(x, (5, 4)),
    "avg-none-3": lambda x: F.adaptive_avg_pool2d(x, (None, 3)),
    "avg-up-23": lambda x: F.adaptive_avg_pool2d(x, (23, 2)),
    "max-5-indices": lambda x: F.adaptive_max_pool2d(x, (5, 4), return_indices=True),
    "max-7": lambda x: F.adaptive_max_pool2d(x, 7),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(ADAPTIVE))
@pytest.mark.parametrize("split", [[10, 7], [16, 1]], ids=["uneven", "tiny"])
def test_adaptive_pool_matches_single_process(domain_mesh, name, split):
    x = torch.randn(2, 3, 17, 6, dtype=torch.float64)
    check_conformance(ADAPTIVE[name], [x], ShardSpec(domain_mesh, [Shard(2)], split))


@pytest.mark.multirank(4)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_global_adaptive_pool_all_reduces_channels_only(domain_mesh, dims):
    shape = {1: (2, 3, 17), 2: (2, 3, 17, 4), 3: (2, 3, 17, 3, 2)}[dims]
    x = torch.randn(shape, dtype=torch.float64)
    spec = ShardSpec(domain_mesh, [Shard(2)], [6, 1, 0, 10])
    avg = getattr(F, f"adaptive_avg_pool{dims}d")
    mx = getattr(F, f"adaptive_max_pool{dims}d")
    out = (1,) + (2,) * (dims - 1)
    report = check_conformance(lambda t: avg(t, out), [x], spec, expected_placements=[Replicate()])
    per_output = 2 * 3 * 2 ** (dims - 1) * 8  # batch x channels x other output sizes, doubles
    assert report.comms.forward.total_bytes == per_output  # one all-reduce of the result
    report = check_conformance(
        lambda t: mx(t, out, return_indices=True), [x], spec, expected_placements=[[Replicate()]] * 2
    )
    assert report.comms.forward.total_bytes == 3 * per_output  # max, tie-break index, winner's value


@pytest.mark.multirank(2)
def test_global_adaptive_max_ties_resolve_like_pytorch(domain_mesh):
    # Equal maxima on both ranks and inside rows: PyTorch picks the first in row-major order.
    x = torch.zeros(1, 1, 6, 4, dtype=torch.float64)
    x[0, 0, 4, 0] = x[0, 0, 1, 3] = x[0, 0, 1, 1] = 5.0
    spec = ShardSpec(domain_mesh, [Shard(3)], [2, 2])  # width sharded: rank 1 holds (1,3), rank 0 (1,1)
    report = check_conformance(
        lambda t: F.adaptive_max_pool2d(t, 1, return_indices=True), [x], spec, expected_placements=[[Replicate()]] * 2
    )
    xs = shard_tensor(x, domain_mesh, [Shard(3)], [2, 2])
    assert F.adaptive_max_pool2d(xs, 1, return_indices=True)[1].full_tensor().item() == 5  # row 1, col 1
    assert report.max_abs_errors


@pytest.mark.multirank(2)
def test_patch_moves_less_than_dtensor_fallback(domain_mesh, rank):
    x = torch.randn(2, 4, 16, 8)
    spec = ShardSpec(domain_mesh, [Shard(2)], [8, 8])  # even: the fallback's forward works here
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [8, 8])
    shard_bytes = xs.to_local().nbytes
    cases = [
        (lambda t: F.max_pool2d(t, 3, 1, 1), F.max_pool2d),
        (lambda t: F.adaptive_avg_pool2d(t, 3), F.adaptive_avg_pool2d),
        (lambda t: F.adaptive_max_pool2d(t, 1), F.adaptive_max_pool2d),
    ]
    for fn, target in cases:
        patched = measure_comms(fn, [x], spec)
        with physicsnemo_shardext.disabled(targets=[target]), torch.no_grad(), CommCounter() as counted:
            fallback = fn(xs)
        # CommCounter sees the all-gather DTensor issues inside its dispatch: at least this rank's shard.
        assert counted.stats.total_bytes >= xs.to_local().nbytes
        assert patched.forward.total_bytes < counted.stats.total_bytes
        # The fallback gathers the whole input (its output comes back Replicate).
        assert fallback._spec.placements == (Replicate(),)
        torch.testing.assert_close(fallback.full_tensor(), fn(x))
        assert patched.forward.total_bytes < shard_bytes / 2, patched.forward
    # Each output row goes to the owner of its window's centre: rank 0 computes rows 0..7 and needs
    # input row 8, rank 1 rows 8..15 and needs row 7: one row each way (the bound), not two one way.
    assert measure_comms(cases[0][0], [x], spec).forward.total_bytes == [2 * 4 * 8 * 4, 2 * 4 * 8 * 4][rank]


@pytest.mark.multirank(2)
def test_disjoint_windows_pool_each_block_as_the_builtin_does_without_communication(domain_mesh):
    x = torch.randn(1, 2, 16, 6)
    for func in (F.max_pool2d, F.avg_pool2d):
        report = check_conformance(lambda t: func(t, 2), [x], ShardSpec(domain_mesh, [Shard(2)], [10, 6]))
        assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0
        xs = shard_tensor(x, domain_mesh, [Shard(2)], [10, 6])
        ours = func(xs, 2)
        builtin = physicsnemo_shardext.builtin_handler(func)(func, (), (xs, 2), {})
        assert tuple(ours._spec.placements) == tuple(builtin._spec.placements)
        assert ours._spec.sharding_shapes() == builtin._spec.sharding_shapes()
        assert torch.equal(ours.to_local(), builtin.to_local())
    calls = []
    original = physicsnemo_shardext.builtin_handler

    def spy(target):
        return lambda *a: calls.append(1) or original(target)(*a)

    # Patched by hand (restored in finally): pool workers outlive a test's monkeypatch fixture.
    physicsnemo_shardext.builtin_handler = spy
    try:
        check_conformance(lambda t: F.max_pool2d(t, 2), [x], ShardSpec(domain_mesh, [Shard(2)], [10, 6]))
        check_conformance(lambda t: F.max_pool2d(t, 2), [x], ShardSpec(domain_mesh, [Shard(2)], [9, 7]))
        assert not calls  # neither the tiling case nor odd local sizes (the window path) call the built-in
    finally:
        physicsnemo_shardext.builtin_handler = original


PARTIAL_REFUSED = {
    # The built-in max-pools each rank's term (wrong); the others: the fallback's backward has no DTensor rule.
    "max_pool2d": (lambda t: F.max_pool2d(t, 2), "max of a partial sum"),
    "max_pool1d": (lambda t: F.max_pool1d(t, 3, 1), "max of a partial sum"),
    "max_pool3d": (lambda t: F.max_pool3d(t, 2), "max of a partial sum"),
    "max_pool3d-indices": (lambda t: F.max_pool3d(t, 2, return_indices=True), "backward"),
    "adaptive_avg_pool3d": (lambda t: F.adaptive_avg_pool3d(t, 2), "backward"),
    "adaptive_max_pool2d": (lambda t: F.adaptive_max_pool2d(t, 2), "backward"),
    "adaptive_max_pool1d-indices": (lambda t: F.adaptive_max_pool1d(t, 2, return_indices=True), "backward"),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(PARTIAL_REFUSED))
def test_partial_input_is_refused_where_the_delegate_is_wrong_or_fails(domain_mesh, rank, name):
    fn, why = PARTIAL_REFUSED[name]
    partial = ShardTensor.from_local(torch.randn(1, 2, 4, 4, 4), domain_mesh, [Partial()], sharding_shapes={})
    if "1d" in name:
        partial = ShardTensor.from_local(torch.randn(1, 2, 6), domain_mesh, [Partial()], sharding_shapes={})
    elif "2d" in name:
        partial = ShardTensor.from_local(torch.randn(1, 2, 4, 6), domain_mesh, [Partial()], sharding_shapes={})
    with pytest.raises(MissingShardPatch, match=f"Partial.*{why}"):
        fn(partial)


@pytest.mark.multirank(2)
def test_partial_input_of_avg_pool_is_delegated_to_the_builtin(domain_mesh, rank):
    # An average is linear in the input: the built-in pools each rank's term of the Partial(sum).
    torch.manual_seed(0)
    full = torch.randn(1, 2, 4, 6)
    share = torch.rand(full.shape)
    local = (full * share if rank == 0 else full * (1 - share)).requires_grad_(True)
    partial = ShardTensor.from_local(local, domain_mesh, [Partial()], sharding_shapes={})
    out = F.avg_pool2d(partial, 2)
    torch.testing.assert_close(out.full_tensor(), F.avg_pool2d(full, 2))
    with physicsnemo_shardext.disabled(plugins=["pooling"]):
        builtin = F.avg_pool2d(partial, 2)
    torch.testing.assert_close(out.to_local(), builtin.to_local())


# What DTensor's fallback gives a max pool with indices of a Partial input, by torch release.
_SUMMED_FIRST = (Replicate(),) if torch_in(">=2.14") else (Shard(1),)
PARTIAL_DELEGATED = {
    # name: (fn, input shape, output placements); avg: the built-in pools each term, the others: the fallback.
    "avg_pool2d": (lambda t: F.avg_pool2d(t, 2), (1, 2, 4, 6), (Partial(),)),
    "avg_pool1d": (lambda t: F.avg_pool1d(t, 2), (1, 2, 6), (Partial(),)),
    "avg_pool3d": (lambda t: F.avg_pool3d(t, 2), (1, 2, 4, 4, 4), (Partial(),)),
    "max_pool2d-indices": (lambda t: F.max_pool2d(t, 2, return_indices=True)[0], (1, 2, 4, 6), _SUMMED_FIRST),
    "max_pool1d-indices": (lambda t: F.max_pool1d(t, 3, 1, return_indices=True)[0], (1, 2, 6), _SUMMED_FIRST),
    "adaptive_avg_pool2d-1": (lambda t: F.adaptive_avg_pool2d(t, 1), (1, 2, 4, 6), (Replicate(),)),  # via mean
    "adaptive_avg_pool2d-3": (lambda t: F.adaptive_avg_pool2d(t, 3), (1, 2, 4, 6), (Partial(),)),
    "adaptive_avg_pool1d": (lambda t: F.adaptive_avg_pool1d(t, 4), (1, 2, 6), (Partial(),)),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(PARTIAL_DELEGATED))
def test_partial_input_is_delegated_where_the_delegate_is_right(domain_mesh, rank, name):
    fn, shape, placements = PARTIAL_DELEGATED[name]
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    check_delegation(fn, full, domain_mesh, rank, "pooling", placements)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("stride", [1, (2, 1)], ids=["stride1", "stride-tuple"])
def test_partial_avg_pool_with_other_strides_is_pooled_term_by_term(domain_mesh, rank, stride):
    # The built-in refuses stride != kernel_size; an average is linear, so each rank's term is pooled here.
    full = torch.randn(1, 2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def fn(t):
        return F.avg_pool2d(t, 3, stride, padding=1, ceil_mode=True, count_include_pad=False)

    reference = full.clone().requires_grad_(True)
    expected = fn(reference)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=expected.dtype)
    (expected * weight).sum().backward()
    local, partial = partial_terms(full, domain_mesh, rank)
    out = fn(partial)
    assert tuple(out.placements) == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), expected)
    (out.full_tensor() * weight).sum().backward()
    torch.testing.assert_close(local.grad, reference.grad)
    with physicsnemo_shardext.disabled(plugins=["pooling"]), pytest.raises(MissingShardPatch, match="matching stride"):
        fn(partial)  # what the delegate does
