"""Replicated tensors next to sharded ones: cut them to a shard, and keep their gradients whole.

A plain tensor that meets a ShardTensor (a parameter, a positional embedding, a
coordinate grid, a ``torch.zeros`` buffer) is a *replicated* global value: every
rank holds all of it. ShardTensor promotes it to a ``Replicate`` DTensor before a
handler runs. Two moves connect such values to the sharded world, and both must
respect the rule that a replicated value's gradient is the same, complete sum on
every rank (what an optimizer step and a single-process comparison expect):

* :func:`replicated_part` (replicated -> sharded): keep the rows that line up with
  a ShardTensor's own block, broadcasting like ``torch.add`` does. Each rank's
  gradient then covers only its rows, so the backward pass sums it over the mesh
  dims that shard the ShardTensor. Forward: no communication.
* :func:`gather_full` (sharded -> replicated): all-gather a ShardTensor into a
  plain full tensor. Its gradient arrives complete on every rank (by the rule
  above), so the backward pass keeps this rank's rows without communication.

Example (2 ranks, ``x`` of global shape ``(1, 24, 8)`` split 13/11 on dim 1)::

    pos = replicated_part(pos_embed, x)   # pos_embed (1, 24, 8) -> this rank's 13 or 11 rows
    y = from_local_like(x.to_local() + pos, x)
    full = gather_full(x)                 # (1, 24, 8) on every rank
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.primitives.layout import sharded_dims

__all__ = ["gather_full", "replicated_local", "replicated_part", "sum_grad_over", "sum_to_replicated"]


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over the given mesh dims."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.mesh_dims = mesh, mesh_dims
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        for mesh_dim in ctx.mesh_dims:
            dist.all_reduce(grad, group=ctx.mesh.get_group(mesh_dim))
        return grad, None, None


def sum_grad_over(value: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """``value`` unchanged; in backward its gradient is summed over ``mesh_dims`` (one all-reduce each).

    Use it on a replicated operand that each rank applies to its own rows only.

    Example::

        w = sum_grad_over(weight, x._spec.mesh, [layout.mesh_dim for layout in sharded_dims(x).values()])
    """
    if not mesh_dims:
        return value
    return _SumGradOver.apply(value, mesh, tuple(mesh_dims))


class _SumToReplicated(torch.autograd.Function):
    """All-reduce (sum) forward over the given mesh dims; identity backward."""

    @staticmethod
    def forward(ctx: Any, addend: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> torch.Tensor:
        total = addend.contiguous().clone()
        for mesh_dim in mesh_dims:
            dist.all_reduce(total, group=mesh.get_group(mesh_dim))
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def sum_to_replicated(addend: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """The sum of every rank's ``addend`` over ``mesh_dims``, the same on each rank; identity in backward.

    Right where the total is a *replicated* value (a loss every rank holds whole and
    calls ``backward`` on with the same cotangent): each rank's addend then receives
    that cotangent unchanged, and the ranks together cover every term exactly once.
    Forward: one all-reduce per mesh dim.

    Example::

        loss = sum_to_replicated(local_terms.sum(), x._spec.mesh, [0])   # global sum on every rank
    """
    if not mesh_dims:
        return addend
    return _SumToReplicated.apply(addend, mesh, tuple(mesh_dims))


def replicated_local(value: Any, what: str) -> Any:
    """A plain, differentiable view of a replicated operand; refuse sharded or partial ones.

    Plain tensors and non-tensors are returned as they are.

    Example::

        weight = replicated_local(weight, "torch.nn.functional.prelu: weight")
    """
    if isinstance(value, (DTensor, ShardTensor)):  # ShardTensor is not a DTensor subclass
        if not all(p.is_replicate() for p in value.placements):
            raise MissingShardPatch(f"{what}: expected a replicated tensor, got placements {tuple(value.placements)}")
        return value.to_local()
    return value


def _shard_mesh_dims(like: ShardTensor) -> list[int]:
    return sorted(layout.mesh_dim for layout in sharded_dims(like).values())


def replicated_part(value: Any, like: ShardTensor, what: str = "replicated operand") -> torch.Tensor:
    """The rows of a replicated ``value`` that line up with ``like``'s local block, broadcast like ``torch.add``.

    ``value``'s dims are aligned with ``like``'s from the right; a dim of size 1 (or a
    missing one) broadcasts and is kept whole. Any other size must equal ``like``'s
    global size on a sharded dim. The gradient is summed over every mesh dim that
    shards ``like``, because each rank only used (or broadcast over) its own rows.

    >>> # 2 ranks, x (1, 24, 8) split 13/11 on dim 1; on rank 1:
    >>> # replicated_part(torch.zeros(1, 24, 8), x).shape == (1, 11, 8)
    >>> # replicated_part(torch.zeros(8), x).shape == (8,)
    """
    # Summed before narrowing: each rank's gradient is then zero outside its rows, and the
    # all-reduce adds up same-shaped tensors (the ranks' row counts may differ).
    local = sum_grad_over(replicated_local(value, what), like._spec.mesh, _shard_mesh_dims(like))
    offset = like.ndim - local.ndim
    if offset < 0:
        raise MissingShardPatch(f"{what}: {local.ndim} dims do not broadcast against a {like.ndim}-dim ShardTensor")
    for dim, layout in sharded_dims(like).items():
        own_dim = dim - offset
        if own_dim < 0 or local.shape[own_dim] == 1:
            continue
        if local.shape[own_dim] != layout.total:
            raise MissingShardPatch(
                f"{what}: size {local.shape[own_dim]} on dim {own_dim} does not match the sharded dim {dim} "
                f"of size {layout.total}"
            )
        local = local.narrow(own_dim, layout.start, layout.local_size)
    return local


def gather_full(x: ShardTensor) -> torch.Tensor:
    """All-gather ``x`` into a plain tensor of its global shape (uneven shards included).

    The gradient flowing back must be replicated (complete and equal on every rank), as
    it is for any tensor computed redundantly on every rank; each rank keeps its rows.

    Example::

        buffer[:, :, :4] = gather_full(modes)     # a plain buffer now holds the global modes
    """
    if any(p.is_partial() for p in x._spec.placements):
        raise MissingShardPatch(f"gather_full: input has a Partial placement {tuple(x._spec.placements)}")
    return x.full_tensor()
