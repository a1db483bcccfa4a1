"""Tests of the first-party pointwise plugin (patches/pointwise.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.pointwise import (
    INPLACE_DELEGATED,
    POINTWISE_ACTIVATIONS,
    local_pointwise,
    prelu_local,
)
from physicsnemo_shardext.testing import ShardSpec, check_conformance, measure_comms, shard_tensor

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "mish": F.mish,
    "elu": lambda x: F.elu(x, alpha=0.7),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "softplus": lambda x: F.softplus(x, beta=2.0),
    "hardswish": F.hardswish,
    "softshrink": lambda x: F.softshrink(x, 0.3),
    "hardshrink": lambda x: F.hardshrink(x, lambd=0.3),
    "tanhshrink": F.tanhshrink,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "method_tanh": lambda x: x.tanh(),
    "method_sigmoid": lambda x: x.sigmoid(),
}


def test_every_activation_is_installed_by_the_plugin():
    registry = physicsnemo_shardext.get_registry()
    for activation in POINTWISE_ACTIVATIONS:
        record = registry.provenance(activation)
        assert record is not None and record.declaration.handler is local_pointwise
        assert record.plugin.distribution == "physicsnemo-shardext"


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("split", [[10, 7], [16, 1]], ids=["uneven", "tiny-shard"])
def test_activation_matches_single_process(domain_mesh, name, split):
    x = torch.randn(2, 3, 17, 5)
    report = check_conformance(ACTIVATIONS[name], [x], ShardSpec(domain_mesh, [Shard(2)], split))
    assert report.comms.forward.total_calls == 0  # purely local, as promised
    assert report.comms.backward.total_calls == 0


@pytest.mark.multirank(2)
def test_module_with_activations_conforms_with_parameters(domain_mesh):
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(4, 2, 1), torch.nn.SiLU()
    )
    x = torch.randn(1, 3, 13, 6)
    check_conformance(model, [x], ShardSpec(domain_mesh, [Shard(2)], [9, 4]))


@pytest.mark.multirank(4)
def test_activation_on_2d_spatial_mesh(spatial_mesh):
    x = torch.randn(1, 2, 9, 7)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [6, 3], 1: [2, 5]})
    report = check_conformance(F.silu, [x], spec)
    assert report.comms.forward.total_calls == 0


@pytest.mark.multirank(2)
def test_patch_moves_less_than_dtensor_fallback(domain_mesh):
    x = torch.randn(1, 4, 17, 8)
    spec = ShardSpec(domain_mesh, [Shard(2)], [10, 7])
    patched = measure_comms(F.gelu, [x], spec)
    with physicsnemo_shardext.disabled(targets=[F.gelu]):
        fallback = measure_comms(F.gelu, [x], spec)
    assert patched.forward.total_bytes == 0
    # DTensor also runs a pointwise op locally; the patch only skips the conversion round trip.
    assert fallback.forward.total_bytes >= patched.forward.total_bytes


INPLACE = {
    "silu": lambda y: F.silu(y, inplace=True),
    "elu": lambda y: F.elu(y, 1.0, True),
    "leaky_relu": lambda y: F.leaky_relu(y, 0.1, inplace=True),
    "mish": lambda y: F.mish(y, inplace=True),  # right since the fallback_fix plugin (was refused)
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(INPLACE))
@pytest.mark.parametrize("split", [[3, 2], [5, 0]], ids=["uneven", "empty-shard"])
def test_inplace_is_delegated_to_the_fallback(domain_mesh, name, split):
    # nn.SiLU(inplace=True) and friends: the DTensor fallback updates the local block in place, right.
    assert getattr(F, name) in INPLACE_DELEGATED

    def fn(x):
        return INPLACE[name](x * 2.0) * 1.5

    check_conformance(fn, [torch.randn(1, 2, 5, 3)], ShardSpec(domain_mesh, [Shard(2)], split))


@pytest.mark.multirank(2)
def test_inplace_refusals_name_the_configuration(domain_mesh, rank):
    from physicsnemo_shardext.testing import shard_tensor

    xs = shard_tensor(torch.randn(1, 2, 5, 3), domain_mesh, [Shard(2)], [3, 2]) * 1.0
    with pytest.raises(MissingShardPatch, match=r"hardswish\(inplace=True\) on a ShardTensor: .* no sharding rule"):
        F.hardswish(xs, inplace=True)  # DTensor has no rule for aten.hardswish_backward
    partial = ShardTensor.from_local(torch.randn(2, 3), domain_mesh, [Partial()], sharding_shapes={})
    # Measured on 2 ranks: the fallback refuses the placement change (silu, mish) or, for hardswish,
    # activates each rank's term (wrong) and fails in backward.
    for name in ("silu", "mish", "hardswish"):
        with pytest.raises(MissingShardPatch, match=name + r"\(inplace=True\): input has a Partial placement"):
            getattr(F, name)(partial, inplace=True)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", ["gelu", "tanh", "hardswish"])
def test_partial_input_is_summed_first(domain_mesh, rank, name):
    torch.manual_seed(0)
    full = torch.randn(2, 3)
    share = torch.rand(full.shape)
    local = (full * share if rank == 0 else full * (1 - share)).requires_grad_(True)
    partial = ShardTensor.from_local(local, domain_mesh, [Partial()], sharding_shapes={})
    func = torch.tanh if name == "tanh" else getattr(F, name)
    out = func(partial)
    assert tuple(out._spec.placements) == (Replicate(),)
    torch.testing.assert_close(out.to_local(), func(full))
    with physicsnemo_shardext.disabled(plugins=["pointwise"]):
        baseline = func(partial)  # the DTensor fallback: same forward
    torch.testing.assert_close(out.full_tensor(), baseline.full_tensor())
    reference = full.clone().requires_grad_(True)
    func(reference).sum().backward()
    out.to_local().sum().backward()
    # d/d(term) of f(sum of terms) is f'(sum): each rank's term gets the full gradient.
    torch.testing.assert_close(local.grad, reference.grad)


@pytest.mark.multirank(4)
def test_activations_on_ddp_domain_mesh(ddp_domain_mesh):
    # Batch replicated over "ddp", height sharded unevenly over "domain". Parameter-free on
    # purpose: PhysicsNeMo 2.2.2's conv patch raises IndexError on this mesh and its linear
    # patch leaves weight gradients Partial over "domain" (caught by check_conformance).
    chain = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.GELU(), torch.nn.Tanh())
    x = torch.randn(2, 2, 11, 6)
    spec = ShardSpec(ddp_domain_mesh, [torch.distributed.tensor.Replicate(), Shard(2)], {1: [8, 3]})
    report = check_conformance(chain, [x], spec)
    assert report.comms.forward.total_calls == 0


# -- prelu (moved here from the layout_ops family) -------------------------------------------
def test_prelu_is_installed_by_the_plugin():
    record = physicsnemo_shardext.get_registry().provenance(F.prelu)
    assert record is not None and record.plugin.name == "pointwise" and record.declaration.handler is prelu_local


@pytest.mark.multirank(2)
@pytest.mark.parametrize("num_parameters", [1, 4])
def test_prelu_reduces_the_weight_gradient(domain_mesh, num_parameters):
    prelu = torch.nn.PReLU(num_parameters, init=0.3)
    x = torch.randn(1, 4, 7, 3)
    report = check_conformance(prelu, [x], ShardSpec(domain_mesh, [Shard(2)], [6, 1]))
    assert report.comms.forward.total_calls == 0
    assert report.comms.backward.counts == {"c10d.allreduce_": 1}  # the weight gradient, nothing else


@pytest.mark.multirank(4)
def test_prelu_on_2d_spatial_mesh(spatial_mesh):
    prelu = torch.nn.PReLU(2, init=-0.2)
    x = torch.randn(1, 2, 7, 5)
    check_conformance(prelu, [x], ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [3, 4], 1: [5, 0]}))


@pytest.mark.multirank(2)
def test_prelu_refuses_a_sharded_weight(domain_mesh):
    x = shard_tensor(torch.randn(1, 4, 6), domain_mesh, [Shard(2)], [4, 2])
    weight = ShardTensor.from_local(torch.ones(2), domain_mesh, [Shard(0)], sharding_shapes={0: ((2,), (2,))})
    with pytest.raises(MissingShardPatch, match="weight: expected a replicated tensor"):
        prelu_local(F.prelu, (), (x, weight), {})
    replicated = ShardTensor.from_local(torch.ones(1), domain_mesh, [Replicate()], sharding_shapes={})
    assert prelu_local(F.prelu, (), (x, replicated), {}).to_local().shape == x.to_local().shape


@pytest.mark.multirank(2)
def test_prelu_refusals_name_the_failing_backward(domain_mesh, rank):
    weight = torch.tensor([0.25])
    partial = ShardTensor.from_local(torch.randn(1, 2, 4), domain_mesh, [Partial()], sharding_shapes={})
    with pytest.raises(MissingShardPatch, match="Partial.*_prelu_kernel_backward"):
        F.prelu(partial, weight)


#: name -> f(sharded, replicated): a binary op with one operand replicated, in either position.
BINARY_WITH_REPLICATED = {
    "sub": lambda a, b: a - b,
    "rsub": lambda a, b: b - a,
    "torch.sub": torch.sub,
    "method-sub": lambda a, b: a.sub(b),
    "mul": lambda a, b: a * b,
    "rmul": lambda a, b: b * a,
    "torch.mul": torch.mul,
    "div": lambda a, b: a / (b * b + 1.0),
    "rdiv": lambda a, b: b / 3.0 / (a * a + 1.0),
    "torch.div": lambda a, b: torch.div(a, b * b + 1.0),
    "squared-error": lambda a, b: ((a - b) ** 2).mean(),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(BINARY_WITH_REPLICATED))
@pytest.mark.parametrize("split", [[12, 8], [20, 0], [10, 10]], ids=["uneven", "empty", "even"])
def test_binary_op_with_a_replicate_shard_tensor_matches_single_process(domain_mesh, name, split):
    # The guidance's target: a Replicate ShardTensor. The DTensor fallback raised a shape
    # error here on every split other than torch.chunk's (12/8 is not chunk's 10/10).
    x, target = torch.randn(1, 2, 20, 3), torch.randn(1, 2, 20, 3)
    shardings = [ShardSpec(domain_mesh, [Shard(2)], split), ShardSpec(domain_mesh, [Replicate()])]
    expected = None if name == "squared-error" else "input"
    report = check_conformance(BINARY_WITH_REPLICATED[name], [x, target], shardings, expected_placements=expected)
    if name != "squared-error":
        assert report.comms.forward.total_calls == 0  # the replicated operand is cut locally


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", ["mul", "rmul", "div", "sub"])
def test_binary_op_with_a_plain_trainable_operand_sums_its_gradient(domain_mesh, name):
    # A plain tensor broadcast along the sharded dim (a per-channel scale): its gradient is
    # a partial sum on each rank and must come back whole (summed over the shards).
    x, scale = torch.randn(1, 3, 11, 4), torch.randn(1, 3, 1, 4)
    check_conformance(
        BINARY_WITH_REPLICATED[name],
        [x, scale],
        [ShardSpec(domain_mesh, [Shard(2)], [8, 3]), None],
        params="plain",
    )


@pytest.mark.multirank(2)
def test_binary_ops_it_does_not_take_are_delegated(domain_mesh):
    from physicsnemo_shardext.patches.pointwise import binary_with_replicated

    x = shard_tensor(torch.arange(8.0).reshape(2, 4), domain_mesh, [Shard(1)], [2, 2])
    partial = ShardTensor.from_local(torch.ones(2, 4), domain_mesh, [Partial()], sharding_shapes={})
    with physicsnemo_shardext.disabled(plugins=["pointwise"]):
        expected = [(x * 2.0).full_tensor(), (x - x).full_tensor()]
    # A scalar goes to the fallback; two ShardTensors split alike run locally: the same result.
    torch.testing.assert_close(binary_with_replicated(torch.mul, (), (x, 2.0), {}).full_tensor(), expected[0])
    torch.testing.assert_close(binary_with_replicated(torch.sub, (), (x, x), {}).full_tensor(), expected[1])
    # A Partial operand (a pending sum, sharded nowhere) is summed first, as the fallback does.
    torch.testing.assert_close(
        binary_with_replicated(torch.mul, (), (x, partial), {}).full_tensor(), (x.full_tensor() * 2.0)
    )


class _Modulated(torch.nn.Module):
    """``op`` of a sharded activation and per-channel parameters (SongUNet's adaptive scale and shift)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.scale = torch.nn.Parameter(torch.randn(1, 3, 1, 1))
        self.shift = torch.nn.Parameter(torch.randn(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, shift = self.scale, self.shift
        if self.op == "addcmul":
            return torch.addcmul(shift, x, scale + 1)
        if self.op == "addcdiv":
            return torch.addcdiv(shift, x, scale * scale + 1, value=0.5)
        if self.op == "lerp":
            return torch.lerp(x, shift, 0.3)
        if self.op == "maximum":
            return torch.maximum(x, shift)
        if self.op == "minimum":
            return x.minimum(shift)
        if self.op == "where":
            return torch.where(x > 0, x * scale, shift)
        if self.op == "add_":
            y = x * 1.0
            y.add_(shift)  # used after the statement, not through its return value
            return y * scale
        raise AssertionError(self.op)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("op", ["addcmul", "addcdiv", "lerp", "maximum", "minimum", "where", "add_"])
@pytest.mark.parametrize("split", [[8, 3], [11, 0]], ids=["uneven", "empty"])
def test_elementwise_ops_with_replicated_parameters_give_whole_gradients(domain_mesh, op, split):
    # With the fallback these gave every parameter a pending Partial(sum) gradient (addcmul,
    # lerp, maximum: right value, wrong placement for an optimizer), where() raised a shape
    # error, and y.add_(p) left y's history stale (its inputs got the old value's gradient).
    check_conformance(_Modulated(op), [torch.randn(1, 3, 11, 4)], ShardSpec(domain_mesh, [Shard(2)], split))


@pytest.mark.multirank(2)
def test_comparisons_and_conversions_keep_an_uneven_split(domain_mesh):
    full = torch.randn(2, 8, 3)
    x = shard_tensor(full, domain_mesh, [Shard(1)], [5, 3])
    for op in (
        lambda t: t > 0,
        lambda t: torch.ge(t, 0.1),
        lambda t: t.ne(0.0),
        lambda t: t.type(torch.int64),
        lambda t: t.double(),
        lambda t: (t > 0).float(),
        lambda t: t.long(),
    ):
        result = op(x)
        assert result.placements == (Shard(1),) and result.to_local().shape[1] == [5, 3][domain_mesh.get_local_rank()]
        torch.testing.assert_close(result.full_tensor(), op(full))


@pytest.mark.multirank(2)
@pytest.mark.parametrize("case", ["enlarging-broadcast", "pending-sum", "pending-mean"])
def test_broadcasts_that_enlarge_the_block_and_pending_sums(domain_mesh, case):
    # FIGConvNet/DoMINO's Fourier features: x.unsqueeze(-1) * freqs enlarges the block along an
    # unsharded dim (the fallback raised a shape error); x * x.sum(dim, keepdim=True) met a Partial
    # sum whose fallback backward sized the blocks as even chunks and failed.
    freqs = torch.randn(1, 1, 1, 2)
    fn = {
        "enlarging-broadcast": lambda t: t.unsqueeze(-1) * freqs,
        "pending-sum": lambda t: t * (t * t).sum(dim=1, keepdim=True),
        "pending-mean": lambda t: t / (t.abs().mean(dim=1, keepdim=True) + 1.0),
    }[case]
    check_conformance(fn, [torch.randn(1, 8, 3)], ShardSpec(domain_mesh, [Shard(1)], [5, 3]))
