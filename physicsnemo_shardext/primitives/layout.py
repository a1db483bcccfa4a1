"""Where a ShardTensor's rows live: per-dimension layouts of (possibly uneven) shards.

A patch that works along one sharded tensor dimension needs to know, for that
dimension, how many rows every rank along the mesh dimension holds, where its
own rows start in the global tensor, and which process group connects those
ranks. `DimLayout` gathers exactly that from a ShardTensor's spec, without
communication: the spec already carries every shard's shape.

Examples:
    On 2 ranks, height 17 split 10/7:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.arange(68.0).reshape(1, 1, 17, 4), mesh, [Shard(2)], [10, 7])
    >>> layout = dim_layout(x, 2)
    >>> layout.sizes, layout.coord == rank, layout.stop - layout.start == (10, 7)[rank]
    ((10, 7), True, True)
    >>> y = from_local_like(x.to_local() * 2, x)       # same row split as x
    >>> torch.equal(y.full_tensor(), 2 * x.full_tensor())
    True
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.primitives.compilation import outside_trace
from physicsnemo_shardext.primitives.wrapping import wrap_local

__all__ = [
    "DimLayout",
    "build_shard_tensor",
    "dim_layout",
    "from_local_like",
    "sharded_dims",
    "sharding_mesh_dims",
    "split_rows_by_owner",
]


@dataclass(frozen=True)
class DimLayout:
    """How one tensor dimension is split over one mesh dimension.

    Attributes:
        tensor_dim: the (non-negative) tensor dimension.
        mesh_dim: the mesh dimension that shards it.
        sizes: rows held by each coordinate along ``mesh_dim``, in coordinate order.
        coord: this rank's coordinate along ``mesh_dim``.
        mesh: the device mesh.

    Examples:
        >>> layout = DimLayout(tensor_dim=2, mesh_dim=0, sizes=(10, 7), coord=1, mesh=None)
        >>> layout.offsets, layout.start, layout.stop, layout.total, layout.local_size
        ((0, 10), 10, 17, 17, 7)
        >>> layout.owner_of(12), layout.owner_of(3)
        (1, 0)
    """

    tensor_dim: int
    mesh_dim: int
    sizes: tuple[int, ...]
    coord: int
    mesh: DeviceMesh | None

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Global index of the first row of each coordinate."""
        starts, running = [], 0
        for size in self.sizes:
            starts.append(running)
            running += size
        return tuple(starts)

    @property
    def start(self) -> int:
        """Global index of this rank's first row."""
        return self.offsets[self.coord]

    @property
    def stop(self) -> int:
        """One past the global index of this rank's last row."""
        return self.start + self.sizes[self.coord]

    @property
    def total(self) -> int:
        """Global length of the dimension."""
        return sum(self.sizes)

    @property
    def local_size(self) -> int:
        """Rows this rank holds."""
        return self.sizes[self.coord]

    @property
    def parts(self) -> int:
        """Number of coordinates along the mesh dimension."""
        return len(self.sizes)

    def owner_of(self, index: int) -> int:
        """Coordinate holding global row ``index`` (0 <= index < total); empty shards own nothing."""
        if not 0 <= index < self.total:
            raise IndexError(f"row {index} outside a dimension of length {self.total}")
        for coord in range(self.parts - 1, -1, -1):
            if self.sizes[coord] and self.offsets[coord] <= index:
                return coord
        raise AssertionError("unreachable: a non-empty dimension has an owner for every row")

    @property
    def group(self) -> dist.ProcessGroup:
        """Process group of the ranks along ``mesh_dim`` (this rank included)."""
        assert self.mesh is not None, "a layout without a mesh has no process group"
        return self.mesh.get_group(self.mesh_dim)

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """Group rank of each coordinate (the group's rank order need not be the mesh order)."""
        assert self.mesh is not None, "a layout without a mesh has no process group"
        return _group_ranks(self.mesh, self.mesh_dim, tuple(self.mesh.get_coordinate() or ()))


@functools.lru_cache(maxsize=256)
def _group_ranks(mesh: DeviceMesh, mesh_dim: int, coordinate: tuple[int, ...]) -> tuple[int, ...]:
    """Group rank of each coordinate along ``mesh_dim``; cached (reading the mesh's rank grid is slow)."""
    group = mesh.get_group(mesh_dim)
    coords = list(coordinate)
    globals_along_dim = []
    with outside_trace():  # first asked inside a trace: the rank grid is a real tensor
        for c in range(mesh.size(mesh_dim)):
            coords[mesh_dim] = c
            globals_along_dim.append(int(mesh.mesh[tuple(coords)].item()))
    return tuple(dist.get_group_rank(group, g) for g in globals_along_dim)


atexit.register(_group_ranks.cache_clear)  # holds meshes: release them before interpreter teardown


def _mesh_dims_by_tensor_dim(placements: Sequence[Placement], ndim: int) -> dict[int, list[int]]:
    """tensor dim -> mesh dims that shard it."""
    by_dim: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            by_dim.setdefault(placement.dim % ndim, []).append(mesh_dim)
    return by_dim


def sharded_dims(x: ShardTensor) -> dict[int, DimLayout]:
    """Layouts of every sharded tensor dimension of ``x``, keyed by tensor dimension.

    Raises ``MissingShardPatch`` if a tensor dimension is sharded over more than
    one mesh dimension (nested sharding), which no layout here describes.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.zeros(1, 3, 17, 4), mesh, [Shard(2)], [10, 7])
        >>> {d: layout.sizes for d, layout in sharded_dims(x).items()}
        {2: (10, 7)}
    """
    spec = x._spec
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    shapes = spec.sharding_shapes()
    layouts: dict[int, DimLayout] = {}
    for tensor_dim, mesh_dims in _mesh_dims_by_tensor_dim(spec.placements, x.ndim).items():
        if len(mesh_dims) > 1:
            raise MissingShardPatch(
                f"tensor dim {tensor_dim} is sharded over mesh dims {mesh_dims} at once "
                f"(placements {tuple(spec.placements)}); nested sharding of one dim is not supported"
            )
        (mesh_dim,) = mesh_dims
        sizes = tuple(int(shape[tensor_dim]) for shape in shapes[mesh_dim])
        layouts[tensor_dim] = DimLayout(tensor_dim, mesh_dim, sizes, coordinate[mesh_dim], mesh)
    return layouts


