"""F.pad on sharded dims: circular (periodic), reflect, replicate and constant padding.

PhysicsNeMo 2.2.2 pads a sharded dim only on the ranks at the global boundary,
using their *local* rows. That is right for ``"constant"`` but refuses
``"circular"``, and for ``"reflect"``/``"replicate"`` it silently uses the wrong
rows when a boundary shard is smaller than the pad (or empty). Here every
non-constant mode is one row exchange per padded sharded dim: output row ``j``
of the global result is a copy of global input row ``src(j - left)``, where

* circular:  ``src(q) = q mod N`` (periodic boundaries, e.g. longitude);
* reflect:   ``src(q) = -q`` below 0, ``2(N-1) - q`` above ``N-1``;
* replicate: ``src(q) = clamp(q, 0, N-1)``;

and `gather_global_indices` brings each
rank exactly the rows it lacks (pads wider than a tiny neighbour shard work:
rows come from whichever rank owns them). Pads on several sharded dims (2-D
mesh) are applied one dim after the other; these modes are separable, so the
corners match a single global ``F.pad``.

Output layout: the first coordinate along a padded sharded dim grows by
``left`` rows and the last by ``right`` (uneven results are expected); unsharded
dims are padded locally. Complex tensors are exchanged as their real view.

Constant mode needs no communication. With non-negative pads every rank pads its
block locally, in one ``F.pad``; a padded sharded dim takes the balanced split
where every rank's rows already fall inside its balanced range (an empty rank then
holds padding), else the first coordinate takes the left pad and the last the
right one, as PhysicsNeMo's built-in does. Negative constant pads (cropping) on
sharded dims: each rank keeps the part of its rows that survives the crop, so a
crop wider than a boundary shard is fine.

Delegated to the built-in (`delegate`):
``Partial`` inputs with zero constant, reflect or replicate padding (linear in the
input: the built-in pads each rank's term; checked on 2 ranks, values and gradients).

Refused (``MissingShardPatch``): ``Partial`` inputs with a non-zero constant (it
would be added once per rank) or circular padding (the built-in has none);
negative pads along a sharded dim with a non-constant mode. Invalid pads (reflect ``>= N``, circular
``> N``, wrong pad length for the mode) raise torch's own error, checked on the
global shape.

Examples:
    On 2 ranks (``mesh``, ``rank``), longitude sharded 10/7; a circular pad of 2 grows the boundary shards:

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(2 * 17, dtype=torch.float32).reshape(1, 1, 2, 17)
    >>> y = F.pad(shard_tensor(full, mesh, [Shard(3)], [10, 7]), (2, 2, 0, 0), mode="circular")
    >>> tuple(y.to_local().shape) == [(1, 1, 2, 12), (1, 1, 2, 9)][rank]    # global width 21
    True
    >>> torch.equal(y.full_tensor(), F.pad(full, (2, 2, 0, 0), mode="circular"))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    balanced_split_sizes,
    bind_arguments,
    connected_zeros,
    delegate,
    eager_handler,
    from_local_like,
    gather_global_indices,
    is_partial,
    local_of,
    meta_output_shape,
    placements_of,
    sharded_dims,
)

__all__ = ["pad_source_rows", "sharded_pad"]

_EXCHANGE_MODES = ("circular", "reflect", "replicate")


def pad_source_rows(mode: str, total: int, left: int, out_rows: Sequence[int]) -> list[int]:
    """Global input row that each global output row of a padded dim copies.

    Examples:
        >>> pad_source_rows("circular", 5, 2, range(9))
        [3, 4, 0, 1, 2, 3, 4, 0, 1]
        >>> pad_source_rows("reflect", 5, 2, range(9))
        [2, 1, 0, 1, 2, 3, 4, 3, 2]
        >>> pad_source_rows("replicate", 5, 2, range(9))
        [0, 0, 0, 1, 2, 3, 4, 4, 4]
    """
    sources = []
    for j in out_rows:
        q = j - left
        if mode == "circular":
            sources.append(q % total)
        elif mode == "reflect":
            sources.append(-q if q < 0 else (2 * (total - 1) - q if q >= total else q))
        elif mode == "replicate":
            sources.append(min(max(q, 0), total - 1))
        else:
            raise ValueError(f"no row mapping for padding mode {mode!r}")
    return sources


def _pad(input: Any, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> None:
    """The parameters of ``F.pad`` (mirrored: in some torch versions it is a C builtin without a signature)."""


def _pads_by_dim(pad: Sequence[int], ndim: int) -> dict[int, tuple[int, int]]:
    """F.pad's flat (last dim first) pad tuple as {tensor dim: (left, right)}."""
    return {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}


