"""check_conformance: passes for PhysicsNeMo's conv, catches a wrong forward and an unreduced weight grad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing import ConformanceError, ShardSpec, check_conformance


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _conv_args(args, kwargs):
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _no_halo_conv2d(func, types, args, kwargs):
    """Wrong forward: convolves each shard on its own, skipping the halo exchange."""
    from physicsnemo.domain_parallel import ShardTensor

    a = _conv_args(args, kwargs or {})
    x = a["input"]
    y = F.conv2d(_local(x), _local(a["weight"]), _local(a.get("bias")), a.get("stride", 1),
                 a.get("padding", 0), a.get("dilation", 1), a.get("groups", 1))
    shapes = {m: [tuple(s[:1]) + (y.shape[1],) + tuple(s[2:]) for s in shp]
              for m, shp in x._spec.sharding_shapes().items()}
    return ShardTensor.from_local(y, x.device_mesh, x.placements, sharding_shapes=shapes)


def _unreduced_weight_grad_conv2d(func, types, args, kwargs):
    """Correct forward, but the weight's gradient is only this rank's contribution."""
    from physicsnemo.domain_parallel import ShardTensor

    a = _conv_args(args, kwargs or {})
    x = a["input"]
    full = x.full_tensor()
    # to_local() of the Replicate weight: its backward labels the local grad Replicate, unreduced.
    y = F.conv2d(full, _local(a["weight"]), _local(a.get("bias")), a.get("stride", 1),
                 a.get("padding", 0), a.get("dilation", 1), a.get("groups", 1))
    shapes = x._spec.sharding_shapes()
    dim = x.placements[0].dim
    sizes = [s[dim] for s in shapes[0]]
    coord = x.device_mesh.get_local_rank(0)
    y_local = y.narrow(dim, sum(sizes[:coord]), sizes[coord])
    out_shapes = {0: [tuple(y.shape[:dim]) + (n,) + tuple(y.shape[dim + 1:]) for n in sizes]}
    return ShardTensor.from_local(y_local, x.device_mesh, x.placements, sharding_shapes=out_shapes)


@pytest.mark.multirank(2)
def test_conv2d_uneven_split_conforms(domain_mesh):
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 17, 8)
    report = check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
    assert report.output_placements == [(Shard(2),)]
    assert set(report.max_abs_errors) == {
        "output[0]", "gradient of input[0]", "gradient of parameter 'weight'", "gradient of parameter 'bias'"
    }
    # The halo exchange is communication in forward; the weight/bias grads are reduced in backward.
    assert report.comms.forward.total_calls >= 1
    assert report.comms.backward.total_calls >= 1


@pytest.mark.multirank(2)
def test_conv2d_plain_params_conform(domain_mesh):
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 9, 11)
    check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(3)], [3, 8]), params="plain", count_comms=False)


@pytest.mark.multirank(2)
def test_function_conforms_and_wrong_placement_is_reported(domain_mesh):
    x = torch.randn(4, 13)
    spec = ShardSpec(domain_mesh, [Shard(1)], [9, 4])
    check_conformance(torch.tanh, [x], spec, count_comms=False)
    with pytest.raises(ConformanceError, match=r"placements of output\[0\]"):
        check_conformance(torch.tanh, [x], spec, expected_placements=[Shard(0)], count_comms=False)


@pytest.mark.multirank(2)
def test_wrong_forward_is_caught(domain_mesh, registry_sandbox, rank):
    from physicsnemo.domain_parallel import ShardTensor

    ShardTensor.register_function_handler(F.conv2d, _no_halo_conv2d)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 17, 8)
    with pytest.raises(ConformanceError) as info:
        check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]), count_comms=False)
    message = str(info.value)
    assert "output[0]: max abs error" in message
    assert "rank(s) [0, 1]" in message  # gathered: every rank raises the same, complete report


@pytest.mark.multirank(2)
def test_unreduced_parameter_gradient_is_caught(domain_mesh, registry_sandbox):
    from physicsnemo.domain_parallel import ShardTensor

    ShardTensor.register_function_handler(F.conv2d, _unreduced_weight_grad_conv2d)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 17, 8)
    with pytest.raises(ConformanceError) as info:
        check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]), count_comms=False)
    failed = {m.what for m in info.value.mismatches}
    assert "output[0]" not in failed  # the forward is right ...
    assert "gradient of parameter 'weight'" in failed  # ... the weight grad is not reduced
    assert "gradient of parameter 'weight'" in str(info.value)


@pytest.mark.multirank(2)
def test_sandbox_undid_the_wrong_patch(domain_mesh):
    # Runs after the two tests above in the same (reused) workers: their handlers are gone.
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    check_conformance(conv, [torch.randn(1, 3, 17, 8)], ShardSpec(domain_mesh, [Shard(2)], [10, 7]),
                      count_comms=False)


@pytest.mark.multirank(2)
def test_different_inputs_across_ranks_are_refused(domain_mesh, rank):
    x = torch.randn(4, 6) + rank
    with pytest.raises(ValueError, match="identical"):
        check_conformance(torch.tanh, [x], ShardSpec(domain_mesh, [Shard(1)]))


class _LocalSumTracker(torch.nn.Module):
    """Correct output, but its buffer records only this rank's shard (a wrong running statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        local = x.to_local() if hasattr(x, "to_local") else x
        with torch.no_grad():
            self.seen.add_(local.detach().sum())
        return torch.tanh(x)