def dim_layout(x: ShardTensor, tensor_dim: int) -> DimLayout | None:
    """Layout of ``tensor_dim`` of ``x``, or ``None`` if that dimension is not sharded.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.zeros(1, 3, 17, 4), mesh, [Shard(2)], [10, 7])
        >>> dim_layout(x, -2).tensor_dim, dim_layout(x, 3)     # negative dims are normalized
        (2, None)
    """
    return sharded_dims(x).get(tensor_dim % x.ndim)


def build_shard_tensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sizes_by_tensor_dim: Mapping[int, Sequence[int]],
) -> ShardTensor:
    """Wrap ``local`` as a ShardTensor whose sharded dims have the given per-coordinate row counts.

    ``sizes_by_tensor_dim`` maps each sharded tensor dim to its row count per coordinate; the
    other dimensions of every shard in a group equal ``local``'s (ranks along one
    mesh dim share their coordinates on the others). No communication.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> local = torch.ones(1, 1, (10, 7)[rank], 4)
        >>> x = build_shard_tensor(local, mesh, [Shard(2)], {2: [10, 7]})
        >>> tuple(x.shape), dim_layout(x, 2).sizes
        ((1, 1, 17, 4), (10, 7))
    """
    local_shape = tuple(local.shape)
    sharding_shapes: dict[int, tuple[tuple[int, ...], ...]] = {}
    for tensor_dim, mesh_dims in _mesh_dims_by_tensor_dim(placements, local.ndim).items():
        if len(mesh_dims) > 1:
            raise MissingShardPatch(f"nested sharding of tensor dim {tensor_dim} over mesh dims {mesh_dims}")
        sizes = [int(s) for s in sizes_by_tensor_dim[tensor_dim]]
        (mesh_dim,) = mesh_dims
        if len(sizes) != mesh.size(mesh_dim):
            raise ValueError(f"dim {tensor_dim}: {len(sizes)} sizes for a mesh dim of size {mesh.size(mesh_dim)}")
        coord = mesh.get_coordinate()[mesh_dim]  # type: ignore[index]  # this rank is in the mesh
        if sizes[coord] != local_shape[tensor_dim]:
            raise ValueError(
                f"dim {tensor_dim}: this rank (coordinate {coord}) holds {local_shape[tensor_dim]} rows, "
                f"sizes say {sizes[coord]}"
            )
        sharding_shapes[mesh_dim] = tuple(
            local_shape[:tensor_dim] + (size,) + local_shape[tensor_dim + 1 :] for size in sizes
        )
    return wrap_local(local, mesh, placements, sharding_shapes)


def from_local_like(
    local: torch.Tensor,
    like: ShardTensor,
    sizes_by_tensor_dim: Mapping[int, Sequence[int]] | None = None,
    placements: Sequence[Placement] | None = None,
) -> ShardTensor:
    """Wrap ``local`` with ``like``'s mesh and placements; row counts from ``like`` unless overridden.

    Use it when an op keeps the sharded dims (possibly changing their lengths,
    given per tensor dim in ``sizes_by_tensor_dim``) and changes only local dims
    (channels, batch...).

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.linspace(-1, 1, 17 * 4).reshape(1, 1, 17, 4), mesh, [Shard(2)], [10, 7])
        >>> y = from_local_like(torch.relu(x.to_local()), x)
        >>> torch.equal(y.full_tensor(), torch.relu(x.full_tensor()))
        True
        >>> z = from_local_like(x.to_local()[:, :, ::2], x, sizes_by_tensor_dim={2: [5, 4]})   # output rows
        >>> tuple(z.shape)
        (1, 1, 9, 4)
    """
    placements = tuple(like._spec.placements if placements is None else placements)
    sizes = {d: layout.sizes for d, layout in sharded_dims(like).items()}
    sizes.update({d % local.ndim: tuple(s) for d, s in (sizes_by_tensor_dim or {}).items()})
    return build_shard_tensor(local, like._spec.mesh, placements, sizes)


def sharding_mesh_dims(x: ShardTensor) -> list[int]:
    """The mesh dims on which ``x`` is ``Shard``, in order: where a replicated operand's gradient is summed.

    Examples:
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> sharding_mesh_dims(shard_tensor(torch.zeros(4, 6), mesh, [Shard(1)], [3, 3]))
        [0]
        >>> sharding_mesh_dims(shard_tensor(torch.zeros(4, 6), mesh, [Replicate()]))
        []
    """
    return [mesh_dim for mesh_dim, p in enumerate(x._spec.placements) if isinstance(p, Shard)]


def split_rows_by_owner(layout: DimLayout, anchors: Sequence[int]) -> list[tuple[int, int]]:
    """Output rows per coordinate: row ``j`` goes to the owner of input row ``anchors[j]`` (non-decreasing).

    Examples:
        >>> split_rows_by_owner(DimLayout(0, 0, (3, 0, 2), 0, None), [0, 2, 2, 4])
        [(0, 3), (3, 3), (3, 4)]
    """
    counts = [0] * layout.parts
    for anchor in anchors:
        counts[layout.owner_of(anchor)] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges
