"""What a ShardTensor's spec says, read through one door.

PhysicsNeMo keeps a ShardTensor's mesh, placements and per-rank shard shapes in
its private ``_spec`` (a ``ShardTensorSpec``). Families read them through these
accessors only, so that a PhysicsNeMo release that renames or restructures the
spec changes this module, not every family (the family-import test refuses
``._spec`` in ``patches/``).

Code that hands a spec object to DTensor's own functions, or receives one from
them (a wrapped ``redistribute_local_tensor``), takes it with `spec_of`, reads
the per-rank shapes it records with `spec_shard_shapes` and builds a plain
DTensor spec with other placements with `spec_with_placements`.

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

from collections.abc import Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel._shard_tensor_spec import ShardTensorSpec
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = [
    "mesh_of",
    "placements_of",
    "shard_shapes_of",
    "spec_of",
    "spec_shard_shapes",
    "spec_with_placements",
    "tensor_meta_of",
]


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


def spec_of(x: ShardTensor) -> DTensorSpec:
    """The spec object of ``x`` itself, for DTensor functions that take one (`wrap_gradient`'s ``spec``).

    Read what it says with the accessors above; this is only for passing it on.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import wrap_gradient
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.ones(6, 2), mesh, [Shard(0)], [4, 2])
        >>> g = wrap_gradient(torch.zeros((4, 2)[rank], 2), spec_of(x))
        >>> g.placements, tuple(g.shape)
        ((Shard(dim=0),), (6, 2))
    """
    return x._spec  # type: ignore[no-any-return]


def spec_shard_shapes(spec: DTensorSpec) -> dict[int, tuple[torch.Size, ...]] | None:
    """Every rank's local shape by mesh dimension, as ``spec`` records it; ``None`` where it records none.

    A ShardTensor's spec records them (`shard_shapes_of` reads them from the tensor);
    a plain DTensor spec, as DTensor builds it for its own tensors, does not: its
    shards are ``torch.chunk``'s.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.zeros(5, 2), mesh, [Shard(0)], [4, 1])
        >>> [s[0] for s in spec_shard_shapes(spec_of(x))[0]]
        [4, 1]
        >>> spec_shard_shapes(spec_with_placements(spec_of(x), [Shard(0)])) is None
        True
    """
    if isinstance(spec, ShardTensorSpec):
        return spec.sharding_shapes()  # type: ignore[no-any-return]
    return None


def spec_with_placements(spec: DTensorSpec, placements: Sequence[Placement]) -> DTensorSpec:
    """A plain DTensor spec with ``spec``'s mesh and global tensor meta and these ``placements``.

    Recorded per-rank shapes are not carried over (they describe the old placements):
    the result describes ``torch.chunk`` shards, or whole dims where ``placements``
    replicate. For handing a block that now has other placements to DTensor's
    redistribution (an uneven shard gathered to ``Replicate``).

    Examples:
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> spec = spec_of(shard_tensor(torch.zeros(5, 2), mesh, [Shard(0)], [4, 1]))
        >>> replicated = spec_with_placements(spec, [Replicate()])
        >>> replicated.placements, tuple(replicated.shape), replicated.mesh is mesh
        ((Replicate(),), (5, 2), True)
    """
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
