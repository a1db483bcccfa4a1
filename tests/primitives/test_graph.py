"""Tests of physicsnemo_shardext/primitives/graph.py: zero-valued ties that keep a rank in the backward."""

from __future__ import annotations

import pytest
import torch

from physicsnemo_shardext.primitives import connected_zeros, tie_to_graph


def test_tie_keeps_values_and_gives_every_source_a_zero_gradient():
    out = torch.arange(4.0, requires_grad=True)
    weight = torch.randn(3, 2, requires_grad=True)
    bias = torch.randn(3, requires_grad=True)
    tied = tie_to_graph(out * 2, weight, None, bias)
    torch.testing.assert_close(tied, out.detach() * 2, rtol=0, atol=0)
    tied.sum().backward()
    torch.testing.assert_close(out.grad, torch.full((4,), 2.0))
    torch.testing.assert_close(weight.grad, torch.zeros(3, 2), rtol=0, atol=0)
    torch.testing.assert_close(bias.grad, torch.zeros(3), rtol=0, atol=0)


def test_tie_makes_a_constant_output_require_grad():
    source = torch.ones(2, requires_grad=True)
    tied = tie_to_graph(torch.zeros(5), source)
    assert tied.requires_grad and tied.grad_fn is not None
    tied.sum().backward()
    torch.testing.assert_close(source.grad, torch.zeros(2), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_tie_does_not_propagate_inf_or_nan(bad):
    source = torch.tensor([bad, 1.0, bad], requires_grad=True)
    out = tie_to_graph(torch.arange(3.0), source)
    torch.testing.assert_close(out, torch.arange(3.0), rtol=0, atol=0)  # no value read from source
    out.sum().backward()
    assert torch.equal(source.grad, torch.zeros(3))  # finite zeros, not nan


def test_tie_accepts_empty_and_scalar_sources_and_no_sources():
    empty = torch.zeros(0, 3, requires_grad=True)
    scalar = torch.tensor(2.0, requires_grad=True)
    out = tie_to_graph(torch.ones(2), empty, scalar)
    out.sum().backward()
    assert empty.grad.shape == (0, 3) and scalar.grad == 0
    plain = torch.ones(2)
    assert tie_to_graph(plain) is plain and tie_to_graph(plain, None) is plain


@pytest.mark.parametrize("shape", [(0, 3), (2, 0, 4), (3,), ()], ids=["empty-rows", "empty-middle", "1d", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_connected_zeros_shape_dtype_and_graph(shape, dtype):
    source = torch.randn(4, 2, dtype=dtype, requires_grad=True)
    zeros = connected_zeros(source, shape)
    assert zeros.shape == torch.Size(shape) and zeros.dtype == dtype and zeros.device == source.device
    assert not zeros.any() and zeros.requires_grad
    loss = zeros.real.sum() if dtype.is_complex else zeros.sum()
    loss.backward()
    assert source.grad is not None and not source.grad.any()


def test_connected_zeros_takes_a_torch_size_and_a_list():
    source = torch.ones(3, requires_grad=True)
    assert connected_zeros(source, torch.Size([2, 1])).shape == (2, 1)
    assert connected_zeros(source, [0, 5]).shape == (0, 5)
