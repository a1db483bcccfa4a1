"""Tests of the first-party figconvnet plugin (patches/figconvnet.py): a refusal instead of a segfault."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.figconvnet import SEARCHES, WARP_SEARCH
from physicsnemo_shardext.testing import shard_tensor


def test_the_searches_are_wrapped_once_figconvnet_is_imported():
    from physicsnemo.models.figconvnet import neighbor_ops, warp_neighbor_search

    for owner in (warp_neighbor_search, neighbor_ops):
        for name in SEARCHES:
            assert hasattr(getattr(owner, name), "__wrapped__"), f"{owner.__name__}.{name} is not wrapped"


def test_plain_points_reach_physicsnemo_search():
    from physicsnemo.models.figconvnet.neighbor_ops import neighbor_radius_search

    points = torch.rand(40, 3, generator=torch.Generator().manual_seed(0))
    found = neighbor_radius_search(points, points[:5], radius=0.3)
    # every query point is its own neighbour
    starts = found.neighbors_row_splits[:-1]
    assert all(
        int(i) in found.neighbors_index[s:e].tolist()
        for i, (s, e) in enumerate(zip(starts, found.neighbors_row_splits[1:]))
    )


@pytest.mark.multirank(2)
def test_sharded_points_are_refused_by_name(domain_mesh):
    from physicsnemo.models.figconvnet.neighbor_ops import neighbor_radius_search

    points = shard_tensor(
        torch.rand(10, 3, generator=torch.Generator().manual_seed(0)), domain_mesh, [Shard(0)], [7, 3]
    )
    with pytest.raises(MissingShardPatch, match=f"{WARP_SEARCH}.radius_search_warp".replace(".", r"\.")):
        neighbor_radius_search(points, points, radius=0.3)
