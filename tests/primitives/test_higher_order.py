"""Tests of physicsnemo_shardext/primitives/higher_order.py (multi-rank uses: tests/patches/test_second_order.py)."""

from __future__ import annotations

import pytest
import torch

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.primitives import linear_backward, refuse_higher_order
from physicsnemo_shardext.primitives.higher_order import builds_graph, has_internal_overlap, materialized


class _Scatter(torch.autograd.Function):
    """A hand-written backward (scatter into 3 rows) made differentiable with linear_backward."""

    @staticmethod
    def forward(ctx, x):
        return x[torch.tensor([0, 2])]

    @staticmethod
    def backward(ctx, g):
        rows = torch.tensor([0, 2])
        return linear_backward(g, lambda t: torch.zeros(3, dtype=t.dtype).index_add(0, rows, t), lambda t: t[rows])


def test_linear_backward_keeps_every_order():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    for leaf, take in ((x, _Scatter.apply), (ref, lambda t: t[torch.tensor([0, 2])])):
        (g,) = torch.autograd.grad((take(leaf) ** 3).sum(), leaf, create_graph=True)
        (g * g).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)
    assert x.grad.abs().sum() > 0


def test_first_order_costs_nothing_extra():
    g = torch.ones(2)
    assert not builds_graph(g)
    out = linear_backward(g, lambda t: t * 2, lambda t: t * 2)
    assert out.grad_fn is None and torch.equal(out, torch.full((2,), 2.0))


def test_refusal_names_the_op_only_when_a_graph_is_built():
    refuse_higher_order("op", torch.ones(1), None)  # nothing in a graph
    with torch.no_grad():  # a first-order backward runs with grad mode off
        refuse_higher_order("op", torch.ones(1, requires_grad=True))
    with pytest.raises(MissingShardPatch, match="my_ring"):
        refuse_higher_order("my_ring", None, torch.ones(1, requires_grad=True))


def test_materialized_copies_only_overlapping_blocks():
    expanded = torch.ones(1, 3).expand(4, 3)
    assert has_internal_overlap(expanded) and not has_internal_overlap(materialized(expanded))
    assert not has_internal_overlap(torch.ones(1, 3).expand(1, 3))  # a single row shares nothing
    plain = torch.ones(2, 2)
    assert materialized(plain) is plain
