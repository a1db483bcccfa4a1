"""Tests of the halo-strip convolution (physicsnemo_shardext/primitives/conv_strips.py), one process standing in for every rank.

Each coordinate's output rows come from its block and its halo rows only, as on a
rank; the pieces, concatenated, must be the whole convolution, with the same
input, weight and bias gradients at first and second order.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_shardext.patches.convolution import conv_row_plan
from physicsnemo_shardext.primitives import conv_strip_geometry, strip_conv


def _random_split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _pieced(full, weight, bias, sizes, k, s, d, p, n_out):
    """Every coordinate's rows: the strip path where its geometry exists, the plain conv's rows elsewhere."""
    plan = conv_row_plan(sizes, k, s, d, p, n_out)
    pieces, used = [], 0
    for c in range(len(sizes)):
        g = conv_strip_geometry(sizes, c, plan.out_starts, k, s, d, p)
        b0 = sum(sizes[:c])
        o0, o1 = plan.out_starts[c], plan.out_starts[c + 1]
        if g is None:
            pieces.append(F.conv1d(full, weight, bias, s, p, d)[..., o0:o1])
            continue
        used += 1
        halo = full[..., list(g.halo_rows)]
        pieces.append(
            strip_conv(F.conv1d, full[..., b0 : b0 + sizes[c]], halo, weight, bias, g, 2, (s,), (p,), (d,), 1)
        )
    return torch.cat(pieces, -1), used


def test_strips_reassemble_the_whole_convolution_with_its_gradients():
    rng = random.Random(0)
    checked = strips = 0
    while checked < 200:
        total, k, s = rng.randint(1, 16), rng.randint(1, 5), rng.randint(1, 3)
        d, p = rng.randint(1, 2), rng.randint(0, 3)
        sizes = _random_split(rng, total, rng.randint(1, 4))  # empty and tiny shards included
        full = torch.randn(2, 3, total, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(2, 3, k, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(2, dtype=torch.float64, requires_grad=True)
        try:
            ref = F.conv1d(full, weight, bias, s, p, d)
        except RuntimeError:
            continue  # invalid for torch too
        got, used = _pieced(full, weight, bias, sizes, k, s, d, p, ref.shape[-1])
        label = f"{sizes=} {k=} {s=} {d=} {p=}"
        torch.testing.assert_close(got, ref, msg=label)
        cotangent = torch.randn_like(ref)
        expected = torch.autograd.grad(ref, (full, weight, bias), cotangent)
        actual = torch.autograd.grad(got, (full, weight, bias), cotangent)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, msg=label)
        checked += 1
        strips += used
    assert strips > 200, "the strip path ran for too few coordinates to test it"


@pytest.mark.parametrize(
    ("sizes", "k", "s", "d", "p"),
    [((5, 3), 3, 1, 1, 1), ((4, 5), 3, 2, 1, 1), ((6, 2, 5), 4, 2, 1, 1), ((7, 6), 3, 1, 2, 2)],
    ids=["same", "k3s2p1", "k4s2p1-3-ranks", "dilated"],
)
def test_second_order_gradients_match(sizes, k, s, d, p):
    total = sum(sizes)
    n_out = F.conv1d(torch.zeros(1, 1, total), torch.zeros(1, 1, k), None, s, p, d).shape[-1]

    def pieced(full, weight, bias):
        return _pieced(full, weight, bias, list(sizes), k, s, d, p, n_out)[0]

    full = torch.randn(1, 2, total, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 2, k, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(pieced, (full, weight, bias))


def test_the_strip_path_saves_no_copy_of_the_block():
    # Saved for backward: the block itself (no new storage) and the halo rows (a few rows).
    block = torch.randn(1, 4, 64, 8, requires_grad=True)
    full_rows = torch.randn(1, 4, 2, 8)
    weight = torch.randn(4, 4, 3, 3, requires_grad=True)
    sizes = (64, 64, 64)
    plan = conv_row_plan(sizes, 3, 1, 1, 1, 192)
    g = conv_strip_geometry(sizes, 1, plan.out_starts, 3, 1, 1, 1)
    assert g is not None and g.halo_rows == (63, 128)
    new_bytes = []

    def pack(t):
        if t.untyped_storage().data_ptr() != block.untyped_storage().data_ptr():
            new_bytes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = strip_conv(F.conv2d, block, full_rows, weight, None, g, 2, (1, 1), (1, 1), (1, 1), 1)
    assert out.shape == (1, 4, 64, 8)
    weight_bytes = weight.numel() * weight.element_size()
    assert sum(new_bytes) <= weight_bytes + full_rows.numel() * full_rows.element_size(), new_bytes
