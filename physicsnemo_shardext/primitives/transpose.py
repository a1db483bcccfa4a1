"""Move a shard from one tensor dimension to another with one uneven all-to-all.

A distributed FFT (slab or pencil decomposition) must transform a dimension that
is split over ranks. It does so by *transposing* the decomposition: every rank
cuts its block along a dimension that is complete locally (the destination) and
sends piece ``c`` to coordinate ``c``; afterwards the formerly sharded dimension
(the source) is complete on every rank and the destination dimension is split.
Both splits may be uneven, with empty shards. Only the pieces that change owner
are sent: a rank keeps its own piece (sent with size 0), so the payload a rank
hands to the collective is ``local_bytes * (1 - dst_sizes[coord] / dst_total)``.

The operation is differentiable: its backward is the reverse move (destination
back to source, with the source sizes), one all-to-all of the gradient.

Examples:
    On 2 ranks, ``xs`` of shape ``(4, 5)`` split 3/1 on dim 0; afterwards dim 1 is split 3/2:

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.primitives import dim_layout
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(20.0).reshape(4, 5)
    >>> xs = shard_tensor(full, mesh, [Shard(0)], [3, 1])
    >>> layout = dim_layout(xs, 0)
    >>> layout.sizes
    (3, 1)
    >>> y_local = move_shard(xs.to_local(), layout, 1, [3, 2])
    >>> tuple(y_local.shape) == [(4, 3), (4, 2)][rank]
    True

    The same on ShardTensors, placements updated:

    >>> ys = transpose_shard(xs, 0, 1, [3, 2])
    >>> ys.placements, torch.equal(ys.full_tensor(), full)
    ((Shard(dim=1),), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard

from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.primitives.collectives import start_all_to_all
from physicsnemo_shardext.primitives.higher_order import linear_backward
from physicsnemo_shardext.primitives.layout import DimLayout, build_shard_tensor, sharded_dims
from physicsnemo_shardext.primitives.profiling import profiled_range
from physicsnemo_shardext.primitives.wrapping import local_of

__all__ = ["balanced_split_sizes", "move_shard", "transpose_shard"]


def balanced_split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Split ``total`` rows over ``parts`` coordinates, sizes differing by at most one, larger first.

    Examples:
        >>> balanced_split_sizes(5, 2), balanced_split_sizes(2, 4)
        ((3, 2), (1, 1, 0, 0))
    """
    base, extra = divmod(total, parts)
    return tuple(base + (1 if c < extra else 0) for c in range(parts))


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, running = [], 0
    for s in sizes:
        out.append(running)
        running += s
    return out


def _inner(t: torch.Tensor, *skip: int) -> int:
    """Product of the sizes of ``t``'s dims other than ``skip``."""
    n = 1
    for d, size in enumerate(t.shape):
        if d not in skip:
            n *= size
    return n


