"""Tests of patches/attention/ (its ring, sdpa and mha modules) on gloo CPU ranks: sequence-sharded
scaled-dot-product attention (ring and local), ``nn.MultiheadAttention`` on token- and batch-sharded
inputs, the CPU fused SDPA kernel on batch/head shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.attention import local_fused_sdpa, sharded_multi_head_attention, sharded_sdpa
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
        lambda q, k, v: SDPA(q, k, v, is_causal=True, scale=0.3),
        _qkv(33, 33, ev=5),
        _specs(domain_mesh, q_split, kv_split),
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
        mask = torch.rand(B, 1, 1, 23, generator=g) > 0.3
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
        lambda q, k, v: SDPA(q, k, v, is_causal=causal, enable_gqa=True),
        [q, k, v],
        _specs(domain_mesh, [9, 8], [4, 13]),
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
    # backward, its analytic minimum: K/V reach every rank again (n-1 hops) and the dK/dV partials, started by
    # the first visitor (the owner keeps its own contribution), reach their owners (n-1 hops)
    assert backward.stats.total_bytes == 2 * (n - 1) * kv_bytes // n


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
def test_replicated_query_with_dropout_and_a_partial_query_are_delegated(domain_mesh, monkeypatch):
    # A replicated query runs here (replicated_query_attention) except with dropout, which keeps
    # PhysicsNeMo's handler as before this plugin; a Partial query too.
    q, k, v = _qkv(9, 17)
    qs = shard_tensor(q, domain_mesh, [Replicate()])
    ks, vs = (shard_tensor(t, domain_mesh, [Shard(2)], [9, 8]) for t in (k, v))
    builtin = physicsnemo_shardext.builtin_handler(SDPA)
    seen = []

    def spy(func, types, args, kwargs):
        seen.append(func)
        return "delegated"

    monkeypatch.setattr("physicsnemo_shardext.primitives.delegation.builtin_handler", lambda f: spy)
    assert SDPA(qs, ks, vs, dropout_p=0.1) == "delegated" and seen == [SDPA]
    partial = ShardTensor_partial(q, domain_mesh)
    assert SDPA(partial, ks, vs) == "delegated"
    assert builtin is not None


def ShardTensor_partial(full: torch.Tensor, mesh) -> object:  # noqa: N802 - reads like a constructor
    from physicsnemo.domain_parallel import ShardTensor

    return ShardTensor.from_local(full / mesh.size(), mesh, [Partial()], sharding_shapes={})


# -- nn.MultiheadAttention / F.multi_head_attention_forward on token-sharded inputs ---------------

MHA_FN = F.multi_head_attention_forward
FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
L, S, N, EMBED, HEADS = 9, 11, 2, 8, 2


class Attend(nn.Module):
    """``nn.MultiheadAttention`` called with fixed options; inputs after q (k, v) are the named masks.

    ``self_attention``: one input passed as query, key and value (the same tensor, as a
    transformer block does). The weights, when returned, are a second output.
    """

    def __init__(self, mha: nn.MultiheadAttention, *, masks=(), self_attention=False, **options):
        super().__init__()
        self.mha, self.masks, self.self_attention, self.options = mha, tuple(masks), self_attention, options

    def forward(self, *inputs):
        if self.self_attention:
            q = k = v = inputs[0]
            rest = inputs[1:]
        else:
            q, k, v = inputs[:3]
            rest = inputs[3:]
        out, weights = self.mha(q, k, v, **dict(zip(self.masks, rest)), **self.options)
        return out if weights is None else (out, weights)


def _tokens(batch_first: bool, length: int = L, features: int = EMBED, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((N, length, features) if batch_first else (length, N, features), generator=g)


def _token_spec(mesh, batch_first: bool, sizes) -> ShardSpec:
    return ShardSpec(mesh, [Shard(1 if batch_first else 0)], sizes)


def _check_mha(module: Attend, inputs, specs, *, weights_rows: int | None, batch_first: bool, **options):
    """Conformance of outputs, input gradients and every parameter gradient; placements of output and weights."""
    token = (Shard(1 if batch_first else 0),)
    expected = [token] if weights_rows is None else [token, (Shard(weights_rows),)]
    report = check_conformance(module, inputs, specs, expected_placements=expected, **options)
    names = {f"mha.{name}" for name, p in module.mha.named_parameters() if p.requires_grad}
    compared = {k.split("'")[1] for k in report.max_abs_errors if k.startswith("gradient of parameter")}
    assert compared == names, f"parameters without a compared gradient: {sorted(names - compared)}"
    return report


def test_mha_handlers_are_declared():
    registry = physicsnemo_shardext.get_registry()
    assert registry.provenance(MHA_FN).declaration.handler is sharded_multi_head_attention
    assert physicsnemo_shardext.builtin_handler(MHA_FN) is None  # it replaces the DTensor fallback
    for op in (FLASH_CPU, FLASH_CPU_BACKWARD):
        assert registry.provenance(op).declaration.handler is local_fused_sdpa
        assert registry.provenance(op, level="dispatch").declaration.handler.__name__.startswith("_flash_cpu")


@pytest.mark.multirank(2)
@pytest.mark.parametrize("sizes", [[2, 7], [9, 0]], ids=["uneven", "empty"])
@pytest.mark.parametrize(
    ("batch_first", "need_weights", "average", "params"),
    [
        (True, False, True, "distribute"),
        (False, False, True, "plain"),
        (True, True, True, "plain"),
        (False, True, False, "distribute"),
    ],
    ids=["batch-first", "seq-first", "weights-averaged", "weights-per-head"],
)
def test_mha_self_attention(domain_mesh, sizes, batch_first, need_weights, average, params):
    mha = nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first)
    module = Attend(mha, self_attention=True, need_weights=need_weights, average_attn_weights=average)
    rows = (1 if average else 2) if need_weights else None
    report = _check_mha(
        module,
        [_tokens(batch_first)],
        _token_spec(domain_mesh, batch_first, sizes),
        weights_rows=rows,
        batch_first=batch_first,
        params=params,
    )
    if not need_weights:  # the ring: K/V blocks only, never gathered
        assert set(report.comms.forward.counts) <= {"c10d.alltoall_base_"}


@pytest.mark.multirank(2)
def test_mha_under_torch_compile(domain_mesh):
    # The handler runs eagerly behind a graph break (eager_handler); compiled steps equal eager ones.
    module = Attend(nn.MultiheadAttention(EMBED, HEADS, batch_first=True), self_attention=True, need_weights=False)
    check_conformance(
        module, [_tokens(True)], _token_spec(domain_mesh, True, [2, 7]), compile="aot_eager", count_comms=False
    )


@pytest.mark.multirank(2)
@pytest.mark.parametrize("kv", ["sharded", "plain", "Replicate"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no-weights", "weights"])
def test_mha_cross_attention_with_kdim_vdim(domain_mesh, kv, need_weights):
    mha = nn.MultiheadAttention(EMBED, HEADS, kdim=5, vdim=3, batch_first=True)
    inputs = [_tokens(True), _tokens(True, S, 5, seed=1), _tokens(True, S, 3, seed=2)]
    kv_spec = {
        "sharded": ShardSpec(domain_mesh, [Shard(1)], [S, 0]),
        "plain": None,
        "Replicate": ShardSpec(domain_mesh, [Replicate()]),
    }[kv]
    specs = [_token_spec(domain_mesh, True, [3, 6]), kv_spec, kv_spec]
    report = _check_mha(
        Attend(mha, need_weights=need_weights),
        inputs,
        specs,
        weights_rows=1 if need_weights else None,
        batch_first=True,
    )
    if kv != "sharded" and not need_weights:
        assert report.comms.forward.total_calls == 0  # local attention against the whole K/V


@pytest.mark.multirank(2)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no-weights", "weights"])
@pytest.mark.parametrize("kv_sizes", [[4, 7], [11, 0]], ids=["uneven", "empty-last"])
def test_mha_bias_kv_and_zero_attention(domain_mesh, bias, need_weights, kv_sizes):
    mha = nn.MultiheadAttention(EMBED, HEADS, bias=bias, add_bias_kv=True, add_zero_attn=True)
    g = torch.Generator().manual_seed(4)
    padding = torch.rand(N, S, generator=g) > 0.7
    attn_mask = torch.randn(L, S, generator=g)
    inputs = [_tokens(False), _tokens(False, S, seed=1), _tokens(False, S, seed=2), padding, attn_mask]
    kv = ShardSpec(domain_mesh, [Shard(0)], kv_sizes)
    specs = [_token_spec(domain_mesh, False, [6, 3]), kv, kv, None, None]
    module = Attend(mha, masks=("key_padding_mask", "attn_mask"), need_weights=need_weights)
    _check_mha(module, inputs, specs, weights_rows=1 if need_weights else None, batch_first=False)


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    ("kind", "need_weights"),
    [("bool-replicated", False), ("float-sharded", False), ("float-sharded", True), ("bool-sharded-even", True)],
)
def test_mha_key_padding_mask(domain_mesh, kind, need_weights):
    g = torch.Generator().manual_seed(5)
    even = kind.endswith("even")
    lk = 10 if even else S
    if kind.startswith("bool"):
        padding = torch.rand(N, lk, generator=g) > 0.6
        padding[:, 0] = False  # every query attends to something
    else:
        padding = torch.randn(N, lk, generator=g)
    kv_sizes = [5, 5] if even else [8, 3]
    # nn.MultiheadAttention turns a boolean mask into a float one with torch.zeros_like first, which
    # needs an even split on a ShardTensor (F.multi_head_attention_forward itself takes any: tested below).
    kv = ShardSpec(domain_mesh, [Shard(1)], kv_sizes)
    mask_spec = None if kind == "bool-replicated" else ShardSpec(domain_mesh, [Shard(1)], kv_sizes)
    inputs = [_tokens(True), _tokens(True, lk, seed=1), _tokens(True, lk, seed=2), padding]
    specs = [_token_spec(domain_mesh, True, [5, 4]), kv, kv, mask_spec]
    module = Attend(
        nn.MultiheadAttention(EMBED, HEADS, batch_first=True), masks=("key_padding_mask",), need_weights=need_weights
    )
    _check_mha(module, inputs, specs, weights_rows=1 if need_weights else None, batch_first=True)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("layout", ["replicated", "sharded-rows"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no-weights", "weights"])
def test_mha_attn_mask(domain_mesh, layout, need_weights):
    g = torch.Generator().manual_seed(6)
    attn_mask = torch.randn(N * HEADS, L, L, generator=g)  # per batch element and head, float
    mask_spec = ShardSpec(domain_mesh, [Shard(1)], [4, 5]) if layout == "sharded-rows" else None
    module = Attend(
        nn.MultiheadAttention(EMBED, HEADS), masks=("attn_mask",), self_attention=True, need_weights=need_weights
    )
    _check_mha(
        module,
        [_tokens(False), attn_mask],
        [_token_spec(domain_mesh, False, [4, 5]), mask_spec],
        weights_rows=1 if need_weights else None,
        batch_first=False,
    )


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    ("need_weights", "with_padding"),
    [(False, False), (True, False), (False, True)],
    ids=["hint-used", "weights-use-the-mask", "padding-uses-the-mask"],
)
def test_mha_is_causal_with_its_mask(domain_mesh, need_weights, with_padding):
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[1, 3] = True
    masks = ("attn_mask", "key_padding_mask") if with_padding else ("attn_mask",)
    inputs = [_tokens(True), causal, padding] if with_padding else [_tokens(True), causal]
    module = Attend(
        nn.MultiheadAttention(EMBED, HEADS, batch_first=True),
        masks=masks,
        self_attention=True,
        need_weights=need_weights,
        is_causal=True,
    )
    _check_mha(
        module,
        inputs,
        [_token_spec(domain_mesh, True, [7, 2])] + [None] * (len(inputs) - 1),
        weights_rows=1 if need_weights else None,
        batch_first=True,
    )


@pytest.mark.multirank(2)
def test_mha_is_causal_hint_trusts_the_hint(domain_mesh):
    # torch drops the mask and runs causal SDPA where it may: a wrong mask with the hint gives causal attention.
    mha = nn.MultiheadAttention(EMBED, HEADS)
    x = _tokens(False)
    xs = shard_tensor(x, domain_mesh, [Shard(0)], [3, 6])
    wrong = torch.zeros(L, L, dtype=torch.bool)
    out, _ = mha(xs, xs, xs, attn_mask=wrong, is_causal=True, need_weights=False)
    expected, _ = mha(x, x, x, attn_mask=torch.triu(torch.ones(L, L, dtype=torch.bool), 1), need_weights=False)
    torch.testing.assert_close(out.full_tensor(), expected.detach(), rtol=1e-5, atol=1e-6)
    out, _ = mha(xs, x, x, attn_mask=wrong, is_causal=True, need_weights=False)  # replicated K/V: local, causal
    torch.testing.assert_close(out.full_tensor(), expected.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="is_causal"):
        mha(xs, xs, xs, is_causal=True)


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    ("padding_type", "need_weights"),
    [(torch.bool, False), (torch.float32, False), (torch.float32, True)],
    ids=["bool", "float", "weights"],
)
def test_functional_mha_unbatched_and_uneven_sharded_padding(domain_mesh, padding_type, need_weights):
    mha = nn.MultiheadAttention(EMBED, HEADS)
    g = torch.Generator().manual_seed(7)
    padding = torch.rand(S, generator=g) > 0.6 if padding_type is torch.bool else torch.randn(S, generator=g)
    if padding_type is torch.bool:
        padding[0] = False

    def attend(q, k, v, padding):
        out, weights = MHA_FN(
            q,
            k,
            v,
            EMBED,
            HEADS,
            mha.in_proj_weight,
            mha.in_proj_bias,
            None,
            None,
            False,
            0.0,
            mha.out_proj.weight,
            mha.out_proj.bias,
            key_padding_mask=padding,
            need_weights=need_weights,
            average_attn_weights=False,
        )
        return out if weights is None else (out, weights)  # weights (H, L, S): rows on dim 1

    inputs = [
        torch.randn(L, EMBED, generator=g),
        torch.randn(S, EMBED, generator=g),
        torch.randn(S, EMBED, generator=g),
        padding,
    ]
    kv = ShardSpec(domain_mesh, [Shard(0)], [10, 1])
    expected = [(Shard(0),), (Shard(1),)] if need_weights else [(Shard(0),)]
    check_conformance(
        attend, inputs, [ShardSpec(domain_mesh, [Shard(0)], [0, 9]), kv, kv, kv], expected_placements=expected
    )


@pytest.mark.multirank(4)
@pytest.mark.parametrize("need_weights", [False, True], ids=["no-weights", "weights"])
def test_mha_on_four_ranks(domain_mesh, need_weights):
    mha = nn.MultiheadAttention(EMBED, HEADS, batch_first=True, add_bias_kv=True)
    g = torch.Generator().manual_seed(8)
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    padding = torch.rand(N, L, generator=g) > 0.8
    padding[:, 0] = False
    module = Attend(
        mha, masks=("attn_mask", "key_padding_mask"), self_attention=True, need_weights=need_weights, is_causal=True
    )
    specs = [_token_spec(domain_mesh, True, [0, 5, 1, 3]), None, None]
    _check_mha(
        module, [_tokens(True), causal, padding], specs, weights_rows=1 if need_weights else None, batch_first=True
    )
    cross = Attend(nn.MultiheadAttention(EMBED, HEADS, batch_first=True), need_weights=need_weights)
    kv = ShardSpec(domain_mesh, [Shard(1)], [3, 0, 8, 0])
    _check_mha(
        cross,
        [_tokens(True), _tokens(True, S, seed=1), _tokens(True, S, seed=2)],
        [_token_spec(domain_mesh, True, [2, 2, 2, 3]), kv, kv],
        weights_rows=1 if need_weights else None,
        batch_first=True,
    )


@pytest.mark.multirank(4)
def test_mha_forward_moves_projected_kv_around_the_ring_once(domain_mesh):
    n = 4
    mha = nn.MultiheadAttention(EMBED, HEADS)
    x = torch.randn(32, N, EMBED)
    xs = shard_tensor(x, domain_mesh, [Shard(0)], [8] * n).requires_grad_(True)
    kv_bytes = 2 * x.numel() * 4  # projected K and V, float32
    with CommCounter() as forward:
        out, _ = mha(xs, xs, xs, need_weights=False)
    assert forward.stats.counts == {"c10d.alltoall_base_": n - 1}
    assert forward.stats.total_bytes <= 1.1 * (n - 1) / n * kv_bytes
    with CommCounter() as backward:
        out.to_local().sum().backward()
    # ring backward, plus one all-reduce per parameter (in_proj weight and bias, out_proj weight and bias)
    assert backward.stats.counts.get("c10d.allreduce_") == 4


@pytest.mark.multirank(2)
def test_mha_dropout(domain_mesh):
    mha = nn.MultiheadAttention(EMBED, HEADS, dropout=0.5, batch_first=True)
    x = _tokens(True)
    xs = shard_tensor(x, domain_mesh, [Shard(1)], [4, 5])
    with pytest.raises(MissingShardPatch, match="dropout_p=0.5"):
        mha(xs, xs, xs, need_weights=False)
    seq_first = nn.MultiheadAttention(EMBED, HEADS, dropout=0.5)
    even = shard_tensor(_tokens(False, 10), domain_mesh, [Shard(0)], [5, 5])  # the fallback needs an even split
    with torch.no_grad():  # no backward to fail: delegated to the DTensor fallback, as before
        out, _ = seq_first(even, even, even, need_weights=False)
    assert out.placements == (Shard(0),) and torch.isfinite(out.full_tensor()).all()
    # replicated K/V (local attention) and need_weights=True (gathered K/V): dropout on the local rows
    out, _ = mha(xs, x, x, need_weights=False)
    assert out.placements == (Shard(1),) and torch.isfinite(out.full_tensor()).all()
    out, weights = mha(xs, xs, xs)
    dropped = (weights.full_tensor() == 0).float().mean().item()
    assert 0.2 < dropped < 0.8, dropped  # about half the weights dropped
    # in eval mode there is no dropout: the ring again, equal to single-process
    mha.eval()
    check_conformance(
        Attend(mha, self_attention=True, need_weights=False),
        [x],
        _token_spec(domain_mesh, True, [4, 5]),
        expected_placements=[(Shard(1),)],
    )


@pytest.mark.multirank(2)
@pytest.mark.parametrize(("batch_first", "sizes"), [(True, [3, 1]), (False, [4, 0])], ids=["uneven", "empty"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no-weights", "weights"])
def test_mha_batch_sharded_is_local(domain_mesh, batch_first, sizes, need_weights):
    g = torch.Generator().manual_seed(10)
    padding = torch.randn(4, L, generator=g)  # float: a boolean one meets torch.zeros_like first (even splits only)
    attn_mask = torch.randn(4 * HEADS, L, L, generator=g)
    d = 0 if batch_first else 1
    module = Attend(
        nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first),
        self_attention=True,
        masks=("key_padding_mask", "attn_mask"),
        need_weights=need_weights,
    )
    x = torch.randn((4, L, EMBED) if batch_first else (L, 4, EMBED), generator=g)
    specs = [ShardSpec(domain_mesh, [Shard(d)], sizes), ShardSpec(domain_mesh, [Shard(0)], sizes), None]
    expected = [(Shard(d),), (Shard(0),)] if need_weights else [(Shard(d),)]
    report = check_conformance(module, [x, padding, attn_mask], specs, expected_placements=expected)
    assert report.comms.forward.total_calls == 0


@pytest.mark.multirank(2)
@pytest.mark.parametrize("dim", [0, 1], ids=["batch", "heads"])
def test_sdpa_below_torch_function_reaches_the_local_fused_kernel(domain_mesh, dim):
    # Code that runs SDPA with torch-function subclass handling off (as conversions and traced paths do)
    # reaches the CPU fused kernel on ShardTensors at dispatch level: local in forward and backward
    # (DTensor has no strategy for its backward, and gathered head-sharded operands in its forward).
    def attend(q, k, v):
        with torch._C.DisableTorchFunctionSubclass():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = _qkv(7, 7)
    report = check_conformance(attend, [q, k, v], ShardSpec(domain_mesh, [Shard(dim)], [1, 1]))
    assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0


@pytest.mark.multirank(2)
@pytest.mark.parametrize(("dim", "sizes"), [(0, [2, 1]), (0, [3, 0]), (1, [1, 1])], ids=["batch", "empty", "heads"])
@pytest.mark.parametrize("mask", ["none", "broadcast", "full"])
def test_fused_cpu_kernel_on_batch_or_head_shards(domain_mesh, dim, sizes, mask):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(3, 2, 5, 4, generator=g) for _ in range(3))
    masks = {"none": None, "broadcast": torch.randn(5, 5, generator=g), "full": torch.randn(3, 2, 5, 5, generator=g)}
    attn_mask = masks[mask]
    if dim == 1 and attn_mask is not None and attn_mask.ndim == 4:
        attn_mask = attn_mask[:1]  # (1, 2, 5, 5): broadcast over the batch, full over the sharded heads

    def fused(q, k, v):
        return FLASH_CPU(q, k, v, attn_mask=attn_mask)[0]

    report = check_conformance(fused, [q, k, v], ShardSpec(domain_mesh, [Shard(dim)], sizes))
    assert report.comms.forward.total_calls == 0 and report.comms.backward.total_calls == 0


@pytest.mark.multirank(2)
def test_fused_cpu_kernel_other_layouts_are_delegated(domain_mesh):
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    qs = shard_tensor(q, domain_mesh, [Shard(0)])
    ks, vs = (shard_tensor(t, domain_mesh, [Shard(1)]) for t in (k, v))  # split differently: what ran before
    with physicsnemo_shardext.disabled(plugins=["attention"]):
        before = FLASH_CPU(qs, ks, vs)[0]
    now = FLASH_CPU(qs, ks, vs)[0]
    assert now.placements == before.placements
    torch.testing.assert_close(now.full_tensor(), F.scaled_dot_product_attention(q, k, v))


# K/V travelling in chunks of a few rows (many rounds, uneven and empty chunks), query rows in chunks too.
_FEW_ROWS = 2 * 4 * 8 * 4 * 3  # bytes: 3 K/V rows of (B=2) x (H=2) x (E + Ev = 16) float32, 6 query rows


@pytest.mark.multirank(4)
@pytest.mark.parametrize(
    "case", ["causal", "bool-mask", "additive-mask-grad", "gqa-causal", "value-width", "cross-uneven"]
)
def test_ring_in_small_chunks_matches_single_process(domain_mesh, monkeypatch, case):
    from physicsnemo_shardext.patches.attention import ring

    monkeypatch.setattr(ring, "_CHUNK_BYTES", _FEW_ROWS)
    lk, kv_split = (23, [0, 4, 19, 0]) if case == "cross-uneven" else (29, [5, 11, 0, 13])
    q, k, v = _qkv(29, lk, heads_kv=1 if case == "gqa-causal" else H, ev=5 if case == "value-width" else E)
    specs = _specs(domain_mesh, [8, 0, 13, 8], kv_split)
    g = torch.Generator().manual_seed(7)
    options = {
        "is_causal": case in ("causal", "gqa-causal", "value-width", "cross-uneven"),
        "enable_gqa": case == "gqa-causal",
    }
    if case == "bool-mask":
        options["attn_mask"] = torch.rand(29, lk, generator=g) > 0.5
        options["attn_mask"][3] = False  # a fully masked row
    if case == "additive-mask-grad":  # the score gradient: computed without the fused kernel
        mask = torch.randn(B, 1, 29, lk, generator=g)
        check_conformance(
            lambda q, k, v, m: SDPA(q, k, v, attn_mask=m),
            [q, k, v, mask],
            [*specs, ShardSpec(domain_mesh, [Replicate()])],
        )
        return
    check_conformance(lambda q, k, v: SDPA(q, k, v, **options), [q, k, v], specs)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_ring_in_small_chunks_in_other_dtypes(domain_mesh, monkeypatch, dtype):
    from physicsnemo_shardext.patches.attention import ring

    monkeypatch.setattr(ring, "_CHUNK_BYTES", _FEW_ROWS)
    tol = 1e-6 if dtype == torch.float64 else 2e-2
    check_conformance(
        lambda q, k, v: SDPA(q, k, v, is_causal=True),
        [t.to(dtype) for t in _qkv(21, 21)],
        ShardSpec(domain_mesh, [Shard(2)], [13, 8]),
        atol=tol,
        rtol=tol,
    )


@pytest.mark.multirank(4)
def test_ring_in_small_chunks_moves_the_analytic_minimum(domain_mesh, monkeypatch):
    from physicsnemo_shardext.patches.attention import ring

    monkeypatch.setattr(ring, "_CHUNK_BYTES", _FEW_ROWS)
    n = 4
    q, k, v = _qkv(32, 32)
    qs, ks, vs = (shard_tensor(t, domain_mesh, [Shard(2)], [8] * n, requires_grad=True) for t in (q, k, v))
    kv_bytes = (k.numel() + v.numel()) * 4
    with CommCounter() as forward:
        out = SDPA(qs, ks, vs)
    with CommCounter() as backward:
        out.to_local().sum().backward()
    rounds = 3  # 8 rows per block in chunks of 3, 3 and 2
    assert forward.stats.counts == {"c10d.alltoall_base_": rounds * (n - 1)}
    assert forward.stats.total_bytes == (n - 1) * kv_bytes // n
    # the finished partials go home inside the next round's first hop: one extra step in all
    assert backward.stats.counts == {"c10d.alltoall_base_": rounds * (n - 1) + 1}
    assert backward.stats.total_bytes == 2 * (n - 1) * kv_bytes // n


# -- a replicated query against sharded keys/values (FLARE's global queries) ----------------------
def _global_queries(slots: int, lk: int, *, heads_kv: int = H, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, slots, E, generator=g),
        torch.randn(B, heads_kv, lk, E, generator=g),
        torch.randn(B, heads_kv, lk, E, generator=g),
    ]


@pytest.mark.multirank(2)
@pytest.mark.parametrize("kv_split", [[9, 4], [13, 0]], ids=["uneven", "empty"])
@pytest.mark.parametrize("option", ["plain", "causal", "bool-mask", "additive-mask", "gqa", "scale"])
def test_replicated_query_against_sharded_kv(domain_mesh, kv_split, option):
    heads_kv = 1 if option == "gqa" else H
    q, k, v = _global_queries(5, 13, heads_kv=heads_kv)
    kwargs = {"causal": {"is_causal": True}, "gqa": {"enable_gqa": True}, "scale": {"scale": 0.2}}.get(option, {})
    mask = {
        "bool-mask": torch.rand(5, 13, generator=torch.Generator().manual_seed(1)) > 0.3,
        "additive-mask": torch.randn(1, H, 5, 13),
    }.get(option)

    def fn(q, k, v):
        return SDPA(q, k, v, attn_mask=mask, **kwargs)

    kv = ShardSpec(domain_mesh, [Shard(2)], kv_split)
    report = check_conformance(fn, [q, k, v], [None, kv, kv], expected_placements=[Replicate()])
    assert set(report.comms.forward.counts) == {"c10d.allreduce_"}  # no key or value moves


@pytest.mark.multirank(4)
def test_replicated_query_on_four_ranks_with_a_trainable_query(domain_mesh):
    # q is a parameter-like replicated tensor: its gradient is the sum over every rank's keys.
    q, k, v = _global_queries(3, 17)
    kv = ShardSpec(domain_mesh, [Shard(2)], [6, 0, 7, 4])
    check_conformance(
        lambda q, k, v: SDPA(q, k, v),
        [q, k, v],
        [ShardSpec(domain_mesh, [Replicate()]), kv, kv],
        expected_placements=[Replicate()],
    )


# -- q, k and v split alike on the batch or head dim: local --------------------------------------
@pytest.mark.multirank(2)
@pytest.mark.parametrize("dim", [0, 1], ids=["batch", "heads"])
@pytest.mark.parametrize("split", [[3, 1], [4, 0]], ids=["uneven", "empty"])
def test_batch_or_head_sharded_sdpa_is_local(domain_mesh, dim, split):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 4, 6, E, generator=g) for _ in range(3))
    mask = torch.randn(1, 1, 6, 6, generator=g)  # replicated, broadcast over the split dim

    def fn(q, k, v):
        return SDPA(q, k, v, attn_mask=mask)

    report = check_conformance(fn, [q, k, v], ShardSpec(domain_mesh, [Shard(dim)], split))
    assert not report.comms.forward.counts


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[3, 1], [4, 0]], ids=["uneven", "empty"])
def test_batch_sharded_sdpa_with_a_trainable_per_sample_mask(domain_mesh, split):
    # Swin's shifted windows: a replicated additive mask with one row per window, cut to each rank's
    # windows; its gradient is summed over the ranks before the cut (same all-reduce size everywhere).
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, 2, 6, E, generator=g) for _ in range(3))
    mask = torch.randn(4, 1, 6, 6, generator=g)
    spec = ShardSpec(domain_mesh, [Shard(0)], split)
    check_conformance(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m), [q, k, v, mask], [spec, spec, spec, None])


@pytest.mark.multirank(2)
@pytest.mark.parametrize("layout", ["tokens", "qkv-views"])
@pytest.mark.parametrize("split", [[10, 6], [8, 8]], ids=["uneven", "even"])
def test_non_contiguous_query_key_value(domain_mesh, layout, split):
    # SongUNet's attention: tokens from x.flatten(2).transpose(1, 2), q/k/v as qkv[..., i, :] views
    # of a permuted tensor. torch's fused CPU kernel, fed those strides directly by the ring, returned
    # outputs of 1e35 and NaN; F.scaled_dot_product_attention checks strides before choosing it.
    def fn(x):
        if layout == "tokens":
            tokens = x.flatten(2).transpose(1, 2).unsqueeze(1)
            return F.scaled_dot_product_attention(tokens, tokens, tokens)
        qkv = x.reshape(1, 2, 2, 3, -1).permute(0, 1, 4, 3, 2)  # (B, heads, L, 3, C/heads)
        return F.scaled_dot_product_attention(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :])

    x = torch.randn(1, 4 if layout == "tokens" else 12, 16, 3)
    check_conformance(fn, [x], ShardSpec(domain_mesh, [Shard(2)], split), expected_placements=None)
