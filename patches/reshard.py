"""``ShardTensor.redistribute`` for one mesh dim's move, in one collective that sends only what changes owner.

PhysicsNeMo 2.2's ``ShardTensor.redistribute`` already moves ``Shard(i) ->
Shard(j)`` with one all-to-all and ``Shard(i) -> Replicate`` with one
all-gather, and skips its shape negotiation while the spec's shapes are
current. What it still costs: the all-to-all carries every rank's own piece
through the collective (half the payload on 2 ranks), the all-gather pads
every block to the largest, and each call rebuilds specs and shapes in
Python. This plugin replaces the method with one that serves the moves whose
sizes are known from the spec alone, and hands every other call to the method
it replaced:

* ``Shard(i) -> Shard(j)`` on one mesh dim (``j`` not sharded elsewhere): one
  uneven all-to-all of the pieces that change owner (`move_shard`); the
  destination takes ``torch.chunk``'s sizes, as PhysicsNeMo's does, so the
  result (values, placements, sharding shapes) is the one PhysicsNeMo returns.
* ``Shard(i) -> Replicate``: one all-gather of the true row counts
  (`all_gather_rows`); its backward takes this rank's rows of the gradient.
Each is linear, and its backward is written with `linear_backward`, so second
order gradients work. Every rank decides from placements and recorded sizes
alone, so every rank takes the same path.

Delegated (to PhysicsNeMo's method, unchanged): ``Replicate -> Shard`` (a local
slice either way: measured no faster here), another mesh, a ``Partial`` source, more than one mesh dim changing, a tensor dim sharded by two mesh dims,
a call under a ``torch.compile`` trace (PhysicsNeMo's uses functional
collectives there), and anything PhysicsNeMo refuses itself (a ``Partial``
target, no placements).

Refused (``MissingShardPatch``): nothing. A move this plugin does not serve runs
PhysicsNeMo's method, and that method's own errors come back unchanged.

Examples:
    On 2 ranks, a height split 7 + 3 becomes a width split (chunk sizes 3 + 2):

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(50.0).reshape(1, 10, 5)
    >>> x = shard_tensor(full, mesh, [Shard(1)], [7, 3])
    >>> y = x.redistribute(mesh, [Shard(2)])
    >>> y.placements, [s[2] for s in y._spec.sharding_shapes()[0]], torch.equal(y.full_tensor(), full)
    ((Shard(dim=2),), [3, 2], True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    all_gather_rows,
    build_shard_tensor,
    is_tracing,
    linear_backward,
    local_of,
    mesh_of,
    move_shard,
    placements_of,
    sharded_dims,
)

__all__ = ["chunk_sizes", "fast_redistribute"]


def chunk_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Rows per coordinate that ``torch.chunk(t, parts)`` gives along a dim of ``total`` rows.

    Examples:
        >>> chunk_sizes(10, 4), chunk_sizes(5, 4), chunk_sizes(2, 3)
        ((3, 3, 3, 1), (2, 2, 1, 0), (1, 1, 0))
    """
    step = -(-total // parts) if total else 0
    return tuple(max(0, min(step, total - c * step)) for c in range(parts))


class _Gather(torch.autograd.Function):
    """Forward: every coordinate's rows on every rank; backward: this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, layout: DimLayout, mesh: Any) -> torch.Tensor:
        ctx.maps = _gather_maps(layout, mesh)
        gathered: torch.Tensor = ctx.maps[0](local)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        gather, take = ctx.maps
        return linear_backward(grad, take, gather), None, None


def _gather_maps(
    layout: DimLayout, mesh: Any
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """The pair (gather along the layout's mesh dim, take this coordinate's rows): adjoint to each other."""
    dim, sizes, start = layout.tensor_dim, layout.sizes, sum(layout.sizes[: layout.coord])

    def gather(t: torch.Tensor) -> torch.Tensor:
        return all_gather_rows(t, mesh, layout.mesh_dim, dim, sizes)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(dim, start, sizes[layout.coord]).clone(memory_format=torch.contiguous_format)

    return gather, take


_gather_apply = cast(Callable[..., torch.Tensor], _Gather.apply)  # Function.apply: untyped before torch 2.14


def _normalized(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)


def _sizes_after(layouts: dict[int, DimLayout], drop: int) -> dict[int, tuple[int, ...]]:
    """Rows per coordinate of every sharded dim but ``drop`` (the one the move makes whole or moves)."""
    return {d: layout.sizes for d, layout in layouts.items() if d != drop}


def _serve(x: ShardTensor, placements: tuple[Placement, ...]) -> ShardTensor | None:
    """The moved tensor when this plugin serves the move, else None (the caller delegates)."""
    source = tuple(placements_of(x))
    if len(placements) != len(source) or any(p.is_partial() for p in source + placements):
        return None
    changed = [m for m, (a, b) in enumerate(zip(source, placements)) if a != b]
    if len(changed) != 1:
        return None
    (mesh_dim,) = changed
    old, new = source[mesh_dim], placements[mesh_dim]
    shard_dims = [p.dim for p in source if isinstance(p, Shard)]
    target_dims = [p.dim for p in placements if isinstance(p, Shard)]
    if len(set(shard_dims)) != len(shard_dims) or len(set(target_dims)) != len(target_dims):
        return None  # a dim sharded by two mesh dims
    layouts = sharded_dims(x)
    block = local_of(x)
    if any(block.shape[d] != layout.local_size for d, layout in layouts.items()):
        return None  # a spec that no longer describes the block (an out= write resized it): PhysicsNeMo's call
    mesh = mesh_of(x)
    if isinstance(old, Shard) and isinstance(new, Shard):
        layout = layouts[old.dim]
        dst_sizes = chunk_sizes(x.shape[new.dim], layout.parts)
        local = move_shard(block, layout, new.dim, dst_sizes)
        sizes = _sizes_after(layouts, old.dim)
        sizes[new.dim] = dst_sizes
        return build_shard_tensor(local, mesh, placements, sizes)
    if isinstance(old, Shard) and isinstance(new, Replicate):
        local = _gather_apply(block, layouts[old.dim], mesh)
        return build_shard_tensor(local, mesh, placements, _sizes_after(layouts, old.dim))
    return None


def fast_redistribute(original: Callable[..., ShardTensor]) -> Callable[..., ShardTensor]:
    """Wrap ``ShardTensor.redistribute``: serve one mesh dim's Shard/Replicate move, delegate the rest.

    Examples:
        >>> fast = fast_redistribute(ShardTensor.redistribute)
        >>> fast.__wrapped__ is ShardTensor.redistribute
        True
    """

    @functools.wraps(original)
    def redistribute(
        self: ShardTensor,
        device_mesh: Any = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> ShardTensor:
        mesh = mesh_of(self)
        if placements is not None and (device_mesh is None or device_mesh is mesh) and not is_tracing((self,)):
            moved = _serve(self, _normalized(placements, self.ndim))
            if moved is not None:
                return moved
        return original(self, device_mesh, placements, async_op=async_op)

    return redistribute


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Replace ``ShardTensor.redistribute`` (the current one, restored exactly when the plugin is removed)."""
    patches.replace_attribute(
        ShardTensor,
        "redistribute",
        fast_redistribute(ShardTensor.redistribute),
        reason="one mesh dim's Shard->Shard (one all-to-all of only the rows that change owner) and "
        "Shard->Replicate (one all-gather of the true rows) without rebuilding specs; every other move is delegated",
    )
