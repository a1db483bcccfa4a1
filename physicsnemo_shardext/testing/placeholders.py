"""Fixture values that only exist on a rank: picklable placeholders and their materialization.

In the pytest process a multirank fixture such as ``domain_mesh`` returns a
`RankValue` placeholder; the worker that runs the test body replaces it
with the real object (`materialize`). Under ``torchrun`` the fixtures
call `build` directly.

Examples:
    >>> RankValue("world_size")
    RankValue(kind='world_size')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MESH_LAYOUTS", "MIN_WORLD_SIZE", "RankValue", "build", "materialize", "mesh_for", "mesh_shape"]

#: Mesh fixtures: name -> (dim names, shape as a function of the world size).
MESH_LAYOUTS: dict[str, tuple[tuple[str, ...], Any]] = {
    "domain_mesh": (("domain",), lambda ws: (ws,)),
    "ddp_domain_mesh": (("ddp", "domain"), lambda ws: (2, ws // 2)),
    "spatial_mesh": (("h", "w"), lambda ws: (2, ws // 2)),
}

#: The smallest (even) world size each 2-D mesh fixture accepts. ``spatial_mesh`` is
#: ``(2, 1)`` on 2 ranks: still a 2-D mesh (``[Shard(H), Shard(W)]`` with W whole on
#: each rank), so 2-D code paths run under ``torchrun --nproc-per-node 2`` too.
#: ``ddp_domain_mesh`` keeps a real domain group (at least 2 ranks per ``ddp`` slice).
MIN_WORLD_SIZE: dict[str, int] = {"ddp_domain_mesh": 4, "spatial_mesh": 2}

_mesh_cache: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}


@dataclass(frozen=True)
class RankValue:
    """Placeholder for a value that the rank creates itself (``kind`` names it)."""

    kind: str


def mesh_for(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A CPU/GPU ``DeviceMesh`` of ``shape`` with ``names``, created once per process.

    Creating a mesh is collective, but every rank runs the same tests in the same
    order, so every rank creates (and caches) the same meshes in the same order.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), tuple(names))
    if key not in _mesh_cache:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        _mesh_cache[key] = init_device_mesh(device, key[0], mesh_dim_names=key[1])
    return _mesh_cache[key]


def mesh_shape(kind: str, world_size: int) -> tuple[int, ...]:
    """The shape of mesh fixture ``kind`` on ``world_size`` ranks (2-D meshes: ``(2, N/2)``, N even).

    Examples:
        >>> mesh_shape("spatial_mesh", 2), mesh_shape("spatial_mesh", 4), mesh_shape("domain_mesh", 3)
        ((2, 1), (2, 2), (3,))
        >>> mesh_shape("ddp_domain_mesh", 2)
        Traceback (most recent call last):
        ...
        ValueError: ddp_domain_mesh needs an even world size >= 4, got 2
    """
    shape = tuple(MESH_LAYOUTS[kind][1](world_size))
    minimum = MIN_WORLD_SIZE.get(kind, 1)
    if len(shape) == 2 and (world_size % 2 or world_size < minimum):
        raise ValueError(f"{kind} needs an even world size >= {minimum}, got {world_size}")
    return shape


def build(kind: str, registry: Any = None) -> Any:
    """Create the real value for ``kind`` on this rank (process group already initialized)."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    if kind == "rank":
        return dist.get_rank()
    if kind == "world_size":
        return world_size
    if kind == "registry_sandbox":
        return registry
    if kind in MESH_LAYOUTS:
        return mesh_for(mesh_shape(kind, world_size), MESH_LAYOUTS[kind][0])
    raise KeyError(f"unknown rank value {kind!r}")


def materialize(kwargs: dict[str, Any], registry: Any = None) -> dict[str, Any]:
    """Replace top-level `RankValue` placeholders in a test's arguments by real objects."""
    return {
        name: build(value.kind, registry) if isinstance(value, RankValue) else value for name, value in kwargs.items()
    }
