"""eager_handler: first-party handlers run eagerly behind a clean graph break under torch.compile.

Regressions of issue 11: compiled, ``F.group_norm`` on a ShardTensor silently used
local statistics only (its all-reduce was traced on fake tensors), and ``F.pad`` /
``interpolate`` / ``rfft2`` crashed with ``InternalTorchDynamoError ...
method_setattr_standard()`` once Dynamo tried to compile
``ShardTensor.__torch_function__`` as a frame of its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import Unsupported
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard

from physicsnemo_shardext.primitives import eager_handler, is_tracing
from physicsnemo_shardext.testing import shard_tensor

OPS = {
    "group_norm": lambda x: F.group_norm(x, 2),
    "pad": lambda x: F.pad(x, (1, 1, 1, 1)),
    "interpolate": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    "rfft2": lambda x: torch.fft.irfft2(torch.fft.rfft2(x), s=x.shape[-2:]),
    # delegate_when_traced: traced through PhysicsNeMo's path, not a graph break
    "contiguous": lambda x: (x.transpose(2, 3).contiguous() * 2.0).transpose(2, 3),
    "clone": lambda x: x.clone() * 3.0,
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_refuses_fake_operands_before_running_the_handler():
    ran = []

    @eager_handler
    def handler(func, types, args, kwargs):
        ran.append(func)
        return 1

    assert eager_handler(handler) is handler  # wrapping twice is a no-op
    with FakeTensorMode():
        fake = torch.ones(3)
    assert is_tracing(((fake,),), {}) and not is_tracing((torch.ones(3),), {"x": [1]})
    # Fakes are found as keyword values and inside containers; scalars and None are skipped.
    assert is_tracing((torch.ones(1), None, 2.0), {"weight": fake})
    assert is_tracing((torch.ones(1),), {"pair": {"a": [torch.ones(1), fake]}})
    assert not is_tracing((torch.ones(1), None, "same"), None)
    with pytest.raises(Unsupported, match="torch.add"):
        handler(torch.add, (), (fake, 1), {})
    assert ran == []
    assert handler(torch.add, (), (torch.ones(1), 1), {}) == 1 and ran == [torch.add]


@pytest.mark.multirank(2)
@pytest.mark.parametrize("op", sorted(OPS))
def test_compiled_op_equals_eager(domain_mesh, op):
    fn = OPS[op]
    full = torch.randn(1, 4, 16, 12)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [10, 6], requires_grad=True)
    expected = fn(full)
    eager = fn(x)
    compiled = torch.compile(fn, backend="aot_eager", dynamic=False)(x)
    torch.testing.assert_close(compiled.full_tensor(), eager.full_tensor(), rtol=0, atol=0)
    torch.testing.assert_close(compiled.full_tensor(), expected, rtol=1e-5, atol=1e-5)
    # the same split as eager (a traced layout op must not re-cut the rows like torch.chunk)
    assert compiled._spec.sharding_shapes() == eager._spec.sharding_shapes()
    cotangent = torch.randn(compiled.shape)
    out_split = [shape[2] for shape in compiled._spec.sharding_shapes()[0]]
    (grad,) = torch.autograd.grad(compiled, x, shard_tensor(cotangent, domain_mesh, [Shard(2)], out_split))
    (expected_grad,) = torch.autograd.grad(fn(full.requires_grad_()), full, cotangent)
    torch.testing.assert_close(grad.full_tensor(), expected_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.multirank(2)
def test_fullgraph_names_the_op_instead_of_tracing_it(domain_mesh):
    x = shard_tensor(torch.randn(1, 4, 16, 12), domain_mesh, [Shard(2)], [10, 6])
    with pytest.raises(Unsupported, match="ShardTensor handler runs eagerly"):
        torch.compile(OPS["group_norm"], backend="aot_eager", dynamic=False, fullgraph=True)(x)
