"""Tests of the halo-strip max pool (physicsnemo_shardext/primitives/pool_strips.py), one process standing in for every rank.

Each coordinate's output rows come from its block and its halo rows only, as on a
rank; the pieces, concatenated, must be the whole max pool, with the same input
gradient at first and second order.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from physicsnemo_shardext.patches.pooling import _pool_ranges
from physicsnemo_shardext.primitives import pool_strip_geometry, strip_max_pool


def _random_split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _pieced(full, sizes, k, s, p, n_out):
    """Every coordinate's rows: the strip path where its geometry exists, the plain pool's rows elsewhere."""
    ranges = _pool_ranges(tuple(sizes), n_out, k, s, p, 1)
    pieces, used = [], 0
    for c, (o0, o1) in enumerate(ranges):
        g = pool_strip_geometry(sizes, c, (o0, o1), k, s, p)
        if g is None:
            pieces.append(F.max_pool2d(full, k, s, p)[:, :, o0:o1])
            continue
        used += 1
        b0 = sum(sizes[:c])
        halo = full[:, :, list(g.halo_rows)]
        pieces.append(strip_max_pool(full[:, :, b0 : b0 + sizes[c]], halo, g, 2, (k, k), (s, s), (p, p)))
    return torch.cat(pieces, 2), used


def test_strips_reassemble_the_whole_max_pool_with_its_gradient():
    rng = random.Random(1)
    checked = strips = 0
    while checked < 200:
        total, k, s = rng.randint(1, 16), rng.randint(1, 5), rng.randint(1, 3)
        p = rng.randint(0, k // 2)
        sizes = _random_split(rng, total, rng.randint(1, 4))
        full = torch.randn(2, 3, total, 5, dtype=torch.float64, requires_grad=True)
        try:
            ref = F.max_pool2d(full, k, s, p)
        except RuntimeError:
            continue
        got, used = _pieced(full, sizes, k, s, p, ref.shape[2])
        label = f"{sizes=} {k=} {s=} {p=}"
        torch.testing.assert_close(got, ref, msg=label)
        cotangent = torch.randn_like(ref)
        (expected,) = torch.autograd.grad(ref, full, cotangent)
        (actual,) = torch.autograd.grad(got, full, cotangent)
        torch.testing.assert_close(actual, expected, msg=label)
        checked += 1
        strips += used
    assert strips > 150, "the strip path ran for too few coordinates to test it"


def test_second_order_gradient_matches():
    sizes, k, s, p = (6, 5), 3, 2, 1
    n_out = F.max_pool2d(torch.zeros(1, 1, 11, 4), k, s, p).shape[2]
    full = torch.randn(1, 2, 11, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: _pieced(t, list(sizes), k, s, p, n_out)[0], (full,))