@pytest.mark.multirank(2)
def test_wrong_buffer_is_caught(domain_mesh):
    x = torch.randn(2, 9)
    with pytest.raises(ConformanceError) as info:
        check_conformance(_LocalSumTracker(), [x], ShardSpec(domain_mesh, [Shard(1)], [5, 4]),
                          params="plain", count_comms=False)
    assert {m.what for m in info.value.mismatches} == {"buffer 'seen'"}


# -- autocast -------------------------------------------------------------------------------
class _DoubleGrad(torch.autograd.Function):
    """Identity forward, twice the gradient in backward."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _linear_on_shards(x, weight, transform):
    from physicsnemo.domain_parallel import ShardTensor

    y = F.linear(transform(x.to_local()), _local(weight))
    shapes = {m: [tuple(s[:-1]) + (y.shape[-1],) for s in shp] for m, shp in x._spec.sharding_shapes().items()}
    return ShardTensor.from_local(y, x.device_mesh, x.placements, sharding_shapes=shapes)


def _doubled_input_grad_linear(func, types, args, kwargs):
    """Right forward (autocast applies to the local F.linear), twice the input gradient."""
    return _linear_on_shards(args[0], args[1], _DoubleGrad.apply)


def _full_precision_linear(func, types, args, kwargs):
    """Right values, but computed outside autocast: float32 where single-process gives bfloat16."""
    with torch.autocast("cpu", enabled=False):
        return _linear_on_shards(args[0], args[1], lambda t: t)


@pytest.mark.multirank(2)
def test_autocast_option_runs_both_forwards_under_autocast(domain_mesh):
    x = torch.randn(2, 17, 8)
    spec = ShardSpec(domain_mesh, [Shard(1)], [9, 8])
    report = check_conformance(torch.nn.Linear(8, 4), [x], spec, autocast=torch.bfloat16)
    assert report.autocast == ("cpu", torch.bfloat16)
    assert "under torch.autocast('cpu', dtype=torch.bfloat16)" in str(report)
    compared = set(report.max_abs_errors)
    assert set(report.autocast_reference_errors) == set(report.autocast_atols) == compared
    # F.linear autocasts on CPU: the reference has a real bf16 error, the tolerance follows it ...
    error = report.autocast_reference_errors["output[0]"]
    assert error > 1e-4
    assert report.autocast_atols["output[0]"] >= 4.0 * error  # 4 x max(e, bf16 eps x max|reference|)
    # ... while tanh has no CPU autocast rule: no reference error, the plain tolerance.
    report = check_conformance(torch.tanh, [x], spec, autocast=("cpu", torch.bfloat16), count_comms=False)
    assert report.autocast_reference_errors == {"output[0]": 0.0, "gradient of input[0]": 0.0}
    assert set(report.autocast_atols.values()) == {1e-5}


@pytest.mark.multirank(2)
def test_autocast_option_is_validated(domain_mesh):
    spec = ShardSpec(domain_mesh, [Shard(1)], [9, 8])
    with pytest.raises(ValueError, match="mesh's 'cpu'"):
        check_conformance(torch.tanh, [torch.randn(2, 17)], spec, autocast=("cuda", torch.float16))
    with pytest.raises(TypeError, match="autocast must be"):
        check_conformance(torch.tanh, [torch.randn(2, 17)], spec, autocast="bf16")


@pytest.mark.multirank(2)
def test_doubled_gradient_under_autocast_is_caught(domain_mesh, registry_sandbox):
    from physicsnemo.domain_parallel import ShardTensor

    weight = torch.randn(4, 8)  # a constant: only the input's gradient is at stake
    x = torch.randn(2, 17, 8)
    spec = ShardSpec(domain_mesh, [Shard(1)], [9, 8])
    ShardTensor.register_function_handler(F.linear, _doubled_input_grad_linear)
    with pytest.raises(ConformanceError) as info:
        check_conformance(lambda t: F.linear(t, weight), [x], spec, autocast=torch.bfloat16, count_comms=False)
    assert {m.what for m in info.value.mismatches} == {"gradient of input[0]"}  # the forward is right
    message = str(info.value)
    assert "forward under torch.autocast('cpu', dtype=torch.bfloat16)" in message
    assert "autocast reference vs fp32 error" in message


@pytest.mark.multirank(2)
def test_handler_ignoring_autocast_is_caught_by_dtype(domain_mesh, registry_sandbox):
    from physicsnemo.domain_parallel import ShardTensor

    weight = torch.randn(4, 8)
    spec = ShardSpec(domain_mesh, [Shard(1)], [9, 8])
    ShardTensor.register_function_handler(F.linear, _full_precision_linear)
    fn = lambda t: F.linear(t, weight)  # noqa: E731
    check_conformance(fn, [torch.randn(2, 17, 8)], spec, count_comms=False)  # right without autocast
    with pytest.raises(ConformanceError, match=r"output\[0\]: dtype torch.float32 != reference torch.bfloat16"):
        check_conformance(fn, [torch.randn(2, 17, 8)], spec, autocast=torch.bfloat16, count_comms=False)


# -- errors the code under test raises ----------------------------------------------------------
def _install_plugin(name, target, handler):
    """Install ``handler`` for ``target`` as plugin ``name`` (priority 5 beats the first-party one)."""
    import physicsnemo_shardext
    from physicsnemo_shardext import PatchSet
    from physicsnemo_shardext.provenance import PluginInfo

    patches = PatchSet(name)
    patches.function(target, handler, priority=5)
    physicsnemo_shardext.get_registry().add_plugin(PluginInfo(name, f"{name}-dist", "0.1"), list(patches))


def _from_local_like(local, x, placements=None):
    from physicsnemo.domain_parallel import ShardTensor

    placements = x.placements if placements is None else placements
    dim = x.placements[0].dim
    sizes = [s[dim] for s in x._spec.sharding_shapes()[0]]
    shapes = {0: [tuple(local.shape[:dim]) + (n,) + tuple(local.shape[dim + 1:]) for n in sizes]}
    return ShardTensor.from_local(local, x.device_mesh, placements, sharding_shapes=shapes)


def _row_short_tanh(func, types, args, kwargs):
    """Wrong shape: drops the first row, so autograd meets a wrong-shaped output in backward."""
    x = args[0]
    return _from_local_like(torch.tanh(x.to_local())[1:], x)


def _float64_tanh(func, types, args, kwargs):
    x = args[0]
    return _from_local_like(torch.tanh(x.to_local()).double(), x)


def _replicate_labelled_tanh(func, types, args, kwargs):
    """Wrong placement: the local shard labelled Replicate."""
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Replicate

    x = args[0]
    return ShardTensor.from_local(torch.tanh(x.to_local()), x.device_mesh, [Replicate()])


def _raising_tanh(func, types, args, kwargs):
    raise RuntimeError("The size of tensor a (9) must match the size of tensor b (4)")


_SPEC_ARGS = ([Shard(1)], [9, 4])


@pytest.mark.multirank(2)
def test_wrong_shaped_handler_names_output_ranks_and_plugin(domain_mesh, registry_sandbox):
    _install_plugin("bad-shape", torch.tanh, _row_short_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    failed = {m.what: m for m in info.value.mismatches}
    assert "shape (3, 13) != reference (4, 13)" in failed["output[0]"].detail
    backward = failed["gradients (backward from output[0])"]  # autograd's error, no longer raised as such
    assert "Mismatch in shape" in backward.detail and backward.ranks == (0, 1)
    assert "bad-shape (bad-shape-dist==0.1) for torch.tanh" in backward.detail, backward.detail  # the plugin that ran
    assert "bad-shape (bad-shape-dist==0.1) for torch.tanh" in info.value.plugins
    assert "rank(s) [0, 1]" in str(info.value)


@pytest.mark.multirank(2)
def test_handler_raising_in_forward_is_named(domain_mesh, registry_sandbox):
    _install_plugin("raiser", torch.tanh, _raising_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    [mismatch] = info.value.mismatches
    assert mismatch.what == "output" and mismatch.ranks == (0, 1)
    assert mismatch.detail.startswith("the sharded forward raised RuntimeError: The size of tensor a (9)")
    assert "raised in the handler of plugin raiser (raiser-dist==0.1) for torch.tanh" in mismatch.detail


@pytest.mark.multirank(2)
def test_wrong_dtype_is_reported(domain_mesh, registry_sandbox):
    _install_plugin("wide", torch.tanh, _float64_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    message = str(info.value)
    assert "output[0]: dtype torch.float64 != reference torch.float32 (rank(s) [0, 1])" in message
    assert "plugin handlers that ran: wide (wide-dist==0.1) for torch.tanh" in message


@pytest.mark.multirank(2)
def test_wrong_placement_is_reported_with_the_plugin(domain_mesh, registry_sandbox):
    _install_plugin("flat", torch.tanh, _replicate_labelled_tanh)
    with pytest.raises(ConformanceError) as info:
        check_conformance(torch.tanh, [torch.randn(4, 13)], ShardSpec(domain_mesh, *_SPEC_ARGS), count_comms=False)
    failed = {m.what: m for m in info.value.mismatches}
    placements = failed["placements of output[0]"]
    assert "(Replicate(),) != expected (Shard(dim=1),)" in placements.detail and placements.ranks == (0, 1)
    assert "flat (flat-dist==0.1) for torch.tanh" in placements.detail
    assert "output[0]" in failed  # each rank's "full" tensor is only its shard


# -- compile= ---------------------------------------------------------------------------------
class _PadNormConv(torch.nn.Module):
    """F.pad, GroupNorm and a convolution: ops whose first-party handlers run eagerly under torch.compile."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(1, 3)
        self.conv = torch.nn.Conv2d(3, 2, 3)

    def forward(self, x):
        return self.conv(F.pad(F.gelu(self.norm(x)), (1, 1, 1, 1)))


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.multirank(2)
@pytest.mark.parametrize("params", ["distribute", "plain"])
def test_compile_option_compares_compiled_steps_with_eager(domain_mesh, _fresh_dynamo, params):
    x = torch.randn(1, 3, 11, 6)
    report = check_conformance(_PadNormConv(), [x], ShardSpec(domain_mesh, [Shard(2)], [7, 4]),
                               params=params, compile="aot_eager", count_comms=False)
    compiled = {k: v for k, v in report.max_abs_errors.items() if k.startswith("compiled (aot_eager)")}
    names = ["output[0]", "gradient of input[0]"] + [
        f"gradient of parameter {n!r}" for n in ("norm.weight", "norm.bias", "conv.weight", "conv.bias")]
    assert set(compiled) == {f"compiled (aot_eager) step {k}: {n}" for k in range(2) for n in names}
    assert max(compiled.values()) == 0.0  # the sharded ops run eagerly behind graph breaks: same numbers


