"""roll and flip along sharded dims, moving only the rows whose owner changes.

Without these patches the calls go through the DTensor fallback (an all-gather
of the activation; its backward fails on torch 2.14). Both ops are
permutations of the rows of each dim, so each rank names the global rows its
output needs and `gather_global_indices`
fetches them: rows that stay on their rank are copied locally, the others move
in one ``all_to_all_single`` per sharded dim (none when no row changes rank).
The output keeps the input's placements **and its exact, possibly uneven,
shard sizes**; dims that are not sharded are rolled/flipped locally.

* ``roll``: output row ``i`` is input row ``(i - shift) mod n``; several
  ``shifts``/``dims`` pairs (a dim may repeat: the shifts add up), negative
  shifts and shifts larger than the dim are supported.
* ``flip`` (also ``fliplr`` / ``flipud``): output row ``i`` is input row ``n - 1 - i``.

Delegated (to the DTensor fallback; forward and gradients checked on 2 ranks
against a single process): ``Partial`` inputs (a permutation of a pending sum;
the result stays ``Partial(sum)``) and ``torch.roll`` without ``dims`` (a roll of
the flattened tensor) when a dim is sharded (gathered; result ``Replicate``).

Refused (``MissingShardPatch``): a tensor dim sharded over two mesh dims
(``sharded_dims`` refuses it; the fallback has nothing to take there: PhysicsNeMo
itself cannot build such a ShardTensor, ``ShardTensor.from_dtensor`` raises,
measured on a 2x2 mesh); non-int dims (the fallback fails too: torch itself
raises ``TypeError`` for them).

Examples:
    On 2 ranks, ``x`` of height 7 sharded ``Shard(0)`` 5/2; the outputs keep that split:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(14.0).reshape(7, 2)
    >>> x = shard_tensor(full, mesh, [Shard(0)], [5, 2])
    >>> y = torch.flip(x, [0])   # each rank sends 2 rows (rows 2..4 stay on rank 0)
    >>> tuple(y.to_local().shape) == [(5, 2), (2, 2)][rank], y.placements
    (True, (Shard(dim=0),))
    >>> torch.equal(y.full_tensor(), torch.flip(full, [0]))
    True
    >>> torch.equal(x.roll(3, 0).full_tensor(), full.roll(3, 0))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    delegate,
    describe_target,
    eager_handler,
    from_local_like,
    gather_global_indices,
    is_partial,
    local_of,
    normalize_dim,
    require_shard_input,
    sharded_dims,
)

__all__ = ["FLIP_TARGETS", "ROLL_TARGETS", "sharded_flip", "sharded_roll"]


def _as_tuple(value: Any) -> tuple[Any, ...]:
    """A scalar as a 1-tuple, a sequence (``torch.Size`` included) as a tuple of its own length.

    Not `expand_to`: the length comes from the
    argument itself, and a ``shifts``/``dims`` length mismatch must reach torch's own
    "shifts and dimensions must align" error instead of being broadcast.

    Examples:
        >>> _as_tuple(2), _as_tuple(torch.Size([0, 1]))
        ((2,), (0, 1))
    """
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _roll(input: Any, shifts: Any, dims: Any = None) -> None:
    """Mirror of ``torch.roll``/``Tensor.roll`` (a C builtin) for ``bind_arguments``."""


def _permute_rows(local: torch.Tensor, layout: DimLayout, source_of: Callable[[int], int]) -> torch.Tensor:
    """Output global row ``i`` := input global row ``source_of(i)``, keeping the input's row split."""

    def wanted_by(coord: int) -> list[int]:
        start = layout.offsets[coord]
        return [source_of(i) for i in range(start, start + layout.sizes[coord])]

    return gather_global_indices(local, layout, wanted_by)


ROLL_TARGETS: tuple[Callable[..., Any], ...] = (torch.roll, torch.Tensor.roll)


