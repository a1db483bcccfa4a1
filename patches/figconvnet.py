"""FIGConvNet's warp radius search refuses ShardTensors by name instead of crashing the process.

``physicsnemo.models.figconvnet`` finds each point's neighbours with its own warp
kernels (``warp_neighbor_search.radius_search_warp`` and its batched form):
``wp.from_torch`` reads the points' memory directly and ``wp.HashGrid.build``
indexes it. That is not a torch op, so no shard patch ever sees it, and on a
ShardTensor (a wrapper whose storage is not the local block) both ranks died with
a segmentation fault: no error, no report, the job gone. A neighbour search over
a point cloud split across ranks would also need every rank's points near its
border, which this search cannot ask for.

This plugin wraps both searches: plain tensors reach PhysicsNeMo's search
unchanged; a ShardTensor or DTensor argument raises ``MissingShardPatch`` naming
the search. It waits for the module's import (``shardext_import_after``), so
``import physicsnemo_shardext`` does not import warp or FIGConvNet, and it also
rebinds the names ``neighbor_ops`` imported if that module came first.

Refused (``MissingShardPatch``): FIGConvNet's radius search (``radius_search_warp``,
``batched_radius_search_warp``) on ShardTensor or DTensor points. Run FIGConvNet on
plain tensors (data parallel); its grids are not split here.

Examples:
    >>> import torch
    >>> def search(points, queries, radius):
    ...     return points.shape[0]
    >>> guarded = refusing_distributed(search, "warp_neighbor_search.radius_search_warp")
    >>> guarded(torch.zeros(5, 3), torch.zeros(2, 3), 0.1)
    5
    >>> guarded.__wrapped__ is search
    True
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy

__all__ = ["NEIGHBOR_OPS", "SEARCHES", "WARP_SEARCH", "refusing_distributed"]

WARP_SEARCH = "physicsnemo.models.figconvnet.warp_neighbor_search"
"""The module holding the warp searches; the plugin loads once a program imports it."""

NEIGHBOR_OPS = "physicsnemo.models.figconvnet.neighbor_ops"
"""The module that imports the searches by name (its bindings are rebound if it was imported first)."""

SEARCHES = ("radius_search_warp", "batched_radius_search_warp")


def refusing_distributed(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``original``, refusing ShardTensor/DTensor arguments with ``MissingShardPatch`` naming ``name``.

    Examples:
        >>> import torch
        >>> guarded = refusing_distributed(lambda points: points.sum(), "search")
        >>> float(guarded(torch.ones(3)))
        3.0
    """

    @functools.wraps(original)
    def search(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(leaf, (ShardTensor, DTensor)) for leaf in tree_leaves((args, kwargs))):
            raise MissingShardPatch(
                f"{name}: FIGConvNet's warp neighbour search reads the points' memory directly (wp.from_torch), "
                "which a ShardTensor does not hold, and cannot see other ranks' points; run FIGConvNet on plain "
                "tensors (this search crashed the process before)"
            )
        return original(*args, **kwargs)

    return search


@hookimpl
def shardext_import_after() -> list[str]:
    """Load once FIGConvNet's warp search module is imported (before ``neighbor_ops`` binds its names).

    Examples:
        >>> shardext_import_after()
        ['physicsnemo.models.figconvnet.warp_neighbor_search']
    """
    return [WARP_SEARCH]


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Wrap the two searches in their module and, if already imported, where ``neighbor_ops`` bound them."""
    module = importlib.import_module(WARP_SEARCH)  # imported already: see shardext_import_after
    owners = [module] + ([sys.modules[NEIGHBOR_OPS]] if NEIGHBOR_OPS in sys.modules else [])
    for owner in owners:
        for attribute in SEARCHES:
            original = getattr(owner, attribute, None)
            if original is None:
                continue
            patches.replace_attribute(
                owner,
                attribute,
                refusing_distributed(original, f"{WARP_SEARCH}.{attribute}"),
                reason="FIGConvNet's warp radius search segfaults on a ShardTensor (wp.from_torch): refuse it by name",
            )
