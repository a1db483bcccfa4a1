"""Layout ops on uneven shards: permute, transpose, contiguous/clone, cat, stack, flatten, reshape, complex views.

PhysicsNeMo has no patch for these, so on a ShardTensor they take the DTensor
fallback, which re-derives the output's shard sizes by *even chunking*
whenever the output's shape, stride or placements differ from the input's.
On uneven shards that fails (``expected local shape ... does not match``):
a transpose or permute that renumbers the sharded dim, ``.contiguous()`` of a
a permuted tensor, a ``torch.cat`` of sharded feature maps along channels.
PhysicsNeMo's own models hit all of them (UNet's attention gates and skip
connections, SRResNet's ``PixelShuffle3d``). ``F.prelu``, which lived here
before, is in the ``pointwise`` family.

Every op here is local, with no communication in the forward pass, except a
reshape, view, flatten or unflatten that must redistribute rows (below, and in
`reshape_sharded`):

* ``permute`` / ``transpose`` / ``movedim`` (and torch's aliases ``swapaxes``,
  ``swapdims``, ``moveaxis``): the local block is permuted; each ``Shard(d)``
  follows its dimension to its new index, with the same per-rank row counts;
* ``contiguous`` / ``clone``: same placements and row counts;
* ``cat`` (and its aliases ``concat``, ``concatenate``) along a dimension that is not sharded: the inputs must share mesh,
  placements and row counts on every sharded dim (then the local blocks line
  up row for row); a plain or replicated input of the full size (FNO's
  coordinate grid) is cut to each rank's rows, its gradient summed over the shards;
* ``stack`` of identically sharded tensors along a new dim; sharded dims at or
  after it move up by one;
* ``reshape`` / ``view`` (override the built-ins), ``flatten`` and ``unflatten``
  that merge or split a sharded dim (`reshape_sharded`), pixels to tokens and
  back, windows: the dims are paired into groups of equal products, and in a
  group holding a sharded dim

  - a second sharded dim (an H- and W-sharded grid into points) is gathered over
    its mesh dim first (one all-gather), because DTensor cannot split points
    over two mesh dims with uneven, per-group sizes; the points come out sharded
    over the outer dim's mesh dim and replicated over the other;
  - dims of more than one row in front of the sharded dim (ViT's ``x.flatten(2)``
    of an image sharded on W): the shard moves to the first of them
    (`move_shard`, one all-to-all of the local block, rows in proportion to the
    sharded dim's split: each rank keeps its share), not a gather;
  - the output is sharded on the group's first new dim of more than one row, and
    rank boundaries must be multiples of the product ``k`` of the new dims behind it
    (tokens back to an ``H x W`` grid: ``k = W``; image rows into Swin windows:
    ``k = ws``); where they are not, the rows are re-split to the nearest multiples
    first (`resplit_rows`): only the rows between an old and a new boundary travel,
    at most ``k // 2`` per boundary; aligned boundaries cost nothing.

  Reshapes that keep every sharded dim as it is go to PhysicsNeMo's built-in;
* ``.real`` / ``.imag`` / ``torch.real`` / ``torch.imag`` / ``view_as_real`` /
  ``view_as_complex`` (AFNO's spectral block): views of the local block, same
  placements and row counts.

A plain DTensor with ``Shard`` placements next to ShardTensors in ``cat`` (FLARE's
positional buffer, sharded DTensor's way in even chunks) is gathered first (one
all-gather, differentiable), then cut to the ShardTensors' rows like a replicated input.

Delegated (`delegate`: the built-in for
reshape/view, else the DTensor fallback), checked on 2 ranks: ``Partial`` inputs of
``cat`` and ``stack`` (GeoTransolver's context builder), of reshape/view, and of
flatten/unflatten/complex views (as before this plugin); reshapes/views that keep
every sharded dim as it is, ``view(dtype)``, one dim sharded over several mesh dims,
zero-size dims and invalid shapes (the built-in; torch's error comes back; zero-size
flatten/unflatten: the fallback); ``cat`` along a sharded dim (the fallback
gathers it: ``Replicate`` output, values and gradients right on uneven shards);
``view_as_complex`` with its last dim sharded (the fallback gathers it: ``Replicate``);
``stack`` of inputs of different shapes (torch's own error comes back); ``cat`` and
``stack`` of differently laid out inputs (``Shard`` of another dim, a ``Replicate``
ShardTensor, for ``stack`` a plain tensor) whose shards all hold DTensor's own
``torch.chunk`` rows, none empty (the fallback redistributes them right: values and
gradients equal single-process).

The handlers live in two modules of this package, by job: ``views`` (permute, transpose,
movedim, squeeze, contiguous/clone, ``*_like``, complex views, flatten/unflatten and the
reshapes/views of `reshape_sharded`) and ``joins`` (cat, stack, split/chunk/tensor_split,
unbind); this package declares them and re-exports every public name.

Refused (``MissingShardPatch``): a reshape/view/flatten that merges a sharded dim
with a dim 0 of more than one row in front of it (a batch of 2 samples per domain
group merged with the sharded H, as FNO's decoder does, or Swin's window partition
``(B, nH, nW, ws, ws, C) -> (B * nH * nW, ws, ws, C)`` with B > 1: each rank's rows
of every sample would interleave in the merged dim, which no ``Shard`` describes; the
built-in labels it ``Shard`` anyway; moving the shard to the batch dim would be right
but would move whole samples, so it is left to the user: one sample per domain
group, or the sharded dim first); ``cat`` and ``stack`` of differently laid out
inputs when a shard is uneven or empty (the fallback assumes ``torch.chunk`` rows: a
size mismatch, e.g. "Sizes of tensors must match except in dimension 1", or the
``uneven_redistribute`` guard; checked on 2 ranks); a replicated ``cat`` input of the
wrong size (torch rejects it too).

Examples:
    ``x`` of shape ``(1, 4, 7, 3)`` split 5 + 2 on dim 2, on 2 ranks:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(84.0).reshape(1, 4, 7, 3)
    >>> x = shard_tensor(full, mesh, [Shard(2)], [5, 2])
    >>> y = x.permute(0, 2, 1, 3)             # the shard follows its dim: Shard(1), rows 5/2
    >>> y.placements, y.to_local().shape[1] == [5, 2][rank]
    ((Shard(dim=1),), True)
    >>> z = torch.cat([x, 2 * x], dim=1)      # 8 channels, rows still 5/2, no communication
    >>> tuple(z.to_local().shape) == [(1, 8, 5, 3), (1, 8, 2, 3)][rank]
    True
    >>> torch.equal(z.full_tensor(), torch.cat([full, 2 * full], dim=1))
    True
"""

