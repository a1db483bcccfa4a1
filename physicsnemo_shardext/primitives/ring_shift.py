"""Pass a buffer one step around a ring: to the next coordinate of a mesh dim, from the previous one.

A ring algorithm (ring attention: K/V blocks travelling once around the ranks,
their gradient partials following them home) moves, at every step, one buffer
from each coordinate ``c`` to ``c + 1`` (the last to the first) along one mesh
dimension. `ring_shift` is that step: one ``all_to_all_single`` in which each
rank sends to its successor only and receives from its predecessor only, so a
step moves exactly the bytes handed to it, and sizes may differ from rank to
rank (uneven blocks, empty ones). Every rank along the mesh dim must call it,
each naming how much its predecessor sends.

A step usually carries several tensors (a key block and a value block, their
gradient partials): `pack_bytes` lays them out in one flat byte buffer, and
`unpack_bytes` reads a received buffer back as views, given the shapes and dtypes
the sender packed (`packed_nbytes` is their size). The views share the buffer, so
a ring can update a travelling partial in place and send the same buffer on.

Not differentiable: a ring with a gradient writes its own backward (which runs
the ring again), as ring attention does. Each call opens the profiler range
``shardext.ring_shift``.

Examples:
    On 2 ranks: each rank sends ``rank + 2`` values, and receives what its neighbour sent:

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.primitives import dim_layout
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> layout = dim_layout(shard_tensor(torch.zeros(5), mesh, [Shard(0)], [3, 2]), 0)
    >>> send = torch.full((rank + 2,), float(rank))
    >>> received = ring_shift(send, layout, 3 - rank)   # rank 0 gets rank 1's 3 values, rank 1 rank 0's 2
    >>> received.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0]][rank]
    True

    Several tensors in one buffer, read back as views:

    >>> a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([True, False])
    >>> specs = [((2, 3), torch.float32), ((2,), torch.bool)]
    >>> buffer = pack_bytes([a, b])
    >>> buffer.dtype, buffer.numel() == packed_nbytes(specs)
    (torch.uint8, True)
    >>> x, y = unpack_bytes(ring_shift(buffer, layout, packed_nbytes(specs)), specs)
    >>> torch.equal(x, a), torch.equal(y, b)        # the neighbour sent the same tensors
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from physicsnemo_shardext.primitives.collectives import start_all_to_all
from physicsnemo_shardext.primitives.layout import DimLayout
from physicsnemo_shardext.primitives.profiling import profiled_range

__all__ = ["pack_bytes", "packed_nbytes", "ring_shift", "unpack_bytes"]

#: The shape and dtype of one tensor in a packed buffer.
BufferSpec = tuple[tuple[int, ...], torch.dtype]


def pack_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat ``uint8`` buffer holding every tensor's elements in turn (a copy).

    Put wider dtypes first: each tensor starts where the previous one ends, and a view
    of a buffer (`unpack_bytes`) must start at a multiple of its dtype's size.

    Examples:
        >>> pack_bytes([torch.ones(2, dtype=torch.int16), torch.zeros(1, dtype=torch.uint8)])
        tensor([1, 0, 1, 0, 0], dtype=torch.uint8)
    """
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def packed_nbytes(specs: Sequence[BufferSpec]) -> int:
    """Bytes of a buffer holding tensors of these shapes and dtypes (what `pack_bytes` makes of them).

    Examples:
        >>> packed_nbytes([((2, 3), torch.float32), ((4,), torch.float16)])
        32
    """
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)


def unpack_bytes(buffer: torch.Tensor, specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
    """Inverse of `pack_bytes`: views of the ``uint8`` ``buffer`` with these shapes and dtypes, in turn.

    The views share the buffer (writing one writes the buffer). The buffer may be longer
    than the specs need; what follows the last tensor is ignored.

    Examples:
        >>> buffer = pack_bytes([torch.arange(4.0), torch.tensor([7], dtype=torch.int8)])
        >>> unpack_bytes(buffer, [((2, 2), torch.float32), ((1,), torch.int8)])
        [tensor([[0., 1.],
                [2., 3.]]), tensor([7], dtype=torch.int8)]
    """
    if packed_nbytes(specs) > buffer.numel():
        raise ValueError(f"unpack_bytes: specs need {packed_nbytes(specs)} bytes, the buffer holds {buffer.numel()}")
    out, start = [], 0
    for shape, dtype in specs:
        stop = start + math.prod(shape) * dtype.itemsize
        out.append(buffer[start:stop].view(dtype).view(shape))
        start = stop
    return out


def ring_shift(send: torch.Tensor, layout: DimLayout, recv_numel: int) -> torch.Tensor:
    """Send the flat tensor ``send`` to the next coordinate of ``layout``'s mesh dim; receive the previous one's.

    Args:
        send: a 1-D tensor (any dtype; a `pack_bytes` buffer for several tensors),
            handed to coordinate ``(coord + 1) % parts``.
        layout: the ring: its mesh dim, this rank's coordinate and the group (only
            these are read; its sizes play no part).
        recv_numel: how many elements coordinate ``(coord - 1) % parts`` sends here
            (every rank knows it from shapes all ranks share).

    Returns:
        A new 1-D tensor of ``recv_numel`` elements of ``send``'s dtype and device:
        what the previous coordinate sent. Every rank along the mesh dim must call
        it (one ``all_to_all_single``); on a mesh dim of one rank the buffer comes
        back to its sender (a copy).

    Examples:
        On 2 ranks, the neighbour's coordinate:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> layout = dim_layout(shard_tensor(torch.zeros(4), mesh, [Shard(0)], [2, 2]), 0)
        >>> ring_shift(torch.tensor([layout.coord]), layout, 1).item() == 1 - rank
        True
    """
    if send.ndim != 1:
        raise ValueError(f"ring_shift: send a flat (1-D) tensor, not one of shape {tuple(send.shape)}")
    parts, coord = layout.parts, layout.coord
    with profiled_range("shardext.ring_shift"):
        if parts == 1:
            if recv_numel != send.numel():
                raise ValueError(f"ring_shift: one rank sends {send.numel()} elements to itself, expects {recv_numel}")
            return send.clone()
        in_splits, out_splits = [0] * parts, [0] * parts
        in_splits[layout.group_ranks[(coord + 1) % parts]] = send.numel()
        out_splits[layout.group_ranks[(coord - 1) % parts]] = recv_numel
        return start_all_to_all(send, out_splits, in_splits, layout.group)()
