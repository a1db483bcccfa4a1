"""A deliberately wrong plugin: its ``F.gelu`` handler doubles the result (``shardext verify`` must exit 1)."""

from __future__ import annotations

import torch.nn.functional as F

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.primitives import from_local_like, require_shard_input


def doubled_gelu(func, types, args, kwargs):  # type: ignore[no-untyped-def]
    """Wrong on purpose: twice GELU of the local block."""
    x = require_shard_input(func, args[0])
    return from_local_like(2 * F.gelu(x.to_local()), x)


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Claim F.gelu above the first-party pointwise handler."""
    patches.function(F.gelu, doubled_gelu, priority=10, override=True)
