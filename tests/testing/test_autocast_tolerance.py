"""autocast= of check_conformance (testing/autocast_tolerance.py): tolerances from the reference's own autocast error.

Moved from test_conformance.py; the tolerance rule itself is tested on plain tensors first.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing import ConformanceError, ShardSpec, check_conformance
from physicsnemo_shardext.testing.autocast_tolerance import (
    AUTOCAST_ERROR_FACTOR,
    _AutocastTolerance,
    _resolve_autocast,
)
from physicsnemo_shardext.testing.conformance_report import ConformanceReport


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def test_option_reads_a_dtype_or_a_device_type_and_dtype_pair():
    cpu = SimpleNamespace(device_type="cpu")
    assert _resolve_autocast(None, cpu) is None
    assert _resolve_autocast(torch.float16, cpu) == ("cpu", torch.float16)
    assert _resolve_autocast(("cpu", torch.bfloat16), cpu) == ("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="floating-point"):
        _resolve_autocast(torch.int8, cpu)


def test_tolerance_follows_the_reference_error_with_an_eps_floor():
    full = torch.tensor([1.0, 2.0, 3.0])
    report, mismatches = ConformanceReport(), []
    tolerance = _AutocastTolerance(("cpu", torch.bfloat16), AUTOCAST_ERROR_FACTOR, {"output[0]": full}, report)
    # untouched by autocast: the plain atol
    tolerance.compare("output[0]", full, full, 1e-4, 1e-5, mismatches, {})
    assert report.autocast_reference_errors["output[0]"] == 0.0 and report.autocast_atols["output[0]"] == 1e-5
    # a tiny error: the floor of one bf16 rounding unit of the largest value
    reference = full + torch.tensor([0.0, 0.0, 1e-4])
    tolerance.compare("output[0]", reference, reference, 1e-4, 1e-5, mismatches, {})
    unit = torch.finfo(torch.bfloat16).eps * reference.max().item()
    assert report.autocast_atols["output[0]"] == pytest.approx(AUTOCAST_ERROR_FACTOR * unit)
    assert not mismatches


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