def _traced_differently_tanh(func, types, args, kwargs):
    """A handler that is right eagerly but wrong when traced (as an untraceable collective would be)."""
    from physicsnemo.domain_parallel import ShardTensor

    from physicsnemo_shardext.primitives import from_local_like, is_tracing

    x = args[0]
    local = torch.tanh(x.to_local())
    return from_local_like(local * 2 if is_tracing(args, kwargs) else local, x) if isinstance(x, ShardTensor) \
        else torch.tanh(x)


@pytest.mark.multirank(2)
def test_compile_option_catches_a_handler_traced_wrongly(domain_mesh, registry_sandbox, _fresh_dynamo):
    from physicsnemo.domain_parallel import ShardTensor

    ShardTensor.register_function_handler(torch.tanh, _traced_differently_tanh)
    x = torch.randn(4, 13)
    spec = ShardSpec(domain_mesh, [Shard(1)], [9, 4])
    check_conformance(torch.tanh, [x], spec, count_comms=False)  # eagerly it conforms
    # Traced, it either computes the wrong numbers or does not compile: both are reported.
    with pytest.raises(ConformanceError, match=r"compiled \(aot_eager\)"):
        check_conformance(torch.tanh, [x], spec, compile="aot_eager", count_comms=False)


@pytest.mark.multirank(2)
def test_compile_option_is_validated(domain_mesh):
    spec = ShardSpec(domain_mesh, [Shard(1)], [9, 8])
    with pytest.raises(ValueError, match="compile must be"):
        check_conformance(torch.tanh, [torch.randn(2, 17)], spec, compile=3)
    with pytest.raises(ValueError, match="cannot be combined"):
        check_conformance(torch.tanh, [torch.randn(2, 17)], spec, compile=True, autocast=torch.bfloat16)


