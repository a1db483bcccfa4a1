"""Building blocks for shard patches: layouts of uneven shards and row exchanges between ranks.

Example::

    from physicsnemo_shardext.primitives import dim_layout, gather_global_indices, halo_indices

    layout = dim_layout(x, 2)
    padded = gather_global_indices(x.to_local(), layout, lambda c: halo_indices(layout, c, 1, 1))
"""

from physicsnemo_shardext.primitives.checks import normalize_dim, require_shard_input
from physicsnemo_shardext.primitives.delegation import delegate, fallback
from physicsnemo_shardext.primitives.index_exchange import (
    ExchangePlan,
    gather_global_indices,
    halo_indices,
    plan_exchange,
)
from physicsnemo_shardext.primitives.layout import (
    DimLayout,
    build_shard_tensor,
    dim_layout,
    from_local_like,
    sharded_dims,
)

__all__ = [
    "DimLayout",
    "ExchangePlan",
    "build_shard_tensor",
    "delegate",
    "dim_layout",
    "fallback",
    "from_local_like",
    "gather_global_indices",
    "halo_indices",
    "normalize_dim",
    "plan_exchange",
    "require_shard_input",
    "sharded_dims",
]
