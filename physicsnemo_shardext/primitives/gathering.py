"""Every rank's rows along one mesh dimension, on every rank: one all-gather, uneven and empty shards included.

`all_gather_rows` is the exchange under a prefix over ranks (a cumsum's per-rank
totals) and under a move of uneven shards to ``Replicate`` (each rank's true row
count, not ``torch.chunk``'s). It works on plain local tensors, so it serves code
that holds a block and its sizes rather than a ShardTensor (`gather_full` takes
the ShardTensor itself). Rows come back in *coordinate* order along the mesh
dimension, whatever order the process group numbers its ranks in.

Examples:
    On 2 ranks, 3 rows held as 2 + 1:

    >>> full = torch.arange(6.0).reshape(3, 2)
    >>> local = [full[:2], full[2:]][rank]
    >>> torch.equal(all_gather_rows(local, mesh, 0, 0, [2, 1]), full)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_shardext.primitives.collectives import gather_blocks
from physicsnemo_shardext.primitives.layout import _group_ranks
from physicsnemo_shardext.primitives.profiling import profiled_range

__all__ = ["all_gather_rows"]


def all_gather_rows(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Every coordinate's ``local`` along ``mesh_dim``, concatenated along ``dim`` in coordinate order.

    Each rank passes its own block; the blocks agree on every dim but ``dim``. Not
    differentiable (for the inside of an ``autograd.Function``, or of DTensor's
    redistribution, which runs below autograd); a new tensor, ``local`` left as it was.

    Args:
        local: this rank's block.
        mesh: the device mesh.
        mesh_dim: the mesh dimension whose ranks exchange their blocks.
        dim: the tensor dimension the blocks are stacked along (negative counts from the end).
        sizes: rows along ``dim`` held by each coordinate of ``mesh_dim``, in coordinate
            order (uneven and zero allowed; every rank passes the same); ``None`` when every
            rank holds ``local.shape[dim]`` rows.

    Returns:
        A tensor of ``sum(sizes)`` rows along ``dim``. One all-gather over ``mesh_dim``
        (blocks padded to the largest); a copy, without communication, where the mesh
        dimension has a single rank.

    Raises:
        ValueError: ``local`` is 0-d, ``sizes`` has not one entry per coordinate, or its
            entry for this rank is not ``local.shape[dim]``.

    Examples:
        On 2 ranks, one row per rank (a per-rank total), then a split 0 + 2 with an empty shard:

        >>> all_gather_rows(torch.tensor([[rank + 1.0]]), mesh, 0, 0)
        tensor([[1.],
                [2.]])
        >>> local = [torch.empty(1, 0), torch.tensor([[5.0, 6.0]])][rank]
        >>> all_gather_rows(local, mesh, 0, -1, [0, 2])
        tensor([[5., 6.]])
    """
    if local.ndim == 0:
        raise ValueError("all_gather_rows: a 0-d tensor has no rows to gather (unsqueeze it first)")
    dim = dim % local.ndim
    parts = mesh.size(mesh_dim)
    coord = (mesh.get_coordinate() or [0] * mesh.ndim)[mesh_dim] if parts > 1 else 0
    sizes = tuple(int(n) for n in sizes) if sizes is not None else (local.shape[dim],) * parts
    if len(sizes) != parts or sizes[coord] != local.shape[dim]:
        raise ValueError(
            f"all_gather_rows: sizes {sizes} for {parts} coordinates of mesh dim {mesh_dim}, but this rank "
            f"(coordinate {coord}) holds {local.shape[dim]} rows along dim {dim}"
        )
    block = local.detach()
    if parts == 1:
        return block.clone(memory_format=torch.contiguous_format)
    with profiled_range("shardext.all_gather_rows"):
        width = max(sizes)
        if width != block.shape[dim]:
            shape = list(block.shape)
            shape[dim] = width
            padded = block.new_zeros(shape)
            padded.narrow(dim, 0, block.shape[dim]).copy_(block)
            block = padded
        block = block.contiguous()
        received = gather_blocks(block, parts, mesh.get_group(mesh_dim))
        group_ranks = _group_ranks(mesh, mesh_dim, tuple(mesh.get_coordinate() or ()))
        return torch.cat([received[group_ranks[c]].narrow(dim, 0, sizes[c]) for c in range(parts)], dim=dim)