from __future__ import annotations

from typing import Any

import torch

from physicsnemo_shardext import FunctionHandler, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.patches.layout_ops.joins import (
    cat_local,
    split_local,
    stack_local,
    unbind_gathering_sharded_dim,
)
from physicsnemo_shardext.patches.layout_ops.views import (
    clone_local,
    complex_view_local,
    flatten_local,
    gather_dims,
    like_local,
    movedim_local,
    permute_local,
    reshape_merging_sharded_dims,
    reshape_sharded,
    squeeze_local,
    transpose_local,
    unflatten_local,
)

__all__ = [
    "cat_local",
    "clone_local",
    "complex_view_local",
    "flatten_local",
    "gather_dims",
    "like_local",
    "movedim_local",
    "permute_local",
    "squeeze_local",
    "reshape_merging_sharded_dims",
    "reshape_sharded",
    "split_local",
    "stack_local",
    "transpose_local",
    "unbind_gathering_sharded_dim",
    "unflatten_local",
]


_TARGETS: tuple[tuple[Any, FunctionHandler, str], ...] = (
    (torch.Tensor.permute, permute_local, "permute the local block; Shard dims follow (no communication)"),
    (torch.permute, permute_local, "permute the local block; Shard dims follow (no communication)"),
    (torch.Tensor.squeeze, squeeze_local, "squeeze dims of global size 1 on the local block (no communication)"),
    (torch.squeeze, squeeze_local, "squeeze dims of global size 1 on the local block (no communication)"),
    (torch.Tensor.transpose, transpose_local, "transpose the local block; Shard dims follow (no communication)"),
    (torch.transpose, transpose_local, "transpose the local block; Shard dims follow (no communication)"),
    (torch.Tensor.movedim, movedim_local, "movedim of the local block; Shard dims follow (no communication)"),
    (torch.movedim, movedim_local, "movedim of the local block; Shard dims follow (no communication)"),
    (torch.Tensor.contiguous, clone_local, "contiguous local block, same shards (no communication)"),
    (torch.Tensor.clone, clone_local, "clone of the local block, same shards (no communication)"),
    (torch.clone, clone_local, "clone of the local block, same shards (no communication)"),
    (torch.cat, cat_local, "cat of identically sharded tensors along an unsharded dim (no communication)"),
    (torch.stack, stack_local, "stack of identically sharded tensors along a new dim (no communication)"),
    (torch.Tensor.flatten, flatten_local, "flatten with the sharded dim first of the group: local, rows scale"),
    (torch.flatten, flatten_local, "flatten with the sharded dim first of the group: local, rows scale"),
    (torch.Tensor.unflatten, unflatten_local, "unflatten of a dim; a sharded one keeps its first new dim sharded"),
    (torch.unflatten, unflatten_local, "unflatten of a dim; a sharded one keeps its first new dim sharded"),
    (torch.Tensor.real.__get__, complex_view_local, "x.real as a view of the local block, same shards"),
    (torch.Tensor.imag.__get__, complex_view_local, "x.imag as a view of the local block, same shards"),
    (torch.real, complex_view_local, "torch.real as a view of the local block, same shards"),
    (torch.imag, complex_view_local, "torch.imag as a view of the local block, same shards"),
    (torch.view_as_real, complex_view_local, "view_as_real of the local block; appended dim unsharded"),
    (torch.view_as_complex, complex_view_local, "view_as_complex of the local block; last dim must be unsharded"),
    (torch.zeros_like, like_local, "zeros_like of the local block, same shards (any dtype)"),
    (torch.ones_like, like_local, "ones_like of the local block, same shards (any dtype)"),
    (torch.empty_like, like_local, "empty_like of the local block, same shards (any dtype)"),
    (torch.full_like, like_local, "full_like of the local block, same shards (any dtype)"),
    (torch.Tensor.split, split_local, "split along an unsharded dim: pieces of the local block, same shards"),
    (torch.split, split_local, "split along an unsharded dim: pieces of the local block, same shards"),
    (torch.Tensor.chunk, split_local, "chunk along an unsharded dim: pieces of the local block, same shards"),
    (torch.chunk, split_local, "chunk along an unsharded dim: pieces of the local block, same shards"),
    (torch.Tensor.tensor_split, split_local, "tensor_split along an unsharded dim: local pieces, same shards"),
    (torch.tensor_split, split_local, "tensor_split along an unsharded dim: local pieces, same shards"),
)


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the local layout handlers, and the reshapes that merge two sharded dims (override)."""
    for target, handler, description in _TARGETS:
        patches.function(target, handler, description=description)
    for target in (torch.Tensor.unbind, torch.unbind):  # PhysicsNeMo's raises RuntimeError on a sharded dim
        patches.function(
            target,
            unbind_gathering_sharded_dim,
            override=True,
            description="unbind along a sharded dim: gather it (Replicate pieces), else the built-in",
        )
    for target in (torch.Tensor.reshape, torch.reshape, torch.Tensor.view):
        patches.function(
            target,
            reshape_merging_sharded_dims,
            override=True,
            description="reshape merging two sharded dims: gather the inner one, then the built-in",
        )
