"""Tests of patches/attention.py: sequence-sharded scaled-dot-product attention (ring and local) on gloo CPU ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.attention import sharded_sdpa
from physicsnemo_shardext.testing import CommCounter, ShardSpec, check_conformance, shard_tensor

SDPA = F.scaled_dot_product_attention
B, H, E = 2, 2, 8


def _qkv(lq: int, lk: int, *, heads_kv: int = H, ev: int = E, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, lq, E, generator=g),
        torch.randn(B, heads_kv, lk, E, generator=g),
        torch.randn(B, heads_kv, lk, ev, generator=g),
    ]


def _specs(mesh, q_split, kv_split) -> list[ShardSpec]:
    kv = ShardSpec(mesh, [Shard(2)], kv_split)
    return [ShardSpec(mesh, [Shard(2)], q_split), kv, kv]


def test_handler_overrides_the_builtin():
    registry = physicsnemo_shardext.get_registry()
    assert registry.provenance(SDPA).declaration.handler is sharded_sdpa
    assert physicsnemo_shardext.builtin_handler(SDPA) is not None


@pytest.mark.multirank(2)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("lq", "q_split", "lk", "kv_split"),
    [(17, [10, 7], 17, [10, 7]), (17, [17, 0], 17, [3, 14]), (21, [5, 16], 13, [13, 0])],
    ids=["self-uneven", "empty-q-shard", "cross-empty-kv-shard"],
)
def test_ring_matches_single_process(domain_mesh, causal, lq, q_split, lk, kv_split):
    report = check_conformance(
        lambda q, k, v: SDPA(q, k, v, is_causal=causal), _qkv(lq, lk), _specs(domain_mesh, q_split, kv_split)
    )
    assert set(report.comms.forward.counts) == {"c10d.alltoall_base_"}


@pytest.mark.multirank(4)
@pytest.mark.parametrize(
    ("q_split", "kv_split"), [([8, 8, 8, 9], [8, 8, 8, 9]), ([0, 20, 1, 12], [11, 0, 22, 0])], ids=["even", "empty"]
)
def test_ring_on_four_ranks_causal_scale_and_value_width(domain_mesh, q_split, kv_split):
    check_conformance(
        lambda q, k, v: SDPA(q, k, v, is_causal=True, scale=0.3), _qkv(33, 33, ev=5), _specs(domain_mesh, q_split, kv_split)
    )


@pytest.mark.multirank(2)
@pytest.mark.parametrize("kind", ["bool", "additive", "key-padding"])
def test_ring_with_replicated_masks(domain_mesh, kind):
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(19, 23, generator=g) > 0.4
        mask[4] = False  # a fully masked row: zeros, as torch gives
    elif kind == "additive":
        mask = torch.randn(B, 1, 19, 23, generator=g)
    else:
        mask = (torch.rand(B, 1, 1, 23, generator=g) > 0.3)
    check_conformance(
        lambda q, k, v: SDPA(q, k, v, attn_mask=mask), _qkv(19, 23), _specs(domain_mesh, [12, 7], [9, 14])
    )


@pytest.mark.multirank(2)
def test_additive_mask_gradient_and_sharded_mask(domain_mesh):
    inputs = [*_qkv(17, 17), torch.randn(1, H, 17, 17)]
    specs = [*_specs(domain_mesh, [11, 6], [11, 6]), ShardSpec(domain_mesh, [Replicate()])]
    check_conformance(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m), inputs, specs)
    inputs[3] = torch.randn(B, H, 17, 17)
    specs[3] = ShardSpec(domain_mesh, [Shard(2)], [11, 6])  # rows laid out like the query
    check_conformance(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m), inputs, specs)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_attention(domain_mesh, causal):
    q, k, v = _qkv(17, 17, heads_kv=1)
    q = torch.randn(B, 4, 17, E)
    check_conformance(
        lambda q, k, v: SDPA(q, k, v, is_causal=causal, enable_gqa=True), [q, k, v], _specs(domain_mesh, [9, 8], [4, 13])
    )


@pytest.mark.multirank(2)
@pytest.mark.parametrize("kv", ["plain", "Replicate"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_replicated_kv_is_local(domain_mesh, kv, causal):
    kv_spec = None if kv == "plain" else ShardSpec(domain_mesh, [Replicate()])
    specs = [ShardSpec(domain_mesh, [Shard(2)], [13, 0]), kv_spec, kv_spec]
    report = check_conformance(lambda q, k, v: SDPA(q, k, v, is_causal=causal), _qkv(13, 9), specs)
    assert report.comms.forward.total_calls == 0
    mask = torch.rand(13, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    specs[0] = ShardSpec(domain_mesh, [Shard(2)], [5, 8])
    report = check_conformance(lambda q, k, v: SDPA(q, k, v, attn_mask=mask, scale=0.5), _qkv(13, 9), specs)
    assert report.comms.forward.total_calls == 0


@pytest.mark.multirank(2)
def test_three_dim_inputs_without_heads(domain_mesh):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 18, E, generator=g) for _ in range(3))
    spec = ShardSpec(domain_mesh, [Shard(1)], [7, 11])
    check_conformance(lambda q, k, v: SDPA(q, k, v, is_causal=True), [q, k, v], spec)


@pytest.mark.multirank(4)
def test_forward_moves_kv_around_the_ring_once(domain_mesh):
    n = 4
    q, k, v = _qkv(32, 32)
    qs, ks, vs = (shard_tensor(t, domain_mesh, [Shard(2)], [8] * n) for t in (q, k, v))
    for t in (qs, ks, vs):
        t.requires_grad_(True)
    kv_bytes = (k.numel() + v.numel()) * 4
    with CommCounter() as forward:
        out = SDPA(qs, ks, vs)
    with CommCounter() as backward:
        out.to_local().sum().backward()
    assert forward.stats.counts == {"c10d.alltoall_base_": n - 1}
    assert forward.stats.total_bytes <= 1.1 * (n - 1) / n * kv_bytes
    # backward: K, V and their gradients travel n-1 steps, then the gradients one step home
    assert backward.stats.total_bytes <= 1.1 * (2 * (n - 1) + 1) / n * kv_bytes


@pytest.mark.multirank(2)
def test_dropout_on_sharded_kv_is_refused(domain_mesh):
    qs, ks, vs = (shard_tensor(t, domain_mesh, [Shard(2)], [9, 8]) for t in _qkv(17, 17))
    with pytest.raises(MissingShardPatch, match="dropout_p=0.1"):
        SDPA(qs, ks, vs, dropout_p=0.1)
    with pytest.raises(RuntimeError, match="is_causal"):
        SDPA(qs, ks, vs, attn_mask=torch.ones(17, 17, dtype=torch.bool), is_causal=True)
    mask = shard_tensor(torch.ones(B, H, 17, 17, dtype=torch.bool), domain_mesh, [Shard(3)], [9, 8])
    with pytest.raises(MissingShardPatch, match="attn_mask"):
        SDPA(qs, ks, vs, attn_mask=mask)


@pytest.mark.multirank(2)
def test_replicated_query_is_delegated(domain_mesh, monkeypatch):
    q, k, v = _qkv(9, 17)
    qs = shard_tensor(q, domain_mesh, [Replicate()])
    ks, vs = (shard_tensor(t, domain_mesh, [Shard(2)], [9, 8]) for t in (k, v))
    builtin = physicsnemo_shardext.builtin_handler(SDPA)
    seen = []

    def spy(func, types, args, kwargs):
        seen.append(func)
        return "delegated"

    monkeypatch.setattr("physicsnemo_shardext.primitives.delegation.builtin_handler", lambda f: spy)
    assert SDPA(qs, ks, vs) == "delegated" and seen == [SDPA]
    partial = ShardTensor_partial(q, domain_mesh)
    assert SDPA(partial, ks, vs) == "delegated"
    assert builtin is not None


def ShardTensor_partial(full: torch.Tensor, mesh) -> object:  # noqa: N802 - reads like a constructor
    from physicsnemo.domain_parallel import ShardTensor

    return ShardTensor.from_local(full / mesh.size(), mesh, [Partial()], sharding_shapes={})
