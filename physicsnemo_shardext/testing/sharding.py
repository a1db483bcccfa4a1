"""Shard a full tensor into a ShardTensor, evenly or with chosen (uneven) split sizes.

Every rank holds the same full tensor and keeps its own slice; the
``sharding_shapes`` handed to ``ShardTensor.from_local`` are computed locally
(no communication), because ``sharding_shapes="infer"`` fails on CPU.

Examples:
    Inside a multirank test with a 1-D ``domain_mesh`` of 2 ranks:

    ```python
    from torch.distributed.tensor import Shard
    from physicsnemo_shardext.testing import shard_tensor

    full = torch.randn(1, 3, 17, 8)
    xs = shard_tensor(full, domain_mesh, [Shard(2)], sizes_by_mesh_dim=[10, 7], requires_grad=True)
    assert xs.full_tensor().equal(full)
    ```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor.placement_types import Placement, Shard

if TYPE_CHECKING:
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "SplitSizes",
    "chunk_split_sizes",
    "even_split_sizes",
    "local_slices",
    "normalize_split_sizes",
    "shard_tensor",
    "sharding_shapes_for",
]

#: Split sizes: one list for a 1-D mesh, or ``{mesh_dim: [size per mesh coordinate]}``.
SplitSizes = Sequence[int] | Mapping[int, Sequence[int]] | None


def chunk_split_sizes(size: int, parts: int) -> list[int]:
    """Sizes that ``torch.chunk(t, parts)`` gives along a dim of ``size``, padded with zeros to ``parts``.

    This is also how DTensor's ``Shard`` splits a dimension.

    Examples:
        >>> chunk_split_sizes(17, 2), chunk_split_sizes(5, 4), chunk_split_sizes(8, 4)
        ([9, 8], [2, 2, 1, 0], [2, 2, 2, 2])
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    chunk = -(-size // parts) if size else 0
    sizes, remaining = [], size
    for _ in range(parts):
        take = min(chunk, remaining)
        sizes.append(take)
        remaining -= take
    return sizes


def _shard_dim(placement: Placement, ndim: int) -> int | None:
    if isinstance(placement, Shard):
        return placement.dim % ndim
    return None


#: The name `chunk_split_sizes` had before 0.2, still exported.
even_split_sizes = chunk_split_sizes


def normalize_split_sizes(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    split_sizes: SplitSizes = None,
) -> dict[int, list[int]]:
    """Return ``{mesh_dim: sizes}`` for every sharded mesh dim, filling gaps with even splits.

    Validates that the sizes have one entry per mesh coordinate and add up to the
    tensor dimension.

    Examples:
        >>> normalize_split_sizes((4, 17), (2,), [Shard(1)], [10, 7])
        {0: [10, 7]}
    """
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements for a {len(mesh_shape)}-D mesh")
    if split_sizes is None:
        given: dict[int, Sequence[int]] = {}
    elif isinstance(split_sizes, Mapping):
        given = dict(split_sizes)
    else:
        if len(mesh_shape) != 1:
            raise ValueError("a plain list of split sizes needs a 1-D mesh; pass {mesh_dim: sizes}")
        given = {0: split_sizes}
    ndim = len(shape)
    sharded_tensor_dims: dict[int, int] = {}
    result: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        dim = _shard_dim(placement, ndim)
        if dim is None:
            if mesh_dim in given:
                raise ValueError(f"split sizes given for mesh dim {mesh_dim}, which is not Shard")
            continue
        if dim in sharded_tensor_dims:
            # Nested sharding of one tensor dim over two mesh dims is not supported here.
            raise NotImplementedError(
                f"tensor dim {dim} sharded over mesh dims {sharded_tensor_dims[dim]} and {mesh_dim}"
            )
        sharded_tensor_dims[dim] = mesh_dim
        sizes = list(given.get(mesh_dim, chunk_split_sizes(shape[dim], mesh_shape[mesh_dim])))
        if len(sizes) != mesh_shape[mesh_dim] or sum(sizes) != shape[dim] or min(sizes) < 0:
            raise ValueError(
                f"split sizes {sizes} for mesh dim {mesh_dim} (size {mesh_shape[mesh_dim]}) "
                f"do not partition tensor dim {dim} of size {shape[dim]}"
            )
        result[mesh_dim] = sizes
    return result


def sharding_shapes_for(
    shape: Sequence[int],
    placements: Sequence[Placement],
    sizes: Mapping[int, Sequence[int]],
    coordinate: Sequence[int],
) -> dict[int, list[tuple[int, ...]]]:
    """The explicit ``sharding_shapes`` dict for ``ShardTensor.from_local``.

    Entry ``[mesh_dim][k]`` is the local shape of the rank at coordinate ``k``
    along ``mesh_dim`` and at this rank's ``coordinate`` along every other mesh
    dim (PhysicsNeMo's convention). Only sharded mesh dims appear.

    Examples:
        >>> sharding_shapes_for((4, 6), [Shard(0), Shard(1)], {0: [3, 1], 1: [4, 2]}, (1, 0))
        {0: [(3, 4), (1, 4)], 1: [(1, 4), (1, 2)]}
    """
    ndim = len(shape)
    result: dict[int, list[tuple[int, ...]]] = {}
    for mesh_dim, mesh_sizes in sizes.items():
        shapes = []
        for k in range(len(mesh_sizes)):
            local = list(shape)
            for other_dim, other_sizes in sizes.items():
                tensor_dim = _shard_dim(placements[other_dim], ndim)
                assert tensor_dim is not None  # sizes name Shard mesh dims only (normalize_split_sizes)
                index = k if other_dim == mesh_dim else coordinate[other_dim]
                local[tensor_dim] = other_sizes[index]
            shapes.append(tuple(int(s) for s in local))
        result[mesh_dim] = shapes
    return result


def local_slices(
    shape: Sequence[int],
    placements: Sequence[Placement],
    sizes: Mapping[int, Sequence[int]],
    coordinate: Sequence[int],
) -> list[tuple[int, int, int]]:
    """``(tensor_dim, start, length)`` narrowing steps that cut this rank's shard out of the full tensor.

    Examples:
        >>> local_slices((4, 17), [Shard(1)], {0: [10, 7]}, (1,))
        [(1, 10, 7)]
    """
    ndim = len(shape)
    steps = []
    for mesh_dim, mesh_sizes in sizes.items():
        index = coordinate[mesh_dim]
        tensor_dim = _shard_dim(placements[mesh_dim], ndim)
        assert tensor_dim is not None  # sizes name Shard mesh dims only (normalize_split_sizes)
        steps.append((tensor_dim, sum(mesh_sizes[:index]), mesh_sizes[index]))
    return steps


def local_block(
    full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], sizes: Mapping[int, Sequence[int]]
) -> tuple[torch.Tensor, list[int]]:
    """This rank's block of ``full`` (a detached view) and its mesh coordinate.

    ``sizes`` are normalized split sizes (`normalize_split_sizes`). Raises
    ``RuntimeError`` on a rank outside ``mesh``.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the mesh")
    local = full.detach()
    for dim, start, length in local_slices(full.shape, placements, sizes, coordinate):
        local = local.narrow(dim, start, length)
    return local, list(coordinate)


def shard_tensor(
    full: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sizes_by_mesh_dim: SplitSizes = None,
    *,
    requires_grad: bool = False,
    split_sizes: SplitSizes = None,
) -> ShardTensor:
    """Cut this rank's piece out of ``full`` (identical on all ranks) and wrap it as a ShardTensor.

    Args:
        full: the full tensor, the same on every rank.
        mesh: the device mesh.
        placements: one placement per mesh dim (``Shard(d)`` or ``Replicate()``).
        sizes_by_mesh_dim: ``None`` for even (``torch.chunk``) splits; a list for a 1-D mesh;
            or ``{mesh_dim: [size per coordinate]}``; missing mesh dims split evenly.
        requires_grad: make the result a leaf that requires grad (its ``.grad`` is a ShardTensor).
        split_sizes: the name ``sizes_by_mesh_dim`` had before 0.2, still accepted.

    Returns:
        A ShardTensor whose ``full_tensor()`` equals ``full``.

    Examples:
        On a 2-D mesh, split sizes keyed by mesh dim:

        ```python
        xs = shard_tensor(full, mesh_2d, [Shard(2), Shard(3)], {0: [3, 5], 1: [6, 2]})
        ```
    """
    from physicsnemo.domain_parallel import ShardTensor

    if split_sizes is not None:
        if sizes_by_mesh_dim is not None:
            raise TypeError("shard_tensor: pass sizes_by_mesh_dim or its old name split_sizes, not both")
        sizes_by_mesh_dim = split_sizes
    placements = list(placements)
    sizes = normalize_split_sizes(full.shape, tuple(mesh.shape), placements, sizes_by_mesh_dim)
    local, coordinate = local_block(full, mesh, placements, sizes)
    local = local.contiguous().clone()
    shapes = sharding_shapes_for(full.shape, placements, sizes, coordinate)
    result = ShardTensor.from_local(local, mesh, placements, sharding_shapes=shapes)
    if requires_grad:
        # from_local of a non-grad tensor is a leaf; flag it so `.grad` lands on the ShardTensor.
        result.requires_grad_(True)
    return result
