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
from typing import Any, cast

import torch

from physicsnemo_shardext.primitives.collectives import start_all_to_all
from physicsnemo_shardext.primitives.higher_order import linear_backward
from physicsnemo_shardext.primitives.layout import DimLayout
from physicsnemo_shardext.primitives.profiling import profiled_range

__all__ = [
    "ExchangePlan",
    "fetch_rows",
    "gather_global_indices",
    "halo_indices",
    "plan_exchange",
    "return_rows_into",
    "start_fetch_rows",
    "start_return_rows",
]

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


def _as_key(rows: Sequence[int]) -> range | tuple[int, ...]:
    """``rows`` in a hashable form: a step-1 ``range`` where they are consecutive (halos, blocks)."""
    if isinstance(rows, range) and rows.step == 1:
        return rows
    items = tuple(rows)
    if items and items[-1] - items[0] == len(items) - 1 and items == tuple(range(items[0], items[-1] + 1)):
        return range(items[0], items[-1] + 1)
    return items


def plan_exchange(layout: DimLayout, wanted_by: WantedBy) -> ExchangePlan:
    """Work out the exchange for this rank; identical inputs give consistent plans on all ranks.

    Plans are cached by (row counts, coordinate, rows wanted), so a layer called every
    step plans once; consecutive rows are planned interval by interval, not row by row.

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3, 2), coord=0, mesh=None)
        >>> plan = plan_exchange(layout, [[0, 1, 2, 3], [2, 3, 4]])
        >>> plan.send_rows, plan.recv_positions, plan.self_rows, plan.crosses
        (((), (2,)), ((), (3,)), (0, 1, 2), True)
    """
    wanted = tuple(
        _as_key(wanted_by(coord) if callable(wanted_by) else wanted_by[coord]) for coord in range(layout.parts)
    )
    return _cached_plan(tuple(layout.sizes), layout.coord, wanted)


