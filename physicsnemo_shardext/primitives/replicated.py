"""Replicated tensors next to sharded ones: cut them to a shard, and keep their gradients whole.

A plain tensor that meets a ShardTensor (a parameter, a positional embedding, a
coordinate grid, a ``torch.zeros`` buffer) is a *replicated* global value: every
rank holds all of it. ShardTensor promotes it to a ``Replicate`` DTensor before a
handler runs. Two moves connect such values to the sharded world, and both must
respect the rule that a replicated value's gradient is the same, complete sum on
every rank (what an optimizer step and a single-process comparison expect):

* `replicated_part` (replicated -> sharded): keep the rows that line up with
  a ShardTensor's own block, broadcasting like ``torch.add`` does. Each rank's
  gradient then covers only its rows, so the backward pass sums it over the mesh
  dims that shard the ShardTensor. Forward: no communication.
* `gather_full` (sharded -> replicated): all-gather a ShardTensor into a
  plain full tensor. Its gradient arrives complete on every rank (by the rule
  above), so the backward pass keeps this rank's rows without communication.

Examples:
    On 2 ranks, ``x`` of global shape ``(1, 24, 8)`` split 13/11 on dim 1 meets a
    replicated position embedding of the same global shape:

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.primitives import from_local_like
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(24 * 8.0).reshape(1, 24, 8)
    >>> x = shard_tensor(full, mesh, [Shard(1)], [13, 11])
    >>> pos_embed = torch.linspace(0, 1, 24 * 8).reshape(1, 24, 8)
    >>> pos = replicated_part(pos_embed, x)
    >>> tuple(pos.shape) == [(1, 13, 8), (1, 11, 8)][rank]
    True
    >>> y = from_local_like(x.to_local() + pos, x)
    >>> torch.allclose(gather_full(y), full + pos_embed)
    True
"""

from __future__ import annotations

from typing import Any, cast

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Replicate

from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.primitives.checks import is_partial, is_replicated
from physicsnemo_shardext.primitives.layout import build_shard_tensor, sharded_dims, sharding_mesh_dims
from physicsnemo_shardext.primitives.reductions import sum_grad_over
from physicsnemo_shardext.primitives.wrapping import local_of

__all__ = ["elementwise_with_replicated", "gather_full", "replicated_local", "replicated_part"]


def replicated_local(value: Any, what: str) -> Any:
    """A plain, differentiable view of a replicated operand; refuse sharded or partial ones.

    Plain tensors and non-tensors are returned as they are.

    Examples:
        >>> from torch.distributed.tensor import Replicate
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> weight = shard_tensor(torch.ones(3), mesh, [Replicate()])
        >>> replicated_local(weight, "torch.nn.functional.prelu: weight")
        tensor([1., 1., 1.])
        >>> replicated_local(torch.zeros(2), "torch.nn.functional.prelu: weight")
        tensor([0., 0.])
    """
    if isinstance(value, (DTensor, ShardTensor)):  # ShardTensor is not a DTensor subclass
        if not all(p.is_replicate() for p in value.placements):
            raise MissingShardPatch(f"{what}: expected a replicated tensor, got placements {tuple(value.placements)}")
        return local_of(value)
    return value


def replicated_part(value: Any, like: ShardTensor, what: str = "replicated operand") -> torch.Tensor:
    """The rows of a replicated ``value`` that line up with ``like``'s local block, broadcast like ``torch.add``.

    ``value``'s dims are aligned with ``like``'s from the right; a dim of size 1 (or a
    missing one) broadcasts and is kept whole. Any other size must equal ``like``'s
    global size on a sharded dim. The gradient is summed over every mesh dim that
    shards ``like``, because each rank only used (or broadcast over) its own rows.

    Examples:
        On 2 ranks, ``x`` of global shape ``(1, 24, 8)`` split 13/11 on dim 1:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.zeros(1, 24, 8), mesh, [Shard(1)], [13, 11])
        >>> tuple(replicated_part(torch.zeros(1, 24, 8), x).shape) == [(1, 13, 8), (1, 11, 8)][rank]
        True
        >>> tuple(replicated_part(torch.zeros(8), x).shape)
        (8,)
    """
    # Summed before narrowing: each rank's gradient is then zero outside its rows, and the
    # all-reduce adds up same-shaped tensors (the ranks' row counts may differ).
    local = sum_grad_over(replicated_local(value, what), like._spec.mesh, sharding_mesh_dims(like))
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


