"""Tests of physicsnemo_shardext/primitives/ring_shift.py: one step of a ring, and the buffers it carries."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from physicsnemo_shardext.primitives import DimLayout, dim_layout
from physicsnemo_shardext.primitives.ring_shift import pack_bytes, packed_nbytes, ring_shift, unpack_bytes
from physicsnemo_shardext.testing import CommCounter, shard_tensor


def _ring(mesh, sizes) -> DimLayout:
    """The layout of a 1-D tensor split as ``sizes`` over ``mesh`` (the ring: coordinates along its one dim)."""
    return dim_layout(shard_tensor(torch.zeros(sum(sizes)), mesh, [Shard(0)], list(sizes)), 0)


def _piece(coord: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What coordinate ``coord`` sends: ``n`` values that name their sender and position."""
    return (100 * (coord + 1) + torch.arange(n)).to(dtype)


def _pieces(coord: int, rows: int) -> list[torch.Tensor]:
    """Tensors of three dtypes and ``rows`` rows (wider dtypes first, as `pack_bytes` asks)."""
    g = torch.Generator().manual_seed(coord)
    return [
        torch.randn(2, rows, 3, dtype=torch.float64, generator=g),
        torch.randn(rows, 5, generator=g),
        torch.rand(rows, 2, generator=g) > 0.5,
    ]


def _specs(rows: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [((2, rows, 3), torch.float64), ((rows, 5), torch.float32), ((rows, 2), torch.bool)]


@pytest.mark.multirank(2)
@pytest.mark.parametrize("sizes", [(5, 2), (0, 3), (4, 0), (3, 3)], ids=["uneven", "first-empty", "last-empty", "even"])
def test_each_rank_receives_what_its_predecessor_sent(domain_mesh, rank, sizes):
    layout = _ring(domain_mesh, sizes)
    assert layout.coord == rank
    previous = (rank - 1) % 2
    send = _piece(rank, sizes[rank])
    with CommCounter() as counter:
        received = ring_shift(send, layout, sizes[previous])
    assert torch.equal(received, _piece(previous, sizes[previous]))
    assert received.dtype == send.dtype and received.ndim == 1
    # One all-to-all that moves exactly this rank's buffer (nothing to itself, nothing else).
    assert counter.stats.counts == {"c10d.alltoall_base_": 1}
    assert counter.stats.total_bytes == send.nbytes


@pytest.mark.multirank(2)
@pytest.mark.parametrize("sizes", [(5, 2), (0, 3)], ids=["uneven", "empty"])
def test_packed_tensors_of_several_dtypes_arrive_as_sent(domain_mesh, rank, sizes):
    layout = _ring(domain_mesh, sizes)
    previous = (rank - 1) % 2
    buffer = pack_bytes(_pieces(rank, sizes[rank]))
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed_nbytes(_specs(sizes[rank]))
    received = ring_shift(buffer, layout, packed_nbytes(_specs(sizes[previous])))
    got = unpack_bytes(received, _specs(sizes[previous]))
    for piece, expected in zip(got, _pieces(previous, sizes[previous]), strict=True):
        assert piece.dtype == expected.dtype and torch.equal(piece, expected)
    # The views share the received buffer: a ring updates a travelling partial in place and sends it on.
    got[0].fill_(1.0)
    assert torch.equal(unpack_bytes(received, _specs(sizes[previous]))[0], torch.ones_like(got[0]))


@pytest.mark.multirank(2)
def test_two_shifts_bring_the_buffer_back_on_two_ranks(domain_mesh, rank):
    sizes = (6, 1)
    layout = _ring(domain_mesh, sizes)
    send = _piece(rank, sizes[rank], torch.int64)
    there = ring_shift(send, layout, sizes[(rank - 1) % 2])
    back = ring_shift(there, layout, sizes[rank])
    assert torch.equal(back, send)


@pytest.mark.multirank(4)
def test_four_ranks_uneven_with_an_empty_coordinate(domain_mesh, rank):
    sizes = (4, 0, 7, 1)
    layout = _ring(domain_mesh, sizes)
    previous = (layout.coord - 1) % 4
    received = ring_shift(_piece(layout.coord, sizes[layout.coord]), layout, sizes[previous])
    assert torch.equal(received, _piece(previous, sizes[previous]))


def test_pack_and_unpack_round_trip_without_ranks():
    pieces = _pieces(0, 3)
    buffer = pack_bytes(pieces)
    assert buffer.numel() == packed_nbytes(_specs(3)) == sum(t.nbytes for t in pieces)
    for got, expected in zip(unpack_bytes(buffer, _specs(3)), pieces, strict=True):
        assert torch.equal(got, expected)
    # A longer buffer (a travelling buffer with room) reads its prefix.
    longer = torch.cat([buffer, torch.zeros(8, dtype=torch.uint8)])
    assert torch.equal(unpack_bytes(longer, _specs(3))[1], pieces[1])
    assert pack_bytes([]).numel() == 0


def test_unpack_refuses_a_buffer_too_short():
    with pytest.raises(ValueError, match="need 12 bytes"):
        unpack_bytes(torch.zeros(8, dtype=torch.uint8), [((3,), torch.float32)])


def test_one_rank_ring_returns_a_copy_and_refuses_flat_mismatch():
    layout = DimLayout(tensor_dim=0, mesh_dim=0, sizes=(3,), coord=0, mesh=None)
    send = torch.arange(3.0)
    back = ring_shift(send, layout, 3)
    assert torch.equal(back, send) and back.data_ptr() != send.data_ptr()
    with pytest.raises(ValueError, match="expects 2"):
        ring_shift(send, layout, 2)
    with pytest.raises(ValueError, match="flat"):
        ring_shift(send.reshape(1, 3), layout, 3)
