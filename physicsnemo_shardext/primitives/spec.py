"""What a ShardTensor's spec says, read through one door.

PhysicsNeMo keeps a ShardTensor's mesh, placements and per-rank shard shapes in
its private ``_spec`` (a ``ShardTensorSpec``). Families read them through these
accessors only, so that a PhysicsNeMo release that renames or restructures the
spec changes this module, not every family (the family-import test refuses
``._spec`` in ``patches/``).

Examples:
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.zeros(1, 3, 17, 4), mesh, [Shard(2)], [10, 7])
    >>> mesh_of(x) is mesh, placements_of(x)
    (True, (Shard(dim=2),))
    >>> [tuple(s) for s in shard_shapes_of(x)[0]]
    [(1, 3, 10, 4), (1, 3, 7, 4)]
    >>> tuple(tensor_meta_of(x).shape)
    (1, 3, 17, 4)
"""

from __future__ import annotations

from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

__all__ = ["mesh_of", "placements_of", "shard_shapes_of", "tensor_meta_of"]


def mesh_of(x: ShardTensor) -> DeviceMesh:
    """The device mesh ``x`` is laid out on (``x.device_mesh``, without the property's overhead).

    Examples:
        >>> from torch.distributed.tensor import Replicate
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> mesh_of(shard_tensor(torch.ones(4), mesh, [Replicate()])) is mesh
        True
    """
    return x._spec.mesh  # type: ignore[no-any-return]


def placements_of(x: ShardTensor) -> tuple[Placement, ...]:
    """The placements of ``x``, one per mesh dimension.

    Examples:
        >>> from torch.distributed.tensor import Replicate
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> placements_of(shard_tensor(torch.ones(4), mesh, [Replicate()]))
        (Replicate(),)
    """
    return tuple(x._spec.placements)


def shard_shapes_of(x: ShardTensor) -> dict[int, tuple[torch.Size, ...]]:
    """Every rank's local shape, by mesh dimension: ``{mesh_dim: (shape on coordinate 0, ...)}``.

    Uneven shards included: the spec carries them, so this needs no communication.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.zeros(5, 2), mesh, [Shard(0)], [4, 1])
        >>> [s[0] for s in shard_shapes_of(x)[0]]
        [4, 1]
    """
    return x._spec.sharding_shapes()  # type: ignore[no-any-return]


def tensor_meta_of(x: ShardTensor) -> Any:
    """The global ``TensorMeta`` (shape, stride, dtype) of ``x``, as DTensor specs carry it.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> tensor_meta_of(shard_tensor(torch.zeros(5, 2), mesh, [Shard(0)], [4, 1])).dtype
        torch.float32
    """
    return x._spec.tensor_meta