def test_comparisons_use_the_one_rule_near_zero_and_name_the_worst_element():
    from physicsnemo_shardext.testing.conformance import ConformanceReport, Mismatch, _compare, _merge

    report, mismatches = ConformanceReport(), []
    # A zero-initialised layer's gradient, 1e-8 off its exactly zero reference: within atol, no mismatch.
    _compare("gradient of parameter 'q'", torch.full((4, 4), 1e-8), torch.zeros(4, 4), 1e-4, 1e-5, mismatches,
             report.max_abs_errors, results=report.comparisons)
    assert not mismatches and report.max_abs_errors["gradient of parameter 'q'"] == pytest.approx(1e-8)
    assert report.comparisons["gradient of parameter 'q'"].max_rel_error < 1e-2
    wrong = torch.zeros(4, 4)
    wrong[3, 0] = 1.0
    _compare("output[0]", wrong, torch.zeros(4, 4), 1e-4, 1e-5, mismatches, report.max_abs_errors)
    (mismatch,) = _merge([mismatches, mismatches])  # the same on both ranks: one entry
    assert mismatch.ranks == (0, 1) and mismatch.comparison is not None
    text = mismatch.describe()
    assert text.startswith("output[0]: max abs error 1.000e+00, max rel error") and "worst at [3, 0]" in text
    assert "(1 of 16 elements outside); not within rtol=0.0001, atol=1e-05" in text
