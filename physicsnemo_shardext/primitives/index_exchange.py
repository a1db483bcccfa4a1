"""Fetch arbitrary global rows of a sharded dimension from whichever rank holds them.

Halo exchanges (of any width, even wider than a neighbour's tiny shard),
periodic wrap-around, reversal (flip), shifts (roll) and re-splitting are all
the same operation: each rank names the *global* row indices it needs along one
sharded dimension, and receives exactly those rows, in that order.
`gather_global_indices` does it with one ``all_to_all_single`` that moves
only rows that cross ranks (rows a rank already holds are copied locally), and
skips the collective when no row crosses. It is differentiable: the backward
sends each gradient row back to its owner and accumulates repeats.

Every rank must be able to compute what *every* coordinate wants (``wanted_by``
is evaluated for all coordinates on each rank), so no request is exchanged.

Examples:
    On 2 ranks, rows split 10/7; each rank gets a one-row halo on both sides
    (rank 0: 11 rows, rank 1: 8 rows):

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.primitives import dim_layout
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.arange(17.0).reshape(17, 1), mesh, [Shard(0)], [10, 7])
    >>> layout = dim_layout(x, 0)
    >>> padded = gather_global_indices(x.to_local(), layout, lambda c: halo_indices(layout, c, 1, 1))
    >>> padded[:, 0].tolist() == [list(range(0, 11)), list(range(9, 17))][rank]
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from physicsnemo_shardext.primitives.layout import DimLayout

__all__ = ["ExchangePlan", "gather_global_indices", "halo_indices", "plan_exchange"]

WantedBy = Callable[[int], Sequence[int]] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class ExchangePlan:
    """Who sends which rows to whom, for one rank (all index lists are local row numbers).

    Attributes:
        send_rows: per coordinate, the local rows this rank sends there (empty for itself).
        recv_positions: per coordinate, the output positions filled by rows received from it.
        self_rows: local rows this rank copies into its own output ...
        self_positions: ... at these output positions.
        output_rows: number of rows of the output.
        crosses: whether any row crosses ranks anywhere (else no collective at all).
    """

    send_rows: tuple[tuple[int, ...], ...]
    recv_positions: tuple[tuple[int, ...], ...]
    self_rows: tuple[int, ...]
    self_positions: tuple[int, ...]
    output_rows: int
    crosses: bool


def _wanted(wanted_by: WantedBy, coord: int) -> list[int]:
    return list(wanted_by(coord) if callable(wanted_by) else wanted_by[coord])


def plan_exchange(layout: DimLayout, wanted_by: WantedBy) -> ExchangePlan:
    """Work out the exchange for this rank; identical inputs give consistent plans on all ranks.

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3, 2), coord=0, mesh=None)
        >>> plan = plan_exchange(layout, [[0, 1, 2, 3], [2, 3, 4]])
        >>> plan.send_rows, plan.recv_positions, plan.self_rows, plan.crosses
        (((), (2,)), ((), (3,)), (0, 1, 2), True)
    """
    me = layout.coord
    send_rows: list[tuple[int, ...]] = []
    recv_positions: list[list[int]] = [[] for _ in range(layout.parts)]
    self_rows: list[int] = []
    self_positions: list[int] = []
    crosses = False
    for coord in range(layout.parts):
        wanted = _wanted(wanted_by, coord)
        rows_from_me: list[int] = []
        for position, index in enumerate(wanted):
            owner = layout.owner_of(index)
            if owner != coord:
                crosses = True
            if coord == me:
                if owner == me:
                    self_rows.append(index - layout.start)
                    self_positions.append(position)
                else:
                    recv_positions[owner].append(position)
            elif owner == me:
                rows_from_me.append(index - layout.start)
        send_rows.append(tuple(rows_from_me) if coord != me else ())
    return ExchangePlan(
        send_rows=tuple(send_rows),
        recv_positions=tuple(tuple(p) for p in recv_positions),
        self_rows=tuple(self_rows),
        self_positions=tuple(self_positions),
        output_rows=len(_wanted(wanted_by, me)),
        crosses=crosses,
    )


def _all_to_all_rows(
    pieces: list[torch.Tensor], recv_counts: Sequence[int], layout: DimLayout, like: torch.Tensor
) -> list[torch.Tensor]:
    """Send ``pieces[c]`` (rows along dim 0) to coordinate ``c``; return what each coordinate sent here."""
    order = sorted(range(layout.parts), key=lambda c: layout.group_ranks[c])  # group-rank order
    send = torch.cat([pieces[c] for c in order]).contiguous()
    recv = like.new_empty((sum(recv_counts),) + tuple(like.shape[1:]))
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[int(recv_counts[c]) for c in order],
        input_split_sizes=[int(pieces[c].shape[0]) for c in order],
        group=layout.group,
    )
    received = dict(zip(order, recv.split([int(recv_counts[c]) for c in order])))
    return [received[c] for c in range(layout.parts)]


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.long, device=device)


@functools.lru_cache(maxsize=4096)
def _span(rows: tuple[int, ...]) -> slice | None:
    """``rows`` as a slice when they are consecutive and increasing (the common case: a block, a halo).

    Fancy indexing copies through an index tensor and ``index_add_`` is slow on strided
    blocks; a slice is a view, so copies and accumulations become plain strided ops.

    Examples:
        >>> _span((3, 4, 5)), _span((3, 5)), _span(())
        (slice(3, 6, None), None, None)
    """
    if not rows or rows[-1] - rows[0] != len(rows) - 1 or any(b - a != 1 for a, b in zip(rows, rows[1:])):
        return None
    return slice(rows[0], rows[-1] + 1)


def _take(source: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    span = _span(rows)
    return source[span] if span is not None else source[_index(rows, source.device)]


def _put(target: torch.Tensor, positions: tuple[int, ...], values: torch.Tensor) -> None:
    span = _span(positions)
    if span is not None:
        target[span] = values
    else:
        target[_index(positions, target.device)] = values


def _accumulate(target: torch.Tensor, rows: tuple[int, ...], values: torch.Tensor) -> None:
    span = _span(rows)
    if span is not None:
        target[span] += values  # consecutive rows never repeat
    else:
        target.index_add_(0, _index(rows, target.device), values)  # repeats (reflection) accumulate


class _GatherGlobalIndices(torch.autograd.Function):
    """Autograd wrapper; works on the sharded dim moved to the front."""

    @staticmethod
    def forward(ctx, rows_first: torch.Tensor, layout: DimLayout, plan: ExchangePlan) -> torch.Tensor:
        ctx.layout, ctx.plan, ctx.local_rows = layout, plan, rows_first.shape[0]
        device = rows_first.device
        out = rows_first.new_empty((plan.output_rows,) + tuple(rows_first.shape[1:]))
        if plan.self_rows:
            _put(out, plan.self_positions, _take(rows_first, plan.self_rows))
        if plan.crosses:
            pieces = [_take(rows_first, rows) if rows else rows_first[:0] for rows in plan.send_rows]
            received = _all_to_all_rows(pieces, [len(p) for p in plan.recv_positions], layout, rows_first)
            for positions, rows in zip(plan.recv_positions, received):
                if positions:
                    _put(out, positions, rows)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        layout, plan = ctx.layout, ctx.plan
        device = grad_out.device
        grad = grad_out.new_zeros((ctx.local_rows,) + tuple(grad_out.shape[1:]))
        if plan.self_rows:
            _accumulate(grad, plan.self_rows, _take(grad_out, plan.self_positions))
        if plan.crosses:
            # The reverse exchange: what we received goes back to its owner, summed into its rows.
            pieces = [_take(grad_out, p) if p else grad_out[:0] for p in plan.recv_positions]
            returned = _all_to_all_rows(pieces, [len(r) for r in plan.send_rows], layout, grad_out)
            for rows, values in zip(plan.send_rows, returned):
                if rows:
                    _accumulate(grad, rows, values)
        return grad, None, None


def gather_global_indices(local: torch.Tensor, layout: DimLayout, wanted_by: WantedBy) -> torch.Tensor:
    """Return the global rows ``wanted_by(layout.coord)`` of dim ``layout.tensor_dim``, in that order.

    Args:
        local: this rank's shard (a plain tensor, e.g. ``x.to_local()``).
        layout: the sharded dimension's layout (`dim_layout`).
        wanted_by: for each coordinate, the global rows it wants (a callable or a list per coordinate).
            Indices may repeat and come in any order; all must lie in ``[0, layout.total)``.

    Every rank along the mesh dimension must call it with the same ``wanted_by``.

    Examples:
        Flip a dim split 10/7 over 2 ranks: each rank asks for the mirrored rows of its own range.

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(17.0).reshape(17, 1), mesh, [Shard(0)], [10, 7])
        >>> layout = dim_layout(x, 0)
        >>> def mirrored(c):
        ...     start = layout.offsets[c]
        ...     return [layout.total - 1 - i for i in range(start, start + layout.sizes[c])]
        >>> flipped = gather_global_indices(x.to_local(), layout, mirrored)
        >>> flipped[:, 0].tolist() == [list(range(16, 6, -1)), list(range(6, -1, -1))][rank]
        True
    """
    with torch.profiler.record_function("shardext.gather_global_indices"):
        plan = plan_exchange(layout, wanted_by)
        rows_first = local.movedim(layout.tensor_dim, 0)
        out = _GatherGlobalIndices.apply(rows_first, layout, plan)
        return out.movedim(0, layout.tensor_dim)


def halo_indices(layout: DimLayout, coord: int, before: int, after: int, periodic: bool = False) -> list[int]:
    """Global rows of ``coord``'s shard extended by ``before``/``after`` rows.

    Non-periodic: rows outside the global range are dropped (the caller pads the
    global boundary itself). Periodic: they wrap around.

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3, 2), coord=0, mesh=None)
        >>> halo_indices(layout, 0, 1, 1), halo_indices(layout, 0, 1, 1, periodic=True)
        ([0, 1, 2, 3], [4, 0, 1, 2, 3])
    """
    start = layout.offsets[coord]
    stop = start + layout.sizes[coord]
    rows = range(start - before, stop + after)
    if periodic:
        if layout.total == 0:
            return []
        return [i % layout.total for i in rows]
    return [i for i in rows if 0 <= i < layout.total]
