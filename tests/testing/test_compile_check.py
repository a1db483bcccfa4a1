"""compile= of check_conformance (testing/compile_check.py): compiled steps against the same steps eagerly.

Moved from test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing import ConformanceError, ShardSpec, check_conformance
from physicsnemo_shardext.testing.compile_check import COMPILE_STEPS, _resolve_compile


def test_option_names_a_backend():
    assert COMPILE_STEPS == 2
    assert [_resolve_compile(o) for o in (False, None, True, "aot_eager")] == [None, None, "inductor", "aot_eager"]
    with pytest.raises(ValueError, match="compile must be"):
        _resolve_compile("")


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
    report = check_conformance(
        _PadNormConv(),
        [x],
        ShardSpec(domain_mesh, [Shard(2)], [7, 4]),
        params=params,
        compile="aot_eager",
        count_comms=False,
    )
    compiled = {k: v for k, v in report.max_abs_errors.items() if k.startswith("compiled (aot_eager)")}
    names = ["output[0]", "gradient of input[0]"] + [
        f"gradient of parameter {n!r}" for n in ("norm.weight", "norm.bias", "conv.weight", "conv.bias")
    ]
    assert set(compiled) == {f"compiled (aot_eager) step {k}: {n}" for k in range(2) for n in names}
    assert max(compiled.values()) == 0.0  # the sharded ops run eagerly behind graph breaks: same numbers


def _traced_differently_tanh(func, types, args, kwargs):
    """A handler that is right eagerly but wrong when traced (as an untraceable collective would be)."""
    from physicsnemo.domain_parallel import ShardTensor

    from physicsnemo_shardext.primitives import from_local_like, is_tracing

    x = args[0]
    local = torch.tanh(x.to_local())
    return (
        from_local_like(local * 2 if is_tracing(args, kwargs) else local, x)
        if isinstance(x, ShardTensor)
        else torch.tanh(x)
    )


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
