"""Tests of patches/softmax_cumsum.py: softmax family and cumsum along sharded dims, O(statistics) comms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.softmax_cumsum import CUMSUM_TARGETS, SOFTMAX_TARGETS, sharded_cumsum, sharded_softmax
from physicsnemo_shardext.testing import CommCounter, ShardSpec, check_conformance, check_delegation, shard_tensor
from physicsnemo_shardext.torch_support import torch_in

SHAPE = (2, 3, 17, 5)  # sharded along dim 2
STAT_ROW_BYTES = 2 * 3 * 5 * 4  # one float32 statistic per (batch, channel, width) row


def test_every_target_is_installed_by_the_plugin():
    registry = physicsnemo_shardext.get_registry()
    for target in SOFTMAX_TARGETS:
        assert registry.provenance(target).declaration.handler is sharded_softmax
    for target in CUMSUM_TARGETS:
        assert registry.provenance(target).declaration.handler is sharded_cumsum


SOFTMAXES = {
    "F.softmax": lambda x: F.softmax(x, dim=2),
    "nn.Softmax": torch.nn.Softmax(dim=-2),
    "torch.log_softmax": lambda x: torch.log_softmax(x, 2),
    "nn.LogSoftmax": torch.nn.LogSoftmax(dim=2),
    "method-softmax-dtype": lambda x: x.softmax(2, dtype=torch.float64),
    "F.softmin": lambda x: F.softmin(x, 2),
    "special.log_softmax": lambda x: torch.special.log_softmax(x, 2),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(SOFTMAXES))
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [17, 0]], ids=["uneven", "tiny", "empty"])
def test_softmax_family_along_sharded_dim(domain_mesh, name, split):
    x = torch.randn(SHAPE) * 4
    report = check_conformance(SOFTMAXES[name], [x], ShardSpec(domain_mesh, [Shard(2)], split))
    # Bound: one MAX and one SUM all_reduce of a row of statistics (x.numel() / 17 values, float64 with dtype=).
    stat_bytes = STAT_ROW_BYTES * (2 if "dtype" in name else 1)
    assert report.comms.forward.total_bytes <= 2 * stat_bytes
    assert report.comms.forward.counts == {"c10d.allreduce_": 2}
    assert report.comms.backward.total_bytes <= stat_bytes  # gradient of the global sum


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[5, 4, 4, 4], [1, 15, 0, 1]], ids=["even", "tiny-and-empty"])
def test_softmax_on_four_ranks_and_unsharded_dim_is_local(domain_mesh, split):
    x = torch.randn(SHAPE)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    check_conformance(lambda t: F.log_softmax(t, dim=2), [x], spec)
    local = check_conformance(lambda t: torch.softmax(t, dim=3), [x], spec)
    assert local.comms.forward.total_calls == 0 and local.comms.backward.total_calls == 0


@pytest.mark.multirank(4)
def test_softmax_on_spatial_mesh_uses_only_its_mesh_dim(spatial_mesh):
    x = torch.randn(1, 2, 9, 7)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [6, 3], 1: [2, 5]})
    report = check_conformance(lambda t: F.softmax(t, dim=3), [x], spec)
    assert report.comms.forward.total_bytes <= 2 * (1 * 2 * 9 * 4)  # a row of stats for the full H, at most


@pytest.mark.multirank(2)
def test_softmax_keeps_extremes_like_torch(domain_mesh):
    full = torch.tensor([[-float("inf")] * 5, [1e4, -1e4, 0.0, 3.0, 1e4 - 1]]).T.contiguous()  # dim 0 sharded
    x = shard_tensor(full, domain_mesh, [Shard(0)], [2, 3])
    torch.testing.assert_close(torch.softmax(x, 0).full_tensor(), torch.softmax(full, 0), equal_nan=True)


CUMSUMS = {
    "torch.cumsum": lambda x: torch.cumsum(x, 2),
    "method-negative-dim": lambda x: x.cumsum(dim=-2),
    "dtype": lambda x: torch.cumsum(x, 2, dtype=torch.float64),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(CUMSUMS))
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [0, 17]], ids=["uneven", "tiny", "empty"])
def test_cumsum_along_sharded_dim(domain_mesh, name, split):
    x = torch.randn(SHAPE)
    report = check_conformance(CUMSUMS[name], [x], ShardSpec(domain_mesh, [Shard(2)], split), atol=1e-4)
    row_bytes = STAT_ROW_BYTES * (2 if name == "dtype" else 1)
    assert report.comms.forward.counts == {"c10d.allgather_": 1}
    assert report.comms.forward.total_bytes == row_bytes  # this rank's total: one row
    assert report.comms.backward.total_bytes == row_bytes


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[5, 4, 4, 4], [3, 0, 1, 13]], ids=["even", "empty-and-tiny"])
def test_cumsum_on_four_ranks_and_unsharded_dim(domain_mesh, split):
    x = torch.randn(SHAPE)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    check_conformance(lambda t: t.cumsum(2), [x], spec, atol=1e-4)
    local = check_conformance(lambda t: torch.cumsum(t, 1), [x], spec)
    assert local.comms.forward.total_calls == 0


@pytest.mark.multirank(4)
def test_cumsum_of_integers_on_ddp_domain_mesh(ddp_domain_mesh):
    full = torch.randint(-5, 5, (2, 11, 3))
    x = shard_tensor(full, ddp_domain_mesh, [Replicate(), Shard(1)], {1: [8, 3]})
    y = torch.cumsum(x, 1)
    assert y.dtype == torch.int64 and y._spec.placements == (Replicate(), Shard(1))
    assert [s[1] for s in y._spec.sharding_shapes()[1]] == [8, 3]
    assert torch.equal(y.full_tensor(), torch.cumsum(full, 1))


def _splits(total: int, parts: int) -> st.SearchStrategy[list[int]]:
    cuts = st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1).map(sorted)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *c], [*c, total])])


EXAMPLE_SETTINGS = settings(
    derandomize=True, database=None, deadline=None, max_examples=8, suppress_health_check=list(HealthCheck)
)


@pytest.mark.multirank(4)
def test_random_splits_softmax_and_cumsum(domain_mesh):
    seen: list[list[int]] = []

    @EXAMPLE_SETTINGS
    @given(split=_splits(13, 4), op=st.sampled_from(["softmax", "log_softmax", "cumsum"]))
    def check(split: list[int], op: str) -> None:
        seen.append(split)
        fn = {
            "softmax": lambda t: t.softmax(1),
            "log_softmax": lambda t: F.log_softmax(t, 1),
            "cumsum": lambda t: t.cumsum(1),
        }[op]
        check_conformance(
            fn, [torch.randn(3, 13, 2)], ShardSpec(domain_mesh, [Shard(1)], split), atol=1e-4, count_comms=False
        )

    check()
    assert len(seen) >= 4  # hypothesis really drew examples on this rank
    gathered: list[object] = [None] * 4
    torch.distributed.all_gather_object(gathered, seen)
    assert all(g == seen for g in gathered)  # identical examples on every rank


@pytest.mark.multirank(2)
def test_patch_moves_less_than_dtensor_fallback(domain_mesh):
    full = torch.randn(2, 4, 64, 8)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [32, 32])  # the fallback aborts gloo on uneven splits
    measured = {}
    for label, fn in [("softmax", lambda t: F.softmax(t, 2)), ("cumsum", lambda t: torch.cumsum(t, 2))]:
        with torch.no_grad(), CommCounter() as patched:
            fn(x)
        with physicsnemo_shardext.disabled(plugins=["softmax_cumsum"]), torch.no_grad(), CommCounter() as fallback:
            fn(x)
        assert fallback.stats.total_bytes == full.numel() * 4 // 2  # the fallback all-gathers the activation
        measured[label] = (patched.stats.total_bytes, fallback.stats.total_bytes)
        stats_bytes = 2 * 4 * 8 * 4  # one row of statistics (batch x channel x width floats)
        assert patched.stats.total_bytes <= 2 * stats_bytes
        assert patched.stats.total_bytes < fallback.stats.total_bytes, (label, str(patched.stats), str(fallback.stats))


@pytest.mark.multirank(2)
def test_refused_configurations(domain_mesh, rank):
    x = shard_tensor(torch.randn(4, 6), domain_mesh, [Shard(0)], [3, 1])
    with pytest.raises(MissingShardPatch, match="out= is not supported"):
        torch.cumsum(x, 0, out=torch.empty(4, 6))
    with pytest.raises(MissingShardPatch, match="dim='h'"):
        F.softmax(x, "h")
    ints = shard_tensor(torch.arange(6).reshape(3, 2), domain_mesh, [Shard(0)], [2, 1])
    with pytest.raises(MissingShardPatch, match="softmax of a torch.int64 tensor"):
        torch.softmax(ints, 0)
    torch.testing.assert_close(
        torch.softmax(ints, 0, dtype=torch.float64).full_tensor(),
        torch.softmax(torch.arange(6).reshape(3, 2), 0, dtype=torch.float64),
    )


PARTIAL_CASES = {
    "softmax": (lambda t: F.softmax(t, 1), (Replicate(),)),
    "torch.softmax": (lambda t: torch.softmax(t, -1), (Replicate(),)),
    "log_softmax": (lambda t: F.log_softmax(t, 1), (Replicate(),)),
    "softmin": (lambda t: F.softmin(t, 0), (Replicate(),)),
    # torch 2.13's fallback sums a cumsum's terms first; from 2.14 the Partial(sum) stays.
    "cumsum": (lambda t: torch.cumsum(t, 1), (Partial(),) if torch_in(">=2.14") else (Replicate(),)),
    "Tensor.cumsum": (lambda t: t.cumsum(0), (Partial(),) if torch_in(">=2.14") else (Replicate(),)),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(PARTIAL_CASES))
def test_partial_input_is_delegated_to_the_fallback(domain_mesh, rank, name):
    # The fallback sums the terms before a softmax (Replicate) and keeps the Partial(sum) of a cumsum (linear).
    fn, placements = PARTIAL_CASES[name]
    full = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    check_delegation(fn, full, domain_mesh, rank, "softmax_cumsum", placements)


FUSED = {
    "softmax": lambda t: F.softmax(t, dim=2),
    "log_softmax": lambda t: torch.log_softmax(t, 2),
    "softmin": lambda t: F.softmin(t, 2),
    "softmax-dtype": lambda t: t.softmax(2, dtype=torch.float32),
}


def _penalty_terms(fn, x):
    """Output, first-order gradient (create_graph=True) and the gradient of a loss on it."""
    y = fn(x)
    (g,) = torch.autograd.grad(torch.sin(y).sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad((g * g).sum() + (torch.cos(y) * g).sum(), x)
    return y, g, g2


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [0, 17]], ids=["uneven", "tiny", "empty"])
def test_fused_softmax_values_gradients_and_second_order(domain_mesh, name, split):
    # The one autograd Function: its value, its gradient and the gradient of that gradient on uneven shards.
    full = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 3
    expected = _penalty_terms(FUSED[name], full.clone().requires_grad_(True))
    x = shard_tensor(full, domain_mesh, [Shard(2)], split, requires_grad=True)
    got = _penalty_terms(FUSED[name], x)
    for what, a, e in zip(("output", "gradient", "second-order gradient"), got, expected):
        assert a._spec.placements == (Shard(2),), what
        assert [s[2] for s in a._spec.sharding_shapes()[0]] == split, what
        tol = dict(rtol=1e-5, atol=1e-6) if "dtype" in name else dict(rtol=1e-9, atol=1e-11)  # float32 math
        torch.testing.assert_close(a.full_tensor(), e, **tol, msg=what)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "softmin"])
def test_fused_softmax_saves_only_its_output(domain_mesh, name):
    # Composed of elementwise ops, softmax kept several block-sized intermediates for the backward.
    x = shard_tensor(torch.randn(SHAPE), domain_mesh, [Shard(2)], [10, 7], requires_grad=True)
    block = x.to_local()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = FUSED[name](x)
    big = [t for t in saved if t.numel() >= block.numel()]
    assert len(big) == 1 and big[0].dtype == block.dtype, [tuple(t.shape) for t in saved]
    assert sum(t.numel() * t.element_size() for t in saved) < 1.2 * block.nbytes
    y.backward(y.detach().clone())  # the saved output is all the backward needs
    assert x.grad is not None and torch.isfinite(x.grad.to_local()).all()
