"""The handler vocabulary: every first-party patch is written with these names, and yours can be too.

A shard handler takes five steps, and each has its primitive here (patches import
only from ``physicsnemo_shardext`` and ``physicsnemo_shardext.primitives``):

1. **bind** the call against the reference callable: `bind_arguments`,
   `expand_to` (scalar-or-tuple arguments);
2. **gate** what the handler does not take: `require_shard_input`,
   `is_partial`, `normalize_dim`; hand the rest to what was replaced
   with `delegate` (or call the DTensor path directly with `fallback`);
3. **plan** without communication (the spec read through `mesh_of`, `placements_of`,
   `shard_shapes_of`, `tensor_meta_of`; a spec handed to or from DTensor through `spec_of`,
   `spec_shard_shapes`, `spec_with_placements`): `sharded_dims`, `dim_layout`, `meta_output_shape`,
   `DimLayout`, `sharding_mesh_dims`, `plan_exchange`,
   `halo_indices`, `split_rows_by_owner`, `balanced_split_sizes`;
4. **exchange** rows and sums: `gather_global_indices`, `move_shard`,
   `transpose_shard`, `resplit_rows` / `align_shard` (boundaries to multiples
   of ``k``, sizes from `aligned_split_sizes`), `gather_full` (`all_gather_rows` for a
   plain block and its per-rank sizes), `ring_shift` (one step of a ring: a flat buffer
   to the next coordinate, from the previous; `pack_bytes` / `unpack_bytes` /
   `packed_nbytes` lay several tensors out in it), and the three gradient contracts
   `sum_grad_over`, `all_reduce_sum`, `sum_to_replicated` (and `summed_over`,
   the bare sum, inside a hand-written backward; `linear_backward` keeps such a
   backward differentiable under ``create_graph=True``, `refuse_higher_order`
   refuses by name where it cannot be; `builds_graph` tells a second-order
   backward apart); `max_over` / `min_over`, the elementwise maximum / minimum
   over ranks (no gradient: a softmax's shift, a max pool's winner);
   replicated operands through `replicated_local` / `replicated_part`
   (`is_replicated` tells them apart; `elementwise_with_replicated` applies a
   binary op to a shard and a replicated operand);
5. **compute locally and wrap**: `local_of` (``to_local`` with less host time),
   `from_local_like`, `build_shard_tensor`, `wrap_local` (`wrap_gradient` inside a backward,
   `materialized` / `has_internal_overlap` for an expanded gradient block),
   with `tie_to_graph` / `connected_zeros` keeping an empty shard in
   the backward graph, and `sharded_allocations` for factory calls.

Under ``torch.compile`` a handler runs eagerly behind a graph break:
`eager_handler` wraps it so that, called on fake operands (`is_tracing`), it
refuses to be traced (`refuse_tracing`) instead of tracing its collectives
wrongly. `output_dtype_under_autocast` gives a composed op the dtype autocast gives
the op it replaces. `profiled_range` names a step in a profiler trace at no cost otherwise.

Examples:
    >>> from physicsnemo_shardext.primitives import DimLayout, halo_indices
    >>> layout = DimLayout(tensor_dim=2, mesh_dim=0, sizes=(10, 7), coord=1, mesh=None)
    >>> list(halo_indices(layout, 1, 1, 1))[:3]     # rank 1's rows with one halo row each side
    [9, 10, 11]
"""