def _exchange(
    local: torch.Tensor,
    layout: DimLayout,
    cut_dim: int,
    cut_sizes: Sequence[int],
    join_dim: int,
    join_sizes: Sequence[int],
) -> torch.Tensor:
    """Cut ``local`` along ``cut_dim`` into ``cut_sizes``, send piece c to coordinate c, join along ``join_dim``.

    ``join_sizes[c]`` is how many rows of ``join_dim`` coordinate ``c`` holds before the move.
    """
    me, parts = layout.coord, layout.parts
    if parts == 1:  # a mesh dim of one rank: nothing moves
        return local.view_as(local)
    cut_offsets = _offsets(cut_sizes)
    pieces = [local.narrow(cut_dim, cut_offsets[c], cut_sizes[c]) for c in range(parts)]
    # Shape of the piece coordinate c sends here: its join rows, our cut rows.
    recv_shapes = []
    for c in range(parts):
        shape = list(local.shape)
        shape[cut_dim] = cut_sizes[me]
        shape[join_dim] = join_sizes[c]
        recv_shapes.append(shape)
    complex_input = local.is_complex()

    def flat(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        return (torch.view_as_real(t) if complex_input else t).reshape(-1)

    per_element = 2 if complex_input else 1
    order = sorted(range(parts), key=lambda c: layout.group_ranks[c])  # group-rank order
    # Our own piece never travels: it is sent and received with size 0 and copied locally.
    send_counts = [0 if c == me else pieces[c].numel() * per_element for c in order]
    recv_counts = [0 if c == me else int(torch.Size(recv_shapes[c]).numel()) * per_element for c in order]
    send = torch.cat([flat(pieces[c]) for c in order if c != me] or [flat(local)[:0]])
    recv = send.new_empty(sum(recv_counts))
    # Skip the collective only when *no* pair of ranks exchanges rows: a decision every rank of
    # the group takes identically (rows per coordinate are known everywhere), so none waits alone.
    inner = _inner(local, cut_dim, join_dim)
    crosses = inner > 0 and any(join_sizes[a] * cut_sizes[b] for a in range(parts) for b in range(parts) if a != b)
    if crosses:
        recv = start_all_to_all(send, recv_counts, send_counts, layout.group)()
    chunks = dict(zip(order, recv.split(recv_counts)))  # type: ignore[no-untyped-call]  # torch's Tensor.split is unannotated
    received = []
    for c in range(parts):
        if c == me:
            received.append(pieces[c])
            continue
        chunk = chunks[c]
        if complex_input:
            chunk = torch.view_as_complex(chunk.reshape(*recv_shapes[c], 2))
        received.append(chunk.reshape(recv_shapes[c]))
    return torch.cat(received, dim=join_dim)


class _MoveShard(torch.autograd.Function):
    """Forward: source -> destination; backward: destination -> source."""

    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        layout: DimLayout,
        src_dim: int,
        dst_dim: int,
        src_sizes: Sequence[int],
        dst_sizes: Sequence[int],
    ) -> torch.Tensor:
        ctx.args = (layout, src_dim, dst_dim, src_sizes, dst_sizes)
        return _exchange(local, layout, dst_dim, dst_sizes, src_dim, src_sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        layout, src_dim, dst_dim, src_sizes, dst_sizes = ctx.args
        # The reverse exchange; under create_graph=True its own backward is the forward one.
        back = linear_backward(
            grad,
            lambda g: _exchange(g, layout, src_dim, src_sizes, dst_dim, dst_sizes),
            lambda t: _exchange(t, layout, dst_dim, dst_sizes, src_dim, src_sizes),
        )
        return back, None, None, None, None, None


def move_shard(
    local: torch.Tensor, layout: DimLayout, dst_dim: int, dst_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Re-split a local block: complete along ``layout.tensor_dim`` afterwards, split along ``dst_dim``.

    Args:
        local: this rank's block, holding ``layout.local_size`` rows of ``layout.tensor_dim``
            and the whole of ``dst_dim``.
        layout: the source dimension's layout (sizes per coordinate, mesh dim, group).
        dst_dim: the dimension to split afterwards (complete in ``local``).
        dst_sizes: rows of ``dst_dim`` per coordinate afterwards; default `balanced_split_sizes`.

    Returns:
        The new local block. Every rank along ``layout.mesh_dim`` must call it with the
        same arguments (one ``all_to_all_single``, skipped when nothing crosses ranks).

    Examples:
        On 2 ranks, ``x`` of shape ``(1, 1, 5, 4)`` split 3/2 on H becomes H complete, W split 2/2:

        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(20.0).reshape(1, 1, 5, 4), mesh, [Shard(2)], [3, 2])
        >>> y = move_shard(x.to_local(), dim_layout(x, 2), 3)
        >>> tuple(y.shape)
        (1, 1, 5, 2)
    """
    src_dim = layout.tensor_dim % local.ndim
    dst_dim %= local.ndim
    if src_dim == dst_dim:
        raise ValueError(f"move_shard: source and destination are the same dim {src_dim}")
    total = local.shape[dst_dim]
    sizes = tuple(balanced_split_sizes(total, layout.parts) if dst_sizes is None else (int(s) for s in dst_sizes))
    if len(sizes) != layout.parts or sum(sizes) != total or min(sizes) < 0:
        raise ValueError(f"move_shard: sizes {sizes} do not split {total} rows over {layout.parts} coordinates")
    if local.shape[src_dim] != layout.local_size:
        raise ValueError(
            f"move_shard: local block has {local.shape[src_dim]} rows on dim {src_dim}, layout says {layout.local_size}"
        )
    with profiled_range("shardext.move_shard"):
        return cast(
            torch.Tensor, cast(Any, _MoveShard).apply(local, layout, src_dim, dst_dim, layout.sizes, sizes)
        )  # Function.apply: untyped before torch 2.14


def transpose_shard(x: ShardTensor, src_dim: int, dst_dim: int, dst_sizes: Sequence[int] | None = None) -> ShardTensor:
    """ShardTensor form of `move_shard`: ``Shard(src_dim)`` becomes ``Shard(dst_dim)`` on its mesh dim.

    ``dst_dim`` must not be sharded already. Other mesh dims keep their placements and sizes.

    Examples:
        ``[Shard(2)]`` becomes ``[Shard(3)]``, with a balanced split of dim 3 (3/2 on 2 ranks):

        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(50.0).reshape(1, 2, 5, 5)
        >>> xs = shard_tensor(full, mesh, [Shard(2)], [4, 1])
        >>> ys = transpose_shard(xs, 2, 3)
        >>> tuple(ys.to_local().shape) == [(1, 2, 5, 3), (1, 2, 5, 2)][rank], torch.equal(ys.full_tensor(), full)
        (True, True)
    """
    src_dim %= x.ndim
    dst_dim %= x.ndim
    layouts = sharded_dims(x)
    if src_dim not in layouts:
        raise MissingShardPatch(f"transpose_shard: dim {src_dim} of {tuple(x._spec.placements)} is not sharded")
    if dst_dim in layouts:
        raise MissingShardPatch(
            f"transpose_shard: destination dim {dst_dim} is already sharded ({tuple(x._spec.placements)})"
        )
    layout = layouts[src_dim]
    local = move_shard(local_of(x), layout, dst_dim, dst_sizes)
    placements = list(x._spec.placements)
    placements[layout.mesh_dim] = Shard(dst_dim)
    sizes = {d: l.sizes for d, l in layouts.items() if d != src_dim}
    sizes[dst_dim] = tuple(
        balanced_split_sizes(x.shape[dst_dim], layout.parts) if dst_sizes is None else (int(s) for s in dst_sizes)
    )
    return build_shard_tensor(local, x._spec.mesh, placements, sizes)