def elementwise_with_replicated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ShardTensor | None:
    """``func(a, b, ...)`` of sharded ShardTensors and replicated tensors on this rank's rows, or ``None``.

    The sharded operands must be split alike (same mesh, placements, global shape and
    local sizes: ``torch.where(x > 0, x, bias)``, ``torch.addcmul(shift, x, scale)``).
    A replicated operand (a ``Replicate`` ShardTensor such as a target, a promoted
    DTensor, a plain tensor, or a DTensor parameter sharded evenly on the same mesh,
    which is gathered first) is cut to the sharded operands' own rows with
    `replicated_part` (its gradient summed over the shards, so a parameter's gradient
    comes back ``Replicate``, not a pending ``Partial`` sum) and ``func`` runs on the
    local blocks: no communication, any split. Scalars and non-tensor keyword
    arguments pass through. ``None`` where this does not apply, for the caller to
    delegate: fewer than two tensor operands, a tensor keyword argument, a ``Partial``
    operand sharded on some mesh dim, sharded operands split differently, or a result
    that broadcasting enlarges along a sharded dim or gives more dims. A pending sum
    (``Partial``, sharded nowhere: ``x.sum(dim, keepdim=True)``) is summed first.

    Examples:
        On 2 ranks, a prediction split 3/2 minus a replicated target:

        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full, target = torch.arange(10.0).reshape(5, 2), torch.ones(5, 2)
        >>> x = shard_tensor(full, mesh, [Shard(0)], [3, 2])
        >>> y = elementwise_with_replicated(torch.sub, (x, shard_tensor(target, mesh, [Replicate()])), {})
        >>> y.placements, torch.equal(y.full_tensor(), full - target)
        ((Shard(dim=0),), True)
        >>> elementwise_with_replicated(torch.sub, (x, 1.0), {}) is None    # a scalar: not this case
        True
        >>> shift = torch.full((2,), 0.5)
        >>> z = elementwise_with_replicated(torch.addcmul, (shift, x, torch.tensor([1.0, 2.0])), {})
        >>> torch.equal(z.full_tensor(), torch.addcmul(shift, full, torch.tensor([1.0, 2.0])))
        True
    """
    if any(isinstance(value, torch.Tensor) for value in kwargs.values()):
        return None
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if len(positions) < 2:
        return None
    args = _partial_sums_resolved(args, positions)
    shards = [i for i in positions if isinstance(args[i], ShardTensor) and not is_replicated(args[i])]
    if not shards or any(is_partial(args[i]) for i in positions):
        return None
    shard: ShardTensor = args[shards[0]]
    mesh, placements = shard._spec.mesh, tuple(shard._spec.placements)
    for i in shards[1:]:
        other = args[i]
        if (other._spec.mesh, tuple(other._spec.placements), other.shape) != (mesh, placements, shard.shape):
            return None
        if other._spec.sharding_shapes() != shard._spec.sharding_shapes():
            return None
    local_args = list(args)
    for i in positions:
        if i in shards:
            local_args[i] = local_of(args[i])
            continue
        other = args[i]
        if isinstance(other, (ShardTensor, DTensor)) and other.device_mesh != mesh:
            return None
        if isinstance(other, DTensor) and not isinstance(other, ShardTensor) and not is_replicated(other):
            # A spatial parameter sharded evenly (FSDP2's pos_embed as a DTensor) against an
            # activation split another way: gathered whole (parameter-sized), then cut to the
            # shard's rows. Its gradient, summed to a whole replicated one below, goes back to
            # each rank's chunk through the redistribute's own backward.
            other = other.redistribute(other.device_mesh, [Replicate()] * other.device_mesh.ndim)
        if isinstance(other, ShardTensor) and not is_replicated(other):
            return None
        local_args[i] = other
    try:
        out_shape = tuple(torch.broadcast_shapes(*(args[i].shape for i in positions)))  # type: ignore[no-untyped-call]  # torch.broadcast_shapes is unannotated
    except RuntimeError:
        return None
    # Broadcasting may enlarge the sharded operands along their other dims (``x.unsqueeze(-1) *
    # freqs``), never along a sharded one, and may not add dims (their Shard dims would move).
    if len(out_shape) != shard.ndim or any(out_shape[d] != shard.shape[d] for d in sharded_dims(shard)):
        return None
    what = f"{getattr(func, '__name__', func)}: replicated operand"
    for i in positions:
        if i not in shards:
            local_args[i] = replicated_part(local_args[i], shard, what)
    local = func(*local_args, **kwargs)
    sizes = {d: layout.sizes for d, layout in sharded_dims(shard).items()}
    return build_shard_tensor(local, mesh, placements, sizes)


def _partial_sums_resolved(args: tuple[Any, ...], positions: list[int]) -> tuple[Any, ...]:
    """``args`` with each pending sum (a ShardTensor ``Partial`` on some mesh dims, sharded on none) summed.

    Only next to a sharded operand: ``x * x.sum(dim, keepdim=True)`` on rows 5/3 went to the
    DTensor fallback, whose backward sized the blocks as even chunks and failed. The sum is one
    differentiable all-reduce of the (broadcast) operand's size, as the fallback's forward does.
    """

    def pending(a: Any) -> bool:
        return isinstance(a, ShardTensor) and is_partial(a) and not any(p.is_shard() for p in a._spec.placements)

    def sharded(a: Any) -> bool:
        return isinstance(a, ShardTensor) and any(p.is_shard() for p in a._spec.placements) and not is_partial(a)

    if not any(pending(args[i]) for i in positions) or not any(sharded(args[i]) for i in positions):
        return args
    resolved = list(args)
    for i in positions:
        if pending(args[i]):
            a = args[i]
            resolved[i] = a.redistribute(
                a._spec.mesh, [Replicate() if p.is_partial() else p for p in a._spec.placements]
            )
    return tuple(resolved)


def gather_full(x: ShardTensor) -> torch.Tensor:
    """All-gather ``x`` into a plain tensor of its global shape (uneven shards included).

    The gradient flowing back must be replicated (complete and equal on every rank), as
    it is for any tensor computed redundantly on every rank; each rank keeps its rows.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(15.0).reshape(5, 3)
        >>> modes = shard_tensor(full, mesh, [Shard(0)], [4, 1])
        >>> buffer = torch.zeros(5, 4)
        >>> buffer[:, :3] = gather_full(modes)   # a plain buffer now holds the global values
        >>> torch.equal(buffer[:, :3], full)
        True
    """
    if any(p.is_partial() for p in x._spec.placements):
        raise MissingShardPatch(f"gather_full: input has a Partial placement {tuple(x._spec.placements)}")
    return cast(torch.Tensor, x.full_tensor())