def _flat_pad(pads: dict[int, tuple[int, int]], ndim: int, count: int) -> tuple[int, ...]:
    """Inverse of `_pads_by_dim` for ``count`` trailing dims."""
    flat: list[int] = []
    for i in range(count):
        flat.extend(pads.get(ndim - 1 - i, (0, 0)))
    return tuple(flat)


def _exchange_pad(
    local: torch.Tensor, layout: DimLayout, mode: str, left: int, right: int
) -> tuple[torch.Tensor, list[int]]:
    """Pad one sharded dim by fetching the source rows of this rank's output rows; returns (local, sizes)."""
    sizes = list(layout.sizes)
    sizes[0] += left
    sizes[-1] += right
    starts = [sum(sizes[:c]) for c in range(layout.parts)]

    def wanted_by(coord: int) -> list[int]:
        return pad_source_rows(mode, layout.total, left, range(starts[coord], starts[coord] + sizes[coord]))

    if local.is_complex():  # the exchange moves real data: complex travels as (..., 2) reals
        real = gather_global_indices(torch.view_as_real(local), layout, wanted_by)
        return torch.view_as_complex(real.contiguous()), sizes
    return gather_global_indices(local, layout, wanted_by), sizes


def _constant_split(layout: DimLayout, left: int, right: int) -> tuple[list[int], tuple[int, int]]:
    """Output rows per coordinate of a non-negative constant pad of one sharded dim, and this rank's (before, after).

    Constant padding moves no data, so any split whose ranges hold each rank's own rows
    is free. The balanced split is taken where it fits that way and is more even than
    the default (the first coordinate takes ``left``, the last ``right``): an FNO's
    spectrum padded from 16 kept modes to 129 on 2 ranks, 16/0 before, becomes 65/64
    instead of 16/113, and the inverse FFT's transpose then sends half as much from
    its busiest rank.
    """
    sizes = list(layout.sizes)
    sizes[0] += left
    sizes[-1] += right
    default = (left if layout.coord == 0 else 0, right if layout.coord == layout.parts - 1 else 0)
    balanced = balanced_split_sizes(layout.total + left + right, layout.parts)
    if max(balanced) >= max(sizes):
        return sizes, default
    starts = [sum(balanced[:c]) for c in range(layout.parts)]
    data = [(left + layout.offsets[c], left + layout.offsets[c] + layout.sizes[c]) for c in range(layout.parts)]
    if not all(starts[c] <= lo and hi <= starts[c] + balanced[c] for c, (lo, hi) in enumerate(data) if hi > lo):
        return sizes, default  # some rank's rows would have to move
    c = layout.coord
    before = data[c][0] - starts[c] if layout.sizes[c] else balanced[c]
    return list(balanced), (before, balanced[c] - layout.sizes[c] - before)


def _constant_crop_pad(
    local: torch.Tensor, layout: DimLayout, left: int, right: int, value: float
) -> tuple[torch.Tensor, list[int]]:
    """Constant pad with negative parts along a sharded dim: crop the surviving rows, pad the ends. Local."""
    keep_lo, keep_hi = max(0, -left), layout.total - max(0, -right)  # global input rows that survive
    new_sizes = []
    for c in range(layout.parts):
        lo, hi = layout.offsets[c], layout.offsets[c] + layout.sizes[c]
        rows = max(0, min(hi, keep_hi) - max(lo, keep_lo))
        rows += (max(left, 0) if c == 0 else 0) + (max(right, 0) if c == layout.parts - 1 else 0)
        new_sizes.append(rows)
    lo = min(max(layout.start, keep_lo), layout.stop)
    hi = max(lo, min(layout.stop, keep_hi))
    kept = local.narrow(layout.tensor_dim, lo - layout.start, hi - lo)
    before = max(left, 0) if layout.coord == 0 else 0
    after = max(right, 0) if layout.coord == layout.parts - 1 else 0
    count = local.ndim - layout.tensor_dim
    padded = F.pad(kept, _flat_pad({layout.tensor_dim: (before, after)}, local.ndim, count), "constant", value)
    return padded, new_sizes