def _runs(rows: range | tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``rows`` as maximal runs of consecutive indices: (first position, first row, length)."""
    if isinstance(rows, range):
        return [(0, rows.start, len(rows))] if len(rows) else []
    runs: list[tuple[int, int, int]] = []
    for position, row in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == row:
            first_position, first_row, length = runs[-1]
            runs[-1] = (first_position, first_row, length + 1)
        else:
            runs.append((position, row, 1))
    return runs


@functools.lru_cache(maxsize=1024)
def _cached_plan(sizes: tuple[int, ...], me: int, wanted: tuple[range | tuple[int, ...], ...]) -> ExchangePlan:
    offsets = [sum(sizes[:c]) for c in range(len(sizes))]
    total = sum(sizes)
    # Rows of a run that fall in owner o's range [offsets[o], offsets[o] + sizes[o]).
    owners = [o for o in range(len(sizes)) if sizes[o]]
    send_rows: list[tuple[int, ...]] = []
    recv_positions: list[list[int]] = [[] for _ in sizes]
    self_rows: list[int] = []
    self_positions: list[int] = []
    crosses = False
    for coord, rows in enumerate(wanted):
        rows_from_me: list[int] = []
        for position, row, length in _runs(rows):
            if row < 0 or row + length > total:
                bad = row if row < 0 else row + length - 1
                raise IndexError(f"row {bad} outside a dimension of length {total}")
            for owner in owners:
                lo, hi = max(row, offsets[owner]), min(row + length, offsets[owner] + sizes[owner])
                if lo >= hi:
                    continue
                crosses = crosses or owner != coord
                local_rows = range(lo - offsets[owner], hi - offsets[owner])
                positions = range(position + lo - row, position + hi - row)
                if coord == me and owner == me:
                    self_rows.extend(local_rows)
                    self_positions.extend(positions)
                elif coord == me:
                    recv_positions[owner].extend(positions)
                elif owner == me:
                    rows_from_me.extend(local_rows)
        send_rows.append(tuple(rows_from_me) if coord != me else ())
    return ExchangePlan(
        send_rows=tuple(send_rows),
        recv_positions=tuple(tuple(p) for p in recv_positions),
        self_rows=tuple(self_rows),
        self_positions=tuple(self_positions),
        output_rows=len(wanted[me]),
        crosses=crosses,
    )


def _start_all_to_all(
    pieces: list[torch.Tensor], recv_counts: Sequence[int], layout: DimLayout, like: torch.Tensor
) -> Callable[[], list[torch.Tensor]]:
    """Start sending ``pieces[c]`` (rows along dim 0) to coordinate ``c``; return a wait for what each sent here.

    ``recv_counts[c]`` is how many rows coordinate ``c`` sends here. The returned
    function waits for the collective and returns the received rows in coordinate order.
    """
    order = sorted(range(layout.parts), key=lambda c: layout.group_ranks[c])  # group-rank order
    send = torch.cat([pieces[c] for c in order]).contiguous()
    counts = [int(recv_counts[c]) for c in order]
    wait_for = start_all_to_all(send, counts, [int(pieces[c].shape[0]) for c in order], layout.group)

    def wait() -> list[torch.Tensor]:
        recv = wait_for()
        received = dict(zip(order, recv.split(counts)))  # type: ignore[no-untyped-call]  # torch's Tensor.split is unannotated
        return [received[c] for c in range(layout.parts)]

    return wait


def _all_to_all_rows(
    pieces: list[torch.Tensor], recv_counts: Sequence[int], layout: DimLayout, like: torch.Tensor
) -> list[torch.Tensor]:
    """Send ``pieces[c]`` (rows along dim 0) to coordinate ``c``; return what each coordinate sent here."""
    return _start_all_to_all(pieces, recv_counts, layout, like)()


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


def _gather_rows_by_plan(rows_first: torch.Tensor, layout: DimLayout, plan: ExchangePlan) -> torch.Tensor:
    """The forward exchange: this rank's wanted rows, own ones copied, the others received."""
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


def _return_rows_by_plan(
    grad_out: torch.Tensor, layout: DimLayout, plan: ExchangePlan, local_rows: int, into: torch.Tensor | None = None
) -> torch.Tensor:
    """The adjoint exchange: what was received goes back to its owner, summed into its rows (of ``into``)."""
    grad = grad_out.new_zeros((local_rows,) + tuple(grad_out.shape[1:])) if into is None else into
    if plan.self_rows:
        _accumulate(grad, plan.self_rows, _take(grad_out, plan.self_positions))
    if plan.crosses:
        pieces = [_take(grad_out, p) if p else grad_out[:0] for p in plan.recv_positions]
        returned = _all_to_all_rows(pieces, [len(r) for r in plan.send_rows], layout, grad_out)
        for rows, values in zip(plan.send_rows, returned):
            if rows:
                _accumulate(grad, rows, values)
    return grad


class _GatherGlobalIndices(torch.autograd.Function):
    """Autograd wrapper; works on the sharded dim moved to the front. Differentiable at every order."""

    @staticmethod
    def forward(ctx: Any, rows_first: torch.Tensor, layout: DimLayout, plan: ExchangePlan) -> torch.Tensor:
        ctx.layout, ctx.plan, ctx.local_rows = layout, plan, rows_first.shape[0]
        return _gather_rows_by_plan(rows_first, layout, plan)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout, plan, local_rows = ctx.layout, ctx.plan, ctx.local_rows
        # Linear in grad_out: under create_graph=True its own backward is the forward exchange.
        grad = linear_backward(
            grad_out,
            lambda g: _return_rows_by_plan(g, layout, plan, local_rows),
            lambda t: _gather_rows_by_plan(t, layout, plan),
        )
        return grad, None, None


def gather_global_indices(local: torch.Tensor, layout: DimLayout, wanted_by: WantedBy) -> torch.Tensor:
    """Return the global rows ``wanted_by(layout.coord)`` of dim ``layout.tensor_dim``, in that order.

    Args:
        local: this rank's shard (a plain tensor, e.g. ``local_of(x)``).
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
    with profiled_range("shardext.gather_global_indices"):
        plan = plan_exchange(layout, wanted_by)
        rows_first = local.movedim(layout.tensor_dim, 0)
        out: torch.Tensor = cast(Any, _GatherGlobalIndices).apply(
            rows_first, layout, plan
        )  # Function.apply: untyped before torch 2.14
        return out.movedim(0, layout.tensor_dim)


def fetch_rows(local: torch.Tensor, layout: DimLayout, plan: ExchangePlan) -> torch.Tensor:
    """The rows of ``plan`` along ``layout.tensor_dim``, outside autograd (`gather_global_indices` without a graph).

    For an autograd Function that exchanges rows itself and returns their gradients
    with `return_rows_into`, so that the block's gradient is one buffer.

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3,), coord=0, mesh=None)
        >>> fetch_rows(torch.arange(3.0), layout, plan_exchange(layout, [[2, 0]])).tolist()
        [2.0, 0.0]
    """
    return start_fetch_rows(local, layout, plan)()


def start_fetch_rows(local: torch.Tensor, layout: DimLayout, plan: ExchangePlan) -> Callable[[], torch.Tensor]:
    """Start `fetch_rows` and return a function that waits for it and returns the rows.

    The exchange runs while the caller computes what does not need the rows (a
    convolution's interior, from the block), so on a backend with asynchronous
    collectives it hides behind that compute. The returned function must be called
    once, by every rank that started the exchange.

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3,), coord=0, mesh=None)
        >>> finish = start_fetch_rows(torch.arange(3.0), layout, plan_exchange(layout, [[2, 0]]))
        >>> finish().tolist()
        [2.0, 0.0]
    """
    d = layout.tensor_dim
    with torch.no_grad():
        rows_first = local.movedim(d, 0)
        out = rows_first.new_empty((plan.output_rows,) + tuple(rows_first.shape[1:]))
        if plan.self_rows:
            _put(out, plan.self_positions, _take(rows_first, plan.self_rows))
        if not plan.crosses:
            return lambda: out.movedim(0, d)
        pieces = [_take(rows_first, rows) if rows else rows_first[:0] for rows in plan.send_rows]
        wait = _start_all_to_all(pieces, [len(p) for p in plan.recv_positions], layout, rows_first)

    def finish() -> torch.Tensor:
        with torch.no_grad():
            for c, received in enumerate(wait()):
                if plan.recv_positions[c]:
                    _put(out, plan.recv_positions[c], received)
        return out.movedim(0, d)

    return finish


def return_rows_into(grad_local: torch.Tensor, grad_rows: torch.Tensor, layout: DimLayout, plan: ExchangePlan) -> None:
    """Send the gradient of fetched rows back to their owners, added in place into ``grad_local`` (the adjoint of `fetch_rows`).

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3,), coord=0, mesh=None)
        >>> grad = torch.zeros(3)
        >>> return_rows_into(grad, torch.tensor([1.0, 5.0]), layout, plan_exchange(layout, [[2, 2]]))
        >>> grad.tolist()
        [0.0, 0.0, 6.0]
    """
    start_return_rows(grad_rows, layout, plan)(grad_local)


def start_return_rows(grad_rows: torch.Tensor, layout: DimLayout, plan: ExchangePlan) -> Callable[[torch.Tensor], None]:
    """Start `return_rows_into` and return a function that waits and adds the rows into the block's gradient.

    The halo gradients are known before the block's own (they come from the small
    edge strips), so the exchange travels while the caller computes the block's
    gradient, and is added into it afterwards. The returned function must be called
    once, by every rank that started the exchange, with the block's gradient.

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3,), coord=0, mesh=None)
        >>> finish = start_return_rows(torch.tensor([1.0, 5.0]), layout, plan_exchange(layout, [[2, 2]]))
        >>> grad = torch.ones(3)  # computed while the rows travel
        >>> finish(grad)
        >>> grad.tolist()
        [1.0, 1.0, 7.0]
    """
    d = layout.tensor_dim
    with torch.no_grad():
        rows_first = grad_rows.movedim(d, 0)
        own = _take(rows_first, plan.self_positions) if plan.self_rows else None
        wait = None
        if plan.crosses:
            pieces = [_take(rows_first, p) if p else rows_first[:0] for p in plan.recv_positions]
            wait = _start_all_to_all(pieces, [len(rows) for rows in plan.send_rows], layout, rows_first)

    def finish(grad_local: torch.Tensor) -> None:
        with torch.no_grad():
            target = grad_local.movedim(d, 0)
            if own is not None:
                _accumulate(target, plan.self_rows, own)
            if wait is None:
                return
            for c, values in enumerate(wait()):
                if plan.send_rows[c]:
                    _accumulate(target, plan.send_rows[c], values)

    return finish


def halo_indices(layout: DimLayout, coord: int, before: int, after: int, periodic: bool = False) -> Sequence[int]:
    """Global rows of ``coord``'s shard extended by ``before``/``after`` rows.

    Non-periodic: rows outside the global range are dropped (the caller pads the
    global boundary itself), and the rows come as a ``range``. Periodic: they wrap
    around (a list).

    Examples:
        >>> layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3, 2), coord=0, mesh=None)
        >>> halo_indices(layout, 0, 1, 1), halo_indices(layout, 0, 1, 1, periodic=True)
        (range(0, 4), [4, 0, 1, 2, 3])
    """
    start = layout.offsets[coord]
    stop = start + layout.sizes[coord]
    if not periodic:
        return range(max(start - before, 0), min(stop + after, layout.total))
    if layout.total == 0:
        return []
    return [i % layout.total for i in range(start - before, stop + after)]
