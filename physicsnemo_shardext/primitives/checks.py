"""Argument checks that shard patches share: a usable sharded input, an integer dim.

Each raises ``MissingShardPatch`` (or ``IndexError`` for an out-of-range dim, as
torch does) with the op's name, so a refused call says which op and why.

Examples:
    >>> import torch
    >>> normalize_dim(torch.roll, -1, 4)
    3
    >>> normalize_dim(torch.roll, "h", 4)
    Traceback (most recent call last):
    ...
    physicsnemo.domain_parallel.shard_utils.patch_core.MissingShardPatch: torch.roll: dim='h' is not supported on ShardTensor (an int dim is)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor

from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.targets import describe_target

__all__ = ["is_partial", "is_replicated", "normalize_dim", "refuse_untracked_view_update", "require_shard_input"]


def is_partial(x: Any) -> bool:
    """Whether ``x`` is a ShardTensor or DTensor with a ``Partial`` placement (a pending sum over ranks).

    The gate for handlers that hand partial sums to the handler they replaced:

    Examples:
        >>> import torch
        >>> from torch.distributed.tensor import Partial, Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> is_partial(shard_tensor(torch.zeros(4), mesh, [Shard(0)], [3, 1]))
        False
        >>> is_partial(ShardTensor.from_local(torch.zeros(4), mesh, [Partial()], sharding_shapes={}))
        True
        >>> is_partial(torch.zeros(4))
        False
    """
    placements: Any = getattr(x, "placements", None) if isinstance(x, (ShardTensor, DTensor)) else None
    return bool(placements) and any(p.is_partial() for p in placements)


def is_replicated(x: Any) -> bool:
    """Whether ``x`` is a ShardTensor or DTensor whose every placement is ``Replicate`` (a whole copy per rank).

    Such an operand (a target scattered with ``Replicate``, a promoted weight) meets a
    sharded one by being cut to its rows (`replicated_part`), not by comparing splits.

    Examples:
        >>> import torch
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> is_replicated(shard_tensor(torch.zeros(4), mesh, [Replicate()]))
        True
        >>> is_replicated(shard_tensor(torch.zeros(4), mesh, [Shard(0)], [3, 1])), is_replicated(torch.zeros(4))
        (False, False)
    """
    placements: Any = getattr(x, "placements", None) if isinstance(x, (ShardTensor, DTensor)) else None
    return bool(placements) and all(p.is_replicate() for p in placements)


def require_shard_input(func: Callable[..., Any], x: Any, why_partial: str = "") -> ShardTensor:
    """``x`` if it is a ShardTensor without ``Partial`` placements; else refuse naming ``func``.

    ``why_partial`` adds the op-specific reason a partial sum cannot be used.

    Examples:
        >>> import torch
        >>> from torch.distributed.tensor import Partial, Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.zeros(4), mesh, [Shard(0)], [3, 1])
        >>> require_shard_input(torch.flip, x) is x
        True
        >>> require_shard_input(torch.flip, torch.zeros(4))
        Traceback (most recent call last):
        ...
        physicsnemo.domain_parallel.shard_utils.patch_core.MissingShardPatch: torch.flip: the sharded tensor must be the input (got Tensor)
    """
    name = describe_target(func)
    if not isinstance(x, ShardTensor):
        raise MissingShardPatch(f"{name}: the sharded tensor must be the input (got {type(x).__name__})")
    if is_partial(x):
        reason = f" ({why_partial})" if why_partial else ""
        raise MissingShardPatch(
            f"{name}: input has a Partial placement {tuple(x._spec.placements)}; "
            f"redistribute to Shard/Replicate first{reason}"
        )
    return x


def normalize_dim(func: Callable[..., Any], dim: Any, ndim: int) -> int:
    """``dim`` as a non-negative int for an ``ndim``-d tensor; named dims are refused."""
    name = describe_target(func)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise MissingShardPatch(f"{name}: dim={dim!r} is not supported on ShardTensor (an int dim is)")
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"{name}: dim {dim} out of range for a {ndim}-d tensor")
    return dim % size


def refuse_untracked_view_update(func: Callable[..., Any], x: Any) -> None:
    """Refuse an in-place update of ``x`` when it is a view autograd does not know of, in a graph being built.

    A handler that returns a view (``t[1:3]``, ``t.transpose(0, 2)``) wraps a view of the
    local block in a new ShardTensor: the values share storage with ``t``, but autograd
    sees a fresh tensor, not a view of ``t``. An in-place op on it then changes ``t``'s
    values without rebasing ``t``'s history, and ``t``'s gradient is silently wrong.
    Outside autograd (no grad mode, nothing requiring grad) the update is right, and
    passes; so does one on a view autograd tracks (made at dispatch level).

    Examples:
        >>> import torch
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> t = shard_tensor(torch.ones(4, 6), mesh, [Shard(1)], [4, 2], requires_grad=True) * 1.0
        >>> view = t.transpose(0, 1)
        >>> try:
        ...     refuse_untracked_view_update(torch.Tensor.mul_, view)
        ... except MissingShardPatch as error:
        ...     print(str(error).split(";")[0])
        torch.Tensor.mul_: in-place update of a view that a shard patch made (autograd would miss the update of its base)
        >>> with torch.no_grad():
        ...     refuse_untracked_view_update(torch.Tensor.mul_, view)   # nothing to differentiate: allowed
    """
    if not isinstance(x, ShardTensor) or not (x.requires_grad and torch.is_grad_enabled()):
        return
    if x._is_view() or x._local_tensor._base is None:
        return
    raise MissingShardPatch(
        f"{describe_target(func)}: in-place update of a view that a shard patch made (autograd would miss the "
        "update of its base); write it out of place (y = t * 2, torch.cat, or index_put on the base)"
    )
