"""check_conformance: passes for PhysicsNeMo's conv, catches a wrong forward and an unreduced weight grad.

Its autocast=, compile= and plugin-attribution tests are in the mirror files of the modules
that do that work (test_autocast_tolerance.py, test_compile_check.py, test_attribution.py).
"""

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
    y = F.conv2d(
        _local(x),
        _local(a["weight"]),
        _local(a.get("bias")),
        a.get("stride", 1),
        a.get("padding", 0),
        a.get("dilation", 1),
        a.get("groups", 1),
    )
    shapes = {
        m: [tuple(s[:1]) + (y.shape[1],) + tuple(s[2:]) for s in shp] for m, shp in x._spec.sharding_shapes().items()
    }
    return ShardTensor.from_local(y, x.device_mesh, x.placements, sharding_shapes=shapes)


def _unreduced_weight_grad_conv2d(func, types, args, kwargs):
    """Correct forward, but the weight's gradient is only this rank's contribution."""
    from physicsnemo.domain_parallel import ShardTensor

    a = _conv_args(args, kwargs or {})
    x = a["input"]
    full = x.full_tensor()
    # to_local() of the Replicate weight: its backward labels the local grad Replicate, unreduced.
    y = F.conv2d(
        full,
        _local(a["weight"]),
        _local(a.get("bias")),
        a.get("stride", 1),
        a.get("padding", 0),
        a.get("dilation", 1),
        a.get("groups", 1),
    )
    shapes = x._spec.sharding_shapes()
    dim = x.placements[0].dim
    sizes = [s[dim] for s in shapes[0]]
    coord = x.device_mesh.get_local_rank(0)
    y_local = y.narrow(dim, sum(sizes[:coord]), sizes[coord])
    out_shapes = {0: [tuple(y.shape[:dim]) + (n,) + tuple(y.shape[dim + 1 :]) for n in sizes]}
    return ShardTensor.from_local(y_local, x.device_mesh, x.placements, sharding_shapes=out_shapes)


@pytest.mark.multirank(2)
def test_conv2d_uneven_split_conforms(domain_mesh):
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 17, 8)
    report = check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
    assert report.output_placements == [(Shard(2),)]
    assert set(report.max_abs_errors) == {
        "output[0]",
        "gradient of input[0]",
        "gradient of parameter 'weight'",
        "gradient of parameter 'bias'",
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
    check_conformance(conv, [torch.randn(1, 3, 17, 8)], ShardSpec(domain_mesh, [Shard(2)], [10, 7]), count_comms=False)


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
        check_conformance(
            _LocalSumTracker(), [x], ShardSpec(domain_mesh, [Shard(1)], [5, 4]), params="plain", count_comms=False
        )
    assert {m.what for m in info.value.mismatches} == {"buffer 'seen'"}
