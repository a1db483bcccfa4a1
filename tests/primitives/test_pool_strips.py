"""Tests of the halo-strip max and average pools (physicsnemo_shardext/primitives/pool_strips.py), one process standing in for every rank.

Each coordinate's output rows come from its block and its halo rows only, as on a
rank; the pieces, concatenated, must be the whole pool, with the same input
gradient at first and second order.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_shardext.patches.pooling import _pool_ranges
from physicsnemo_shardext.primitives import pool_strip_geometry, strip_avg_pool, strip_max_pool


def _random_split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


#: (whole pool, strip pool) per kind; the average's options are those whose divisors differ near the padding.
KINDS = {
    "max": (F.max_pool2d, strip_max_pool),
    "avg": (F.avg_pool2d, strip_avg_pool),
    "avg-exclude-pad": (
        functools.partial(F.avg_pool2d, count_include_pad=False),
        functools.partial(strip_avg_pool, count_include_pad=False),
    ),
    "avg-divisor-2": (
        functools.partial(F.avg_pool2d, divisor_override=2),
        functools.partial(strip_avg_pool, divisor_override=2),
    ),
}


def _pieced(kind, full, sizes, k, s, p, n_out):
    """Every coordinate's rows: the strip path where its geometry exists, the plain pool's rows elsewhere."""
    whole, strip = KINDS[kind]
    ranges = _pool_ranges(tuple(sizes), n_out, k, s, p, 1)
    pieces, used = [], 0
    for c, (o0, o1) in enumerate(ranges):
        g = pool_strip_geometry(sizes, c, (o0, o1), k, s, p)
        if g is None:
            pieces.append(whole(full, k, s, p)[:, :, o0:o1])
            continue
        used += 1
        b0 = sum(sizes[:c])
        halo = full[:, :, list(g.halo_rows)]
        pieces.append(strip(full[:, :, b0 : b0 + sizes[c]], halo, g, 2, (k, k), (s, s), (p, p)))
    return torch.cat(pieces, 2), used


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_strips_reassemble_the_whole_pool_with_its_gradient(kind):
    whole = KINDS[kind][0]
    rng = random.Random(1)
    checked = strips = 0
    while checked < 200:
        total, k, s = rng.randint(1, 16), rng.randint(1, 5), rng.randint(1, 3)
        p = rng.randint(0, k // 2)
        sizes = _random_split(rng, total, rng.randint(1, 4))
        # Width 6 with padding on it too: the divisors vary along both dims.
        full = torch.randn(2, 3, total, 6, dtype=torch.float64, requires_grad=True)
        try:
            ref = whole(full, k, s, p)
        except RuntimeError:
            continue
        got, used = _pieced(kind, full, sizes, k, s, p, ref.shape[2])
        label = f"{kind} {sizes=} {k=} {s=} {p=}"
        torch.testing.assert_close(got, ref, msg=label)
        cotangent = torch.randn_like(ref)
        (expected,) = torch.autograd.grad(ref, full, cotangent)
        (actual,) = torch.autograd.grad(got, full, cotangent)
        torch.testing.assert_close(actual, expected, msg=label)
        checked += 1
        strips += used
    assert strips > 150, "the strip path ran for too few coordinates to test it"


@pytest.mark.parametrize("kind", ["max", "avg-exclude-pad"])
def test_second_order_gradient_matches(kind):
    sizes, k, s, p = (6, 5), 3, 2, 1
    n_out = F.max_pool2d(torch.zeros(1, 1, 11, 4), k, s, p).shape[2]
    full = torch.randn(1, 2, 11, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: _pieced(kind, t, list(sizes), k, s, p, n_out)[0], (full,))


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_the_strip_path_saves_no_copy_of_the_block(kind):
    # Saved for backward: the block itself (no new storage), the halo rows and a max pool's indices.
    block = torch.randn(1, 4, 64, 8, requires_grad=True)
    full_rows = torch.randn(1, 4, 2, 8)
    sizes = (64, 64, 64)
    g = pool_strip_geometry(sizes, 1, (64, 128), kernel=3, stride=1, padding=1)
    assert g is not None and g.halo_rows == (63, 128)
    new_bytes = []

    def pack(t):
        if t.untyped_storage().data_ptr() != block.untyped_storage().data_ptr():
            new_bytes.append(t.numel() * t.element_size() if t.is_floating_point() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = KINDS[kind][1](block, full_rows, g, 2, (3, 3), (1, 1), (1, 1))
    assert out.shape == (1, 4, 64, 8)
    assert sum(new_bytes) <= full_rows.numel() * full_rows.element_size(), new_bytes
