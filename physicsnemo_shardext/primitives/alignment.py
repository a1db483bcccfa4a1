"""Re-split a sharded dimension: contiguous row ranges change owner, only the rows that must move travel.

An op that splits a sharded dimension into ``(n, k)`` (``view`` of an image
row dim into windows of ``k`` rows, tokens back into an ``H x W`` grid) needs
every rank boundary at a multiple of ``k``: a boundary inside a window (or an
image row) would put one window on two ranks. `aligned_split_sizes` moves each
boundary to the *nearest* multiple of ``k`` (ties go down), which is the least
movement that makes the split aligned: at most ``k // 2`` rows per boundary.
`resplit_rows` then sends each row whose owner changes to its new owner (one
``all_to_all_single``, skipped when no row changes owner), and keeps the rest
in place. It is differentiable: the backward is the reverse re-split of the
gradient. `align_shard` is both steps on a ShardTensor.

Bytes: a rank hands the collective exactly its rows that change owner
(``rows_moved * row_numel * element_size``); for aligned boundaries nothing moves.

Examples:
    On 2 ranks, 8 image rows split 5/3 into windows of 2 rows: the boundary 5 moves to 4,
    so rank 0 sends its last row (one row of 6 values) to rank 1:

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> aligned_split_sizes((5, 3), 2)
    (4, 4)
    >>> full = torch.arange(48.0).reshape(8, 6)
    >>> xs = shard_tensor(full, mesh, [Shard(0)], [5, 3])
    >>> ys = align_shard(xs, 0, 2)
    >>> tuple(ys.to_local().shape), torch.equal(ys.full_tensor(), full)
    ((4, 6), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.primitives.collectives import start_all_to_all
from physicsnemo_shardext.primitives.higher_order import linear_backward
from physicsnemo_shardext.primitives.layout import DimLayout, build_shard_tensor, sharded_dims
from physicsnemo_shardext.primitives.profiling import profiled_range
from physicsnemo_shardext.primitives.wrapping import local_of

__all__ = ["align_shard", "aligned_split_sizes", "resplit_rows"]


def aligned_split_sizes(sizes: Sequence[int], multiple: int) -> tuple[int, ...]:
    """Row counts whose boundaries are multiples of ``multiple``, each boundary moved as little as possible.

    Every interior boundary (offset of a coordinate's first row) goes to the nearest multiple
    of ``multiple``, a tie to the lower one; rounding keeps boundaries ordered, so sizes stay
    non-negative. The total must be a multiple of ``multiple``.

    Examples:
        >>> aligned_split_sizes((5, 3), 2), aligned_split_sizes((25, 23), 6), aligned_split_sizes((3, 0, 5), 4)
        ((4, 4), (24, 24), (4, 0, 4))
        >>> aligned_split_sizes((6, 2), 4)          # a tie goes down: boundary 6 -> 4
        (4, 4)
    """
    multiple = int(multiple)
    total = sum(int(s) for s in sizes)
    if multiple < 1 or total % multiple:
        raise ValueError(f"aligned_split_sizes: {total} rows cannot be split into multiples of {multiple}")
    boundaries, running = [], 0
    for size in sizes:
        low = running - running % multiple
        boundaries.append(low if 2 * (running - low) <= multiple else low + multiple)
        running += int(size)
    boundaries.append(total)
    return tuple(boundaries[c + 1] - boundaries[c] for c in range(len(sizes)))


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, running = [], 0
    for s in sizes:
        out.append(running)
        running += int(s)
    return out


def _overlap(sizes_a: Sequence[int], a: int, sizes_b: Sequence[int], b: int) -> tuple[int, int]:
    """Global rows ``[start, stop)`` held by coordinate ``a`` under ``sizes_a`` and by ``b`` under ``sizes_b``."""
    start_a, start_b = _offsets(sizes_a)[a], _offsets(sizes_b)[b]
    start = max(start_a, start_b)
    stop = min(start_a + int(sizes_a[a]), start_b + int(sizes_b[b]))
    return start, max(start, stop)


def _resplit(local: torch.Tensor, layout: DimLayout, dim: int, old: Sequence[int], new: Sequence[int]) -> torch.Tensor:
    """Rows of ``dim`` held under ``old`` sizes per coordinate -> this rank's rows under ``new`` sizes."""
    me, parts = layout.coord, layout.parts
    rows_first = local.movedim(dim, 0)
    my_start = _offsets(old)[me]
    pieces, recv_rows = [], []
    for c in range(parts):
        start, stop = _overlap(old, me, new, c)  # my old rows that c holds afterwards
        pieces.append(rows_first[start - my_start : stop - my_start])
        start, stop = _overlap(old, c, new, me)  # c's old rows that I hold afterwards
        recv_rows.append(stop - start)
    inner = 1
    for n in rows_first.shape[1:]:
        inner *= int(n)
    # The same decision on every rank: whether any row changes owner anywhere.
    crosses = inner > 0 and any(
        _overlap(old, a, new, b)[1] > _overlap(old, a, new, b)[0] for a in range(parts) for b in range(parts) if a != b
    )
    received: list[torch.Tensor | None] = [None] * parts
    if crosses:
        complex_input = local.is_complex()
        order = sorted(range(parts), key=lambda c: layout.group_ranks[c])  # group-rank order

        def flat(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous()
            return (torch.view_as_real(t) if complex_input else t).reshape(-1)

        per_row = inner * (2 if complex_input else 1)
        send_counts = [0 if c == me else pieces[c].shape[0] * per_row for c in order]
        recv_counts = [0 if c == me else recv_rows[c] * per_row for c in order]
        send = torch.cat([flat(pieces[c]) for c in order if c != me] or [flat(rows_first)[:0]])
        recv = start_all_to_all(send, recv_counts, send_counts, layout.group)()
        for c, chunk in zip(order, torch.split(recv, recv_counts)):
            if c != me:
                shape = (recv_rows[c], *rows_first.shape[1:])
                if complex_input:
                    chunk = torch.view_as_complex(chunk.reshape(*shape, 2))
                received[c] = chunk.reshape(shape)
    blocks = []
    for c in range(parts):
        if c == me:
            blocks.append(pieces[me])
        elif recv_rows[c]:
            block = received[c]
            # No exchange with rows to receive: only when rows hold no elements (a zero-size dim).
            blocks.append(rows_first.new_empty((recv_rows[c], *rows_first.shape[1:])) if block is None else block)
    out = torch.cat(blocks) if blocks else rows_first[:0]
    return out.movedim(0, dim)


class _Resplit(torch.autograd.Function):
    """Forward: old sizes -> new sizes; backward: new sizes -> old sizes."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, layout: DimLayout, dim: int, old: tuple[int, ...], new: tuple[int, ...]
    ) -> torch.Tensor:
        ctx.args = (layout, dim, old, new)
        return _resplit(local, layout, dim, old, new)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layout, dim, old, new = ctx.args
        # The reverse re-split; under create_graph=True its own backward is the forward one.
        back = linear_backward(
            grad,
            lambda g: _resplit(g.contiguous(), layout, dim, new, old),
            lambda t: _resplit(t.contiguous(), layout, dim, old, new),
        )
        return back, None, None, None, None


def resplit_rows(local: torch.Tensor, layout: DimLayout, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's block of ``layout.tensor_dim`` re-split to ``sizes`` rows per coordinate (contiguous ranges).

    Coordinate ``c`` holds global rows ``[offset_c, offset_c + sizes[c])`` afterwards. Rows
    that stay with their owner are not sent; the others travel in one ``all_to_all_single``
    (none when no row changes owner anywhere). Every rank along ``layout.mesh_dim`` must call
    it with the same ``sizes``.

    Args:
        local: this rank's block (``layout.local_size`` rows of ``layout.tensor_dim``).
        layout: the sharded dimension's layout before the re-split.
        sizes: rows per coordinate afterwards (same total).

    Returns:
        The new local block, ``sizes[layout.coord]`` rows of ``layout.tensor_dim``.

    Examples:
        Rows split 5/3 re-split to 4/4: rank 0 sends one row, rank 1 receives it.

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(8.0).reshape(8, 1), mesh, [Shard(0)], [5, 3])
        >>> resplit_rows(x.to_local(), dim_layout(x, 0), [4, 4])[:, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]][rank]
        True
    """
    dim = layout.tensor_dim % local.ndim
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != layout.parts or sum(sizes) != layout.total or min(sizes, default=0) < 0:
        raise ValueError(
            f"resplit_rows: sizes {sizes} do not split {layout.total} rows over {layout.parts} coordinates"
        )
    if local.shape[dim] != layout.local_size:
        raise ValueError(
            f"resplit_rows: local block has {local.shape[dim]} rows on dim {dim}, layout says {layout.local_size}"
        )
    if sizes == tuple(layout.sizes):
        return local
    with profiled_range("shardext.resplit_rows"):
        out: torch.Tensor = cast(Any, _Resplit).apply(
            local, layout, dim, tuple(layout.sizes), sizes
        )  # Function.apply: untyped before torch 2.14
        return out


def align_shard(x: ShardTensor, dim: int, multiple: int) -> ShardTensor:
    """``x`` with the rank boundaries of sharded ``dim`` moved to the nearest multiples of ``multiple``.

    The ShardTensor form of `aligned_split_sizes` + `resplit_rows`: placements unchanged,
    other sharded dims untouched; no communication when the boundaries are aligned already.

    Examples:
        Tokens ``(1, 48, C)`` of an ``8 x 6`` grid split 25/23: the boundary moves to 24.

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> tokens = shard_tensor(torch.randn(1, 48, 3), mesh, [Shard(1)], [25, 23])
        >>> aligned = align_shard(tokens, 1, 6)
        >>> aligned.to_local().shape[1], torch.equal(aligned.full_tensor(), tokens.full_tensor())
        (24, True)
    """
    dim %= x.ndim
    layouts = sharded_dims(x)
    if dim not in layouts:
        raise MissingShardPatch(f"align_shard: dim {dim} of {tuple(x._spec.placements)} is not sharded")
    layout = layouts[dim]
    sizes = aligned_split_sizes(layout.sizes, multiple)
    local = resplit_rows(local_of(x), layout, sizes)
    return build_shard_tensor(
        local, x._spec.mesh, x._spec.placements, {d: (sizes if d == dim else l.sizes) for d, l in layouts.items()}
    )