from physicsnemo_shardext.primitives.alignment import align_shard, aligned_split_sizes, resplit_rows
from physicsnemo_shardext.primitives.allocation import sharded_allocations
from physicsnemo_shardext.primitives.arguments import bind_arguments, expand_to
from physicsnemo_shardext.primitives.checks import (
    is_partial,
    is_replicated,
    normalize_dim,
    refuse_untracked_view_update,
    require_shard_input,
)
from physicsnemo_shardext.primitives.compilation import (
    delegate_when_traced,
    eager_handler,
    handlers_traced,
    is_tracing,
    outside_trace,
    refuse_tracing,
    traced_constants,
)
from physicsnemo_shardext.primitives.conv_strips import (
    ConvStrips,
    conv_strip_geometry,
    exchanging_strip_conv,
    strip_conv,
)
from physicsnemo_shardext.primitives.delegation import delegate, fallback
from physicsnemo_shardext.primitives.gathering import all_gather_rows
from physicsnemo_shardext.primitives.graph import connected_zeros, tie_to_graph
from physicsnemo_shardext.primitives.higher_order import (
    builds_graph,
    has_internal_overlap,
    linear_backward,
    materialized,
    refuse_higher_order,
)
from physicsnemo_shardext.primitives.index_exchange import (
    ExchangePlan,
    fetch_rows,
    gather_global_indices,
    halo_indices,
    plan_exchange,
    return_rows_into,
    start_fetch_rows,
    start_return_rows,
)
from physicsnemo_shardext.primitives.layout import (
    DimLayout,
    build_shard_tensor,
    dim_layout,
    from_local_like,
    sharded_dims,
    sharding_mesh_dims,
    split_rows_by_owner,
)
from physicsnemo_shardext.primitives.meta import meta_output_shape
from physicsnemo_shardext.primitives.pool_strips import (
    AvgOptions,
    PoolStrips,
    exchanging_strip_avg_pool,
    exchanging_strip_max_pool,
    pool_strip_geometry,
    strip_avg_pool,
    strip_max_pool,
)
from physicsnemo_shardext.primitives.precision import autocast_float32, output_dtype_under_autocast
from physicsnemo_shardext.primitives.profiling import profiled_range
from physicsnemo_shardext.primitives.reductions import (
    all_reduce_sum,
    max_over,
    min_over,
    sum_grad_over,
    sum_to_replicated,
    summed_over,
)
from physicsnemo_shardext.primitives.replicated import (
    elementwise_with_replicated,
    gather_full,
    replicated_local,
    replicated_part,
)
from physicsnemo_shardext.primitives.ring_shift import pack_bytes, packed_nbytes, ring_shift, unpack_bytes
from physicsnemo_shardext.primitives.spec import (
    mesh_of,
    placements_of,
    shard_shapes_of,
    spec_of,
    spec_shard_shapes,
    spec_with_placements,
    tensor_meta_of,
)
from physicsnemo_shardext.primitives.transpose import balanced_split_sizes, move_shard, transpose_shard
from physicsnemo_shardext.primitives.wrapping import local_of, wrap_gradient, wrap_local
from physicsnemo_shardext.targets import describe_target

__all__ = [
    "ConvStrips",
    "AvgOptions",
    "PoolStrips",
    "conv_strip_geometry",
    "exchanging_strip_conv",
    "exchanging_strip_avg_pool",
    "exchanging_strip_max_pool",
    "pool_strip_geometry",
    "strip_conv",
    "strip_avg_pool",
    "strip_max_pool",
    "align_shard",
    "aligned_split_sizes",
    "all_gather_rows",
    "all_reduce_sum",
    "autocast_float32",
    "balanced_split_sizes",
    "bind_arguments",
    "build_shard_tensor",
    "builds_graph",
    "connected_zeros",
    "delegate",
    "delegate_when_traced",
    "describe_target",
    "dim_layout",
    "DimLayout",
    "eager_handler",
    "handlers_traced",
    "elementwise_with_replicated",
    "ExchangePlan",
    "expand_to",
    "fallback",
    "from_local_like",
    "gather_full",
    "fetch_rows",
    "gather_global_indices",
    "halo_indices",
    "has_internal_overlap",
    "is_partial",
    "is_replicated",
    "is_tracing",
    "linear_backward",
    "local_of",
    "materialized",
    "max_over",
    "mesh_of",
    "meta_output_shape",
    "min_over",
    "move_shard",
    "normalize_dim",
    "output_dtype_under_autocast",
    "pack_bytes",
    "packed_nbytes",
    "placements_of",
    "plan_exchange",
    "return_rows_into",
    "start_fetch_rows",
    "start_return_rows",
    "profiled_range",
    "refuse_higher_order",
    "outside_trace",
    "refuse_tracing",
    "refuse_untracked_view_update",
    "replicated_local",
    "replicated_part",
    "require_shard_input",
    "resplit_rows",
    "ring_shift",
    "shard_shapes_of",
    "sharded_allocations",
    "sharded_dims",
    "sharding_mesh_dims",
    "spec_of",
    "spec_shard_shapes",
    "spec_with_placements",
    "split_rows_by_owner",
    "sum_grad_over",
    "sum_to_replicated",
    "summed_over",
    "tensor_meta_of",
    "tie_to_graph",
    "traced_constants",
    "transpose_shard",
    "unpack_bytes",
    "wrap_gradient",
    "wrap_local",
]