@eager_handler
def sharded_roll(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """torch.roll of a ShardTensor; sharded dims exchange only the rows that change rank.

    Examples:
        A shift along two dims, one of them sharded 1/2 on 2 ranks:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(6.0).reshape(3, 2)
        >>> z = torch.roll(shard_tensor(full, mesh, [Shard(0)], [1, 2]), shifts=(-1, 1), dims=(0, 1))
        >>> torch.equal(z.full_tensor(), torch.roll(full, (-1, 1), (0, 1)))
        True
    """
    bound = bind_arguments(_roll, args, kwargs)
    x, shifts, dims = bound["input"], bound["shifts"], bound["dims"]
    if is_partial(x):
        return delegate(func, types, args, kwargs)  # a permutation of a pending sum: the fallback is right
    x = require_shard_input(func, x)
    layouts = sharded_dims(x)
    if dims is None or _as_tuple(dims) == ():
        if layouts:
            # A roll of the flattened tensor: the fallback gathers it (right, even and uneven splits).
            return delegate(func, types, args, kwargs)
        return from_local_like(torch.roll(local_of(x), shifts), x)
    shifts, dims = _as_tuple(shifts), _as_tuple(dims)
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    total_shift: dict[int, int] = {}
    for shift, dim in zip(shifts, dims):
        d = normalize_dim(func, dim, x.ndim)
        total_shift[d] = total_shift.get(d, 0) + int(shift)

    local = local_of(x)
    local_dims = [d for d in total_shift if d not in layouts]
    if local_dims:
        local = torch.roll(local, [total_shift[d] for d in local_dims], local_dims)
    else:
        local = local.clone()  # torch.roll never returns a view of its input
    for d in sorted(d for d in total_shift if d in layouts):
        layout = layouts[d]
        n = layout.total
        shift = total_shift[d] % n if n else 0
        if shift:
            local = _permute_rows(local, layout, lambda i, s=shift, n=n: (i - s) % n)
    return from_local_like(local, x)


FLIP_TARGETS: dict[Callable[..., Any], tuple[int, ...] | None] = {
    # target -> fixed dims (None: taken from the arguments)
    torch.flip: None,
    torch.Tensor.flip: None,
    torch.fliplr: (1,),
    torch.Tensor.fliplr: (1,),
    torch.flipud: (0,),
    torch.Tensor.flipud: (0,),
}


def _flip_dims(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The dims of a flip call in any of its spellings; ``Tensor.flip(*dims)`` is varargs,
    which no single signature (hence ``bind_arguments``) describes."""
    fixed = FLIP_TARGETS[func]
    if fixed is not None:
        if len(args) > 1 or kwargs:
            raise TypeError(f"{describe_target(func)}: takes only the input tensor")
        return fixed
    if len(args) > 2:
        # Tensor.flip(*dims) form: x.flip(0, 1)
        return tuple(args[1:])
    if len(args) == 2:
        if kwargs:
            raise TypeError(f"{describe_target(func)}: unexpected arguments {sorted(kwargs)}")
        return _as_tuple(args[1])
    if set(kwargs) != {"dims"}:
        raise TypeError(f"{describe_target(func)}: expected dims, got {sorted(kwargs)}")
    return _as_tuple(kwargs["dims"])


@eager_handler
def sharded_flip(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """torch.flip (fliplr, flipud) of a ShardTensor; rows move to the mirrored position's owner.

    Examples:
        ``fliplr`` of a matrix whose columns are split 3/1 on 2 ranks:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(8.0).reshape(2, 4)
        >>> y = torch.fliplr(shard_tensor(full, mesh, [Shard(1)], [3, 1]))
        >>> torch.equal(y.full_tensor(), torch.fliplr(full))
        True
    """
    if not args:
        raise TypeError(f"{describe_target(func)}: missing the input tensor")
    if is_partial(args[0]):
        return delegate(func, types, args, kwargs)  # a permutation of a pending sum: the fallback is right
    x = require_shard_input(func, args[0])
    if FLIP_TARGETS[func] is not None and x.ndim < FLIP_TARGETS[func][0] + 1:
        raise RuntimeError(f"{describe_target(func)}: input must be >= {FLIP_TARGETS[func][0] + 1}-d")
    dims = [normalize_dim(func, d, x.ndim) for d in _flip_dims(func, args, kwargs)]
    if len(set(dims)) != len(dims):
        raise RuntimeError(f"{describe_target(func)}: dims {dims} has a repeated dim")
    layouts = sharded_dims(x)
    local = local_of(x)
    local_dims = [d for d in dims if d not in layouts]
    local = torch.flip(local, local_dims)  # also the copy when nothing is local
    for d in sorted(d for d in dims if d in layouts):
        layout = layouts[d]
        local = _permute_rows(local, layout, lambda i, n=layout.total: n - 1 - i)
    return from_local_like(local, x)


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare roll and flip handlers."""
    for target in ROLL_TARGETS:
        patches.function(
            target,
            sharded_roll,
            description=f"{describe_target(target)}: rows that change rank move in one all_to_all per sharded dim",
        )
    for target in FLIP_TARGETS:
        patches.function(
            target,
            sharded_flip,
            description=f"{describe_target(target)}: rows move to the owner of the mirrored position",
        )