@eager_handler
def sharded_pad(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """F.pad for ShardTensors (see the module docstring for modes, layout and refusals).

    Declared with ``patches.function(torch.nn.functional.pad, sharded_pad, override=True)``.
    """
    a = bind_arguments(_pad, args, kwargs)
    x, pad, mode, value = a["input"], tuple(int(p) for p in a["pad"]), a["mode"], a["value"]
    if not isinstance(x, ShardTensor):
        raise MissingShardPatch("torch.nn.functional.pad: the sharded tensor must be the input argument")
    placements = placements_of(x)
    if is_partial(x):
        if mode in ("reflect", "replicate") or (mode == "constant" and not value):
            return delegate(func, types, args, kwargs)  # linear in x: the built-in pads each rank's term
        raise MissingShardPatch(
            f"torch.nn.functional.pad(mode={mode!r}, value={value!r}): input has a Partial placement "
            f"{placements}; a non-zero pad value would be added once per rank, and the built-in has no "
            "circular mode (redistribute to Shard/Replicate first)"
        )
    # torch's own validation (pad length vs mode and ndim, reflect < N, circular <= N) on the global shape.
    meta_output_shape(torch.nn.functional.pad, (x, pad, mode, value))

    pads = _pads_by_dim(pad, x.ndim)
    # A dim "sharded" over one coordinate is whole on this rank: it pads locally, as plain tensors do.
    whole = {d for d, layout in sharded_dims(x).items() if layout.parts == 1}
    layouts = {d: layout for d, layout in sharded_dims(x).items() if d not in whole}
    on_sharded = {d: lr for d, lr in pads.items() if d in layouts and lr != (0, 0)}
    if mode == "constant" and all(min(lr) >= 0 for lr in on_sharded.values()):
        # No data moves: one local pad, each padded sharded dim split by `_constant_split`.
        amounts, new_sizes = dict(pads), {}
        for dim, (left, right) in on_sharded.items():
            new_sizes[dim], amounts[dim] = _constant_split(layouts[dim], left, right)
        local = F.pad(local_of(x), _flat_pad(amounts, x.ndim, len(pad) // 2), "constant", value)
        new_sizes.update({dim: [local.shape[dim]] for dim in whole & pads.keys()})
        return from_local_like(local, x, sizes_by_tensor_dim=new_sizes)
    if mode != "constant" and any(min(lr) < 0 for lr in on_sharded.values()):
        raise MissingShardPatch(
            f"torch.nn.functional.pad: negative pads (cropping) {pad} along a sharded dim with mode={mode!r} "
            "are not supported (cropping is supported with mode='constant')"
        )

    local = local_of(x)
    count = len(pad) // 2
    new_sizes: dict[int, list[int]] = {}
    # The dims this rank holds whole first: that pad saves (for its backward) the block
    # itself, as a plain F.pad saves its input, and the exchange after it saves nothing.
    # The other order would keep the exchanged, partly padded copy alive until the backward.
    unsharded = {d: lr for d, lr in pads.items() if d not in layouts}
    if any(lr != (0, 0) for lr in unsharded.values()):
        flat = _flat_pad(unsharded, x.ndim, count)
        if local.numel() == 0 and mode in ("reflect", "replicate"):
            # torch refuses these modes on empty tensors; an empty shard's padded result is still empty.
            shape = list(local.shape)
            for d, (left, right) in unsharded.items():
                shape[d] += left + right
            local = connected_zeros(local, shape)
        else:
            local = F.pad(local, flat, mode, value)
    for dim in whole & unsharded.keys():
        new_sizes[dim] = [local.shape[dim]]
    for dim, (left, right) in on_sharded.items():
        if mode == "constant":
            fill = 0.0 if value is None else value
            local, new_sizes[dim] = _constant_crop_pad(local, layouts[dim], left, right, fill)
        else:
            local, new_sizes[dim] = _exchange_pad(local, layouts[dim], mode, left, right)
    return from_local_like(local, x, sizes_by_tensor_dim=new_sizes)


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Replace PhysicsNeMo's F.pad patch (which refuses circular and mis-pads tiny boundary shards)."""
    patches.function(
        torch.nn.functional.pad,
        sharded_pad,
        override=True,
        description="F.pad on sharded dims: circular/reflect/replicate via a row exchange; constant local",
    )
