"""eager_handler: first-party handlers are traced into the compiled graph, or break it cleanly.

Since issue 33 a handler runs under the trace with functional collectives; what cannot
be traced (an in-place c10d collective, an in-place update, a hand-over to
PhysicsNeMo's handlers, a failure on fake operands) is a graph break naming the op.
Regressions of issue 11 (the eager-only policy, still ``handlers_traced(False)``): compiled, ``F.group_norm`` on a ShardTensor silently used
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

from physicsnemo_shardext.primitives import eager_handler, handlers_traced, is_tracing
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
    with handlers_traced(False), pytest.raises(Unsupported, match="torch.add"):
        handler(torch.add, (), (fake, 1), {})
    assert ran == []
    assert handler(torch.add, (), (torch.ones(1), 1), {}) == 1 and ran == [torch.add]
    with handlers_traced(True):
        assert handler(torch.add, (), (fake, 1), {}) == 1 and ran == [torch.add, torch.add]


@pytest.mark.multirank(2)
def test_a_traced_handler_that_cannot_be_traced_breaks_the_graph_by_name(domain_mesh):
    @eager_handler
    def in_place_collective(func, types, args, kwargs):
        torch.distributed.all_reduce(args[0])  # in place: a trace would not capture it
        return args[0]

    @eager_handler
    def reads_values(func, types, args, kwargs):
        return torch.ones(int(args[0].sum().item()))

    with FakeTensorMode():
        fake = torch.ones(3)
    with handlers_traced(True), pytest.raises(Unsupported, match="torch.sub"):
        reads_values(torch.sub, (), (fake,), {})
    with handlers_traced(True), pytest.raises(Unsupported, match="(?s)torch.mul.*c10d"):
        in_place_collective(torch.mul, (), (fake,), {})
    with handlers_traced(True), pytest.raises(Unsupported, match="In-place updates"):
        reads_values(torch.Tensor.add_, (), (fake,), {})


@pytest.mark.multirank(2)
@pytest.mark.parametrize("op", sorted(OPS))
def test_compiled_op_equals_eager(domain_mesh, op):
    fn = OPS[op]
    full = torch.randn(1, 4, 16, 12)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [10, 6], requires_grad=True)
    expected = fn(full)
    eager = fn(x)
    with handlers_traced(True):
        compiled = torch.compile(fn, backend="aot_eager", dynamic=False)(x)
    # Traced handlers: the same kernels, but a traced graph may round a sum differently (2e-7 seen).
    torch.testing.assert_close(compiled.full_tensor(), eager.full_tensor(), rtol=1e-6, atol=1e-6)
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
    with handlers_traced(False), pytest.raises(Unsupported, match="ShardTensor handler runs eagerly"):
        torch.compile(OPS["group_norm"], backend="aot_eager", dynamic=False, fullgraph=True)(x)


@pytest.mark.multirank(2)
def test_fullgraph_compiles_a_traced_handler_with_its_collectives(domain_mesh):
    full = torch.randn(1, 4, 16, 12)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [10, 6])
    with handlers_traced(True):
        compiled = torch.compile(OPS["group_norm"], backend="aot_eager", dynamic=False, fullgraph=True)(x)
    # Statistics over both ranks' rows: the all-reduce is in the graph (local ones would differ by O(1)).
    torch.testing.assert_close(compiled.full_tensor(), OPS["group_norm"](full), rtol=1e-5, atol=1e-5)
