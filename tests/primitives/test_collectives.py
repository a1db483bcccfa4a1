"""Tests of physicsnemo_shardext/primitives/collectives.py: the three collectives, eager and traced.

That a backward's exchange stays in the backward graph on every rank (`_kept_in_backward`) is
tested where it arose, on a model: Pix2Pix in tests/models/test_compile_models.py hung on 2 ranks
without it (one rank's receive-only halo return moved into the forward graph).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from physicsnemo_shardext.primitives.collectives import gather_blocks, reduce_copy, start_all_to_all

#: Rows each rank sends to each rank (sender -> [to rank 0, to rank 1]): uneven, one pair empty.
SPLITS = {0: [2, 0], 1: [3, 1]}


def _exchange(send: torch.Tensor, rank: int, group) -> torch.Tensor:
    out_splits = [SPLITS[0][rank], SPLITS[1][rank]]
    return start_all_to_all(send, out_splits, SPLITS[rank], group)()


def _all_three(x: torch.Tensor, rank: int, group) -> tuple[torch.Tensor, ...]:
    exchanged = _exchange(x[: sum(SPLITS[rank])] * 2, rank, group)
    summed = reduce_copy(x, "sum", group)
    largest = reduce_copy(x, "max", group)
    gathered = torch.stack(gather_blocks(x + 1, 2, group))
    return exchanged, summed, largest, gathered


@pytest.mark.multirank(2)
def test_eager_collectives_give_every_rank_its_part(domain_mesh, rank):
    group = domain_mesh.get_group(0)
    x = torch.arange(4.0 * 3).reshape(4, 3) + 100 * rank
    exchanged, summed, largest, gathered = _all_three(x, rank, group)
    sent = {r: (torch.arange(4.0 * 3).reshape(4, 3) + 100 * r)[: sum(SPLITS[r])] * 2 for r in (0, 1)}
    # Rank r receives SPLITS[s][r] rows from each sender s, in sender order.
    expected = torch.cat([sent[s][sum(SPLITS[s][:rank]) : sum(SPLITS[s][: rank + 1])] for s in (0, 1)])
    assert torch.equal(exchanged, expected)
    both = [torch.arange(4.0 * 3).reshape(4, 3) + 100 * r for r in (0, 1)]
    assert torch.equal(summed, both[0] + both[1])
    assert torch.equal(largest, torch.maximum(both[0], both[1]))
    assert torch.equal(gathered, torch.stack([both[0] + 1, both[1] + 1]))


@pytest.mark.multirank(2)
def test_traced_collectives_compile_into_one_graph_and_match_eager(domain_mesh, rank):
    group = domain_mesh.get_group(0)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    torch._dynamo.reset()
    counters["graph_break"].clear()
    compiled = torch.compile(lambda t: _all_three(t, rank, group), backend="aot_eager", fullgraph=True)(x)
    eager = _all_three(x, rank, group)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    assert not counters["graph_break"]
    torch._dynamo.reset()
