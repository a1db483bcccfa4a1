"""Tests of the convolution plugin (patches/convolution.py): strided, circular and transposed convs on uneven shards."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.convolution import (
    CONV_TARGETS,
    TRANSPOSED_TARGETS,
    conv_row_plan,
    conv_transpose_row_plan,
    sharded_conv,
)
from physicsnemo_shardext.ranks.comm_accounting import CommCounter
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

TOL = {"rtol": 1e-4, "atol": 1e-5}


def test_plugin_overrides_every_builtin_conv_target():
    registry = physicsnemo_shardext.get_registry()
    for target in CONV_TARGETS + TRANSPOSED_TARGETS:
        record = registry.provenance(target)
        assert record is not None and record.declaration.handler is sharded_conv


def _random_split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def test_row_plans_reassemble_the_single_process_result():
    # Single process: run each coordinate's plan on slices of one tensor and concatenate.
    rng = random.Random(0)
    checked = 0
    while checked < 300:
        total, k, s = rng.randint(1, 14), rng.randint(1, 5), rng.randint(1, 3)
        d, p = rng.randint(1, 2), rng.randint(0, 3)
        sizes = _random_split(rng, total, rng.randint(1, 4))  # empty shards included
        x = torch.randn(1, 1, total, dtype=torch.float64)
        w = torch.randn(1, 1, k, dtype=torch.float64)
        transposed = rng.random() < 0.5
        op = rng.randint(0, max(s, d) - 1)
        try:
            ref = F.conv_transpose1d(x, w, None, s, p, op, 1, d) if transposed else F.conv1d(x, w, None, s, p, d)
        except RuntimeError:
            continue  # invalid for torch too
        make = conv_transpose_row_plan if transposed else conv_row_plan
        plan = make(sizes, k, s, d, p, ref.shape[-1])
        pieces = []
        for c, rows in enumerate(plan.rows):
            n_out = plan.out_sizes()[c]
            if (transposed and not rows) or n_out == 0:
                pieces.append(torch.zeros(1, 1, n_out, dtype=torch.float64))
            elif transposed:
                local = F.conv_transpose1d(x[..., list(rows)], w, None, s, 0, 0, 1, d)
                pieces.append(F.pad(local, (plan.before[c], plan.after[c])))
            else:
                local = F.pad(x[..., list(rows)], (plan.before[c], plan.after[c]))
                pieces.append(F.conv1d(local, w, None, s, 0, d))
        torch.testing.assert_close(torch.cat(pieces, -1), ref, msg=f"{transposed=} {sizes=} {k=} {s=} {d=} {p=} {op=}")
        checked += 1


MODULES = {
    # Pix2Pix-UNet downsampling and Pix2Pix encoder convs.
    "k4s2p1": lambda: nn.Conv2d(3, 4, 4, stride=2, padding=1),
    "k3s2p1": lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1),
    "k3s3-dil2-groups-nobias": lambda: nn.Conv2d(4, 6, 3, stride=3, padding=2, dilation=2, groups=2, bias=False),
    # SRResNet-like 'same' convs (k9 on a 1-row shard is wider than the neighbour; k3 goes to the built-in).
    "k9-same": lambda: nn.Conv2d(3, 4, 9, padding=4),
    "k3-same-builtin": lambda: nn.Conv2d(3, 4, 3, padding=1),
    "k4-same-even": lambda: nn.Conv2d(3, 4, 4, padding="same"),
    "k3-valid": lambda: nn.Conv2d(3, 4, 3),
    # Pix2Pix decoder, DCGAN-style and patch-merging transposed convs.
    "T-k3s2p1op1": lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
    "T-k4s2p1": lambda: nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1),
    "T-k2s2": lambda: nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2),
    "T-k3s3-dil2-op1": lambda: nn.ConvTranspose2d(3, 2, 3, stride=3, padding=2, output_padding=1, dilation=2),
}
CASES = [(name, [10, 7]) for name in MODULES] + [
    ("k4s2p1", [16, 1]),
    ("k9-same", [16, 1]),
    ("k3s2p1", [1, 16]),
    ("T-k3s2p1op1", [16, 1]),
    ("T-k3s2p1op1", [1, 16]),
]


@pytest.mark.multirank(2)
@pytest.mark.parametrize(("name", "split"), CASES, ids=[f"{n}-{s[0]}-{s[1]}" for n, s in CASES])
def test_conv2d_matches_single_process_with_weight_grads(domain_mesh, name, split):
    module = MODULES[name]()
    x = torch.randn(2, module.in_channels, 17, 6)
    report = check_conformance(module, [x], ShardSpec(domain_mesh, [Shard(2)], split), **TOL)
    assert report.output_placements == [(Shard(2),)]


@pytest.mark.multirank(2)
def test_output_split_follows_the_receptive_field_centre(domain_mesh):
    x = shard_tensor(torch.randn(1, 3, 17, 4), domain_mesh, [Shard(2)], [10, 7])
    sizes = lambda y: [s[2] for s in y._spec.sharding_shapes()[0]]  # noqa: E731
    assert sizes(nn.Conv2d(3, 2, 4, stride=2, padding=1)(x)) == [5, 3]  # H_out 8: halves the split
    assert sizes(nn.Conv2d(3, 2, 3, padding=1)(x)) == [10, 7]  # 'same' keeps it
    assert sizes(nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1)(x)) == [20, 14]  # doubles it
    assert sizes(nn.Conv2d(3, 2, (5, 1))(x)) == [8, 5]  # 'valid' loses the halo on both boundary shards


@pytest.mark.multirank(2)
@pytest.mark.parametrize("dims", [1, 3])
def test_conv1d_conv3d_and_transposed(domain_mesh, dims):
    conv = {1: nn.Conv1d, 3: nn.Conv3d}[dims]
    convt = {1: nn.ConvTranspose1d, 3: nn.ConvTranspose3d}[dims]
    model = nn.Sequential(conv(2, 3, 3, stride=2, padding=1), convt(3, 2, 3, stride=2, padding=1, output_padding=1))
    x = torch.randn(1, 2, 11, *([4, 3] if dims == 3 else []))
    check_conformance(model, [x], ShardSpec(domain_mesh, [Shard(2)], [8, 3]), **TOL)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("mode", ["circular", "reflect"])
def test_conv_padding_modes_periodic_and_mirrored(domain_mesh, mode):
    # padding_mode calls F.pad (padding plugin) then the conv with padding 0; a 1-row shard included.
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode),
        nn.Conv2d(3, 2, 5, stride=2, padding=2, padding_mode=mode),
    )
    x = torch.randn(1, 2, 13, 8)
    check_conformance(model, [x], ShardSpec(domain_mesh, [Shard(3)], [7, 1]), **TOL)


@pytest.mark.multirank(2)
def test_pix2pix_like_stack_on_uneven_shards(domain_mesh):
    model = nn.Sequential(
        nn.ReflectionPad2d(3),
        nn.Conv2d(2, 4, 7),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.ReflectionPad2d(1),
        nn.Conv2d(6, 6, 3),
        nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1),
        nn.Conv2d(4, 2, 4, stride=2, padding=1),
    )
    x = torch.randn(1, 2, 19, 8)
    check_conformance(model, [x], ShardSpec(domain_mesh, [Shard(2)], [12, 7]), **TOL)


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[6, 5, 1, 5], [9, 0, 1, 7]], ids=["uneven-tiny", "empty-shard"])
def test_four_ranks(domain_mesh, split):
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
        nn.Conv2d(2, 2, 5, padding=2, padding_mode="circular"),
    )
    x = torch.randn(1, 2, 17, 5)
    check_conformance(model, [x], ShardSpec(domain_mesh, [Shard(2)], split), **TOL)


@pytest.mark.multirank(4)
def test_2d_spatial_mesh(spatial_mesh):
    model = nn.Sequential(
        nn.Conv2d(2, 3, 4, stride=2, padding=1),
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
        nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"),
        nn.Conv2d(2, 2, 3, padding=1),  # stride-1 'same': delegated to the built-in
    )
    x = torch.randn(1, 2, 11, 9)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [7, 4], 1: [3, 6]})
    report = check_conformance(model, [x], spec, **TOL)
    assert report.output_placements == [(Shard(2), Shard(3))]


@pytest.mark.multirank(4)
def test_ddp_domain_mesh_with_replicated_batch(ddp_domain_mesh):
    # PhysicsNeMo 2.2.2 raises IndexError here; weight grads must be reduced over "domain" only.
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, stride=2, padding=1))
    x = torch.randn(2, 2, 11, 6)
    spec = ShardSpec(ddp_domain_mesh, [Replicate(), Shard(2)], {1: [8, 3]})
    report = check_conformance(model, [x], spec, **TOL)
    assert report.output_placements == [(Replicate(), Shard(2))]
    # Batch sharded over "ddp" too: weight grads are then reduced over both mesh dims.
    spec = ShardSpec(ddp_domain_mesh, [Shard(0), Shard(2)], {1: [8, 3]})
    report = check_conformance(model, [x], spec, **TOL)
    assert report.output_placements == [(Shard(0), Shard(2))]


def _forward_bytes(fn, x_sharded) -> tuple[int, dict]:
    with CommCounter() as counter:
        fn(x_sharded)
    return counter.stats.total_bytes, dict(counter.stats.counts)


@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    ("k", "stride", "padding"), [(4, 2, 1), (3, 2, 1), (9, 1, 4)], ids=["k4s2p1", "k3s2p1", "k9-same-delegated"]
)
def test_forward_moves_only_a_halo_slab(domain_mesh, k, stride, padding):
    x = torch.randn(1, 3, 17, 6)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [10, 7])
    w = torch.randn(4, 3, k, k)
    fn = lambda t: F.conv2d(t, w, stride=stride, padding=padding)  # noqa: E731
    patched, counts = _forward_bytes(fn, xs)
    # The only correct alternative without this patch: replicate the input (x.full_tensor()).
    replicate, _ = _forward_bytes(lambda t: t.full_tensor(), xs)
    with physicsnemo_shardext.disabled(plugins=["convolution"]):  # the built-in (wrong for stride 2, but it runs)
        builtin = _forward_bytes(fn, xs)[0] if k % 2 else None  # it refuses even kernels with padding
    # Bound: a rank sends at most d*(k-1) input rows (its neighbours' halos); a row is 3 x 6 floats.
    assert patched <= (k - 1) * 3 * 6 * 4
    assert patched < replicate
    assert builtin is None or patched <= builtin
    if stride > 1:  # our own exchange: one all_to_all (a rank whose rows nobody needs sends 0 bytes)
        assert counts == {"c10d.alltoall_base_": 1}


@pytest.mark.multirank(2)
def test_builtin_and_dtensor_fallback_are_silently_wrong_for_strided_uneven(domain_mesh):
    # H = 17 split 9/8 (torch.chunk): the second shard starts on an odd row.
    x = torch.randn(1, 3, 17, 6)
    w = torch.randn(4, 3, 3, 3)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [9, 8])
    expected = F.conv2d(x, w, stride=2, padding=1)

    def wrong(result: torch.Tensor) -> bool:
        return result.shape != expected.shape or not torch.allclose(result, expected, atol=1e-4)

    with physicsnemo_shardext.disabled(plugins=["convolution"]):  # PhysicsNeMo's built-in
        assert wrong(F.conv2d(xs, w, stride=2, padding=1).full_tensor())
    with physicsnemo_shardext.disabled(targets=[F.conv2d]):  # pure DTensor fallback: local convs, no halo
        assert wrong(F.conv2d(xs, w, stride=2, padding=1).full_tensor())
    torch.testing.assert_close(F.conv2d(xs, w, stride=2, padding=1).full_tensor(), expected, **TOL)


@pytest.mark.multirank(2)
def test_refusals(domain_mesh, rank):
    w = torch.randn(4, 3, 3, 3)
    channels = shard_tensor(torch.randn(1, 4, 5, 5), domain_mesh, [Shard(1)], [2, 2])
    with pytest.raises(MissingShardPatch, match="conv2d: input sharded along the channel dim"):
        F.conv2d(channels, torch.randn(2, 4, 3, 3), padding=1)
    partial = ShardTensor.from_local(torch.randn(1, 3, 5, 5), domain_mesh, [Partial()], sharding_shapes={})
    with pytest.raises(MissingShardPatch, match=r"conv_transpose2d: input has a Partial placement .* and a bias"):
        F.conv_transpose2d(partial, w.transpose(0, 1), torch.randn(3))  # the built-in adds the bias per rank
    xs = shard_tensor(torch.randn(1, 3, 9, 5), domain_mesh, [Shard(2)], [5, 4])
    sharded_weight = shard_tensor(w, domain_mesh, [Shard(0)], [2, 2])
    with pytest.raises(MissingShardPatch, match="conv2d"):
        F.conv2d(xs, sharded_weight)  # weights must be plain or replicated


@pytest.mark.multirank(2)
@pytest.mark.parametrize("transposed", [False, True], ids=["conv2d", "conv_transpose2d"])
def test_partial_input_without_bias_is_delegated_to_the_builtin(domain_mesh, rank, transposed):
    # A convolution is linear: the built-in convolves each rank's term of the Partial(sum).
    torch.manual_seed(0)
    full, w = torch.randn(1, 3, 6, 5), torch.randn(4, 3, 3, 3)
    share = torch.rand(full.shape)
    local = full * share if rank == 0 else full * (1 - share)
    partial = ShardTensor.from_local(local, domain_mesh, [Partial()], sharding_shapes={})
    func, weight = (F.conv_transpose2d, w.transpose(0, 1)) if transposed else (F.conv2d, w)
    out = func(partial, weight, padding=1)
    torch.testing.assert_close(out.full_tensor(), func(full, weight, padding=1), **TOL)
    with physicsnemo_shardext.disabled(plugins=["convolution"]):
        builtin = func(partial, weight, padding=1)
    torch.testing.assert_close(out.to_local(), builtin.to_local())


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[5, 4], [8, 1]], ids=["uneven", "tiny-shard"])
def test_conv_stack_under_cpu_autocast_bf16(domain_mesh, split):
    # The second conv gets a bf16 activation and float32 parameters: torch's autocast casts
    # them all to bf16, and so must the sharded run (shape checks included).
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 3, 3, padding=1), nn.ConvTranspose2d(3, 2, 3, padding=1)
    )
    check_conformance(
        model, [torch.randn(1, 2, 9, 6)], ShardSpec(domain_mesh, [Shard(2)], split), autocast=torch.bfloat16
    )
