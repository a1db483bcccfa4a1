"""Indexing, einsum and realigned add on uneven shards: the ops of the FNO spectral block.

Basic indexing (``__getitem__``), slice assignment (``__setitem__``), ``torch.einsum``
with replicated operands, and the add of a replicated or differently split tensor:
what an FNO layer does between ``rfft2`` and ``irfft2`` (see ``patches/fft.py``,
whose spectrum is sharded on the last, ``W//2+1`` frequency dim on a 1-D mesh, and
on both frequency dims, ``[Shard(W_f), Shard(H_f)]``, on a 2-D pencil mesh; every
op below works per sharded dim, so both cases take the same code):

* ``x[..., :m1, :m2]``, ``x[..., -m1:, :m2]`` (``torch.Tensor.__getitem__``):
  basic slices (any step > 0), ints and ``...`` work on every rank's own rows,
  with no communication. A slice along a sharded dim keeps on each rank the
  selected rows it holds, so the result is unevenly sharded on the same dim
  (empty shards included: ``:m2`` of a dim split 5/4 is split ``m2``/0 for
  ``m2 <= 5``). ``None`` (a new axis) is inserted in the local block at the same
  place; the sharded dims after it move up. Other index forms (tensors, bools,
  an int on a sharded dim) go to the DTensor fallback, as before this plugin
  (with ``None`` the fallback labelled the result by even chunking: a shape error
  on uneven shards, found by ``tests/patches/test_layout_fuzz.py``).
* ``torch.einsum`` with sharded operands and replicated ones (plain tensors,
  which ShardTensor promotes to ``Replicate``, or ``Replicate`` DTensor
  parameters from ``distribute_module``): a replicated operand that shares a
  sharded index is cut to this rank's rows, the einsum runs locally, and the
  output is sharded on that index (same split). The gradients of replicated
  operands are all-reduced over the mesh dims that shard the sharded operands
  (in backward only), so they come back complete on every rank; so are those
  of ``Replicate`` ShardTensor operands (Transolver's attended slice tokens).
  Forward: no communication. A **contracted sharded index** (Transolver's
  slice tokens, ``"bhng,bhnc->bhgc"`` over sequence-sharded points) leaves each
  rank the sum over its own rows: it is summed at once (``sum_to_replicated``,
  one all-reduce of the result) and returned ``Replicate`` on that mesh dim,
  which every later op and loss takes as it is. **Two indices sharded over one
  mesh dim** (attention scores ``q @ k.transpose(-1, -2)`` of a sequence-sharded
  q and k; ``probs @ v``): the first index that survives into the output keeps
  its split and the operands sharded on the others are gathered over that mesh
  dim (one all-gather; their gradients are summed back in backward).
* ``torch.matmul``, ``@``, ``Tensor.matmul`` and ``torch.bmm``: rewritten as the
  equivalent einsum and run by the same path (uneven and empty shards, 2-D
  meshes). A size-1 batch dim broadcast against a larger one, ``out=`` and 0-d
  operands keep the fallback, as before this plugin.
* ``out[idx] = value`` (``torch.Tensor.__setitem__``) into a ShardTensor ``out``
  (e.g. ``torch.zeros_like(x_ft)``, sharded like the spectrum): each rank
  writes its part locally; autograd sees a functional update (the tensor
  object is swapped for the updated one with ``torch.utils.swap_tensors``),
  so gradients reach ``value`` and whatever ``out`` was computed from.

* ``plain[idx] = value`` with a sharded ``value``: a plain tensor is a
  replicated global value, so ``value`` is gathered (``gather_full``) and
  written into the caller's tensor, found behind the ``Replicate`` DTensor that
  ShardTensor promotes it to. What follows runs on the full buffer on every
  rank (correct, not domain-parallel); layers that do this should be run inside
  ``primitives.sharded_allocations`` (see ``patches/afno.py``).
* ``replicated + shard`` (``torch.add``, ``Tensor.add``, ``+``): a replicated
  tensor (a plain one, promoted to ``Replicate``, or a ``Replicate`` DTensor
  parameter) that broadcasts against the ShardTensor without enlarging it is
  cut to the ShardTensor's own rows and added locally; its gradient is summed
  over the shards (``replicated_part``). Two ShardTensors of the same shape and
  placements are added on the first one's split (the second one's rows that
  change owner move with one all-to-all per differing dim, none when the splits
  agree). Every other addition takes the DTensor fallback, as before this plugin.

Refused (``MissingShardPatch``):

* einsum or matmul that the local-block path cannot run (one index sharded
  differently in two operands, an operand sharded over a mesh dim on another
  index than the one another operand shards there, a ``Partial`` operand next
  to a sharded one, a ``Shard`` plain-DTensor operand) when a ShardTensor
  operand's shards are not ``torch.chunk``'s rows (measured with the plugin off:
  the DTensor fallback raises a shape error, or one rank raises while the
  other hangs);
* einsum keyword arguments (torch.einsum takes none);
* setitem into a ``Partial`` target, or with an index form other than basic
  slices/ints on unsharded dims (kept: the DTensor fallback fails, measured on
  2 ranks: ``aten.fill_.Tensor`` / ``aten.index_put_`` have no strategy for it);
* setitem into a DTensor target that is not a promoted plain tensor, except
  the delegated cases below (a ``Shard`` DTensor target with a ShardTensor value
  on other splits than ``torch.chunk``'s: the fallback hangs one rank, measured);
* setitem whose value is sharded differently from the target region (kept: the
  DTensor fallback writes wrong values, measured on 2 ranks).

Delegated (to the DTensor fallback; values, placements and gradients checked on
2 ranks against a single process and the plugin-disabled run): einsum with
``Partial(sum)`` operands and otherwise replicated ones (weights plain, promoted
or trainable; two ``Partial`` operands too); and, where every ShardTensor operand
holds ``torch.chunk``'s rows (DTensor's own layout), each einsum or matmul
listed as refused above for other splits;
``dtensor[idx] = shard`` into a ``Replicate`` DTensor that is not a promoted
plain tensor (a ``distribute_module`` buffer), any split, or into a ``Shard``
DTensor with a value holding ``torch.chunk``'s rows (values checked).

Examples:
    A spectrum sharded on dim 3, split 5/4 on 2 ranks; no op below communicates:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-1, 1, 2 * 6 * 9).reshape(1, 2, 6, 9)
    >>> x_ft = shard_tensor(full, mesh, [Shard(3)], [5, 4])
    >>> low = x_ft[:, :, :4, :6]                      # rows 0-5 of dim 3: split 5/1
    >>> low.to_local().shape[3] == [5, 1][rank]
    True
    >>> w = torch.linspace(0, 1, 2 * 2 * 4 * 6).reshape(2, 2, 4, 6)   # replicated (i, o, 4, 6)
    >>> y = torch.einsum("bixy,ioxy->boxy", low, w)   # w cut to each rank's rows
    >>> y.placements, torch.allclose(y.full_tensor(), torch.einsum("bixy,ioxy->boxy", full[:, :, :4, :6], w))
    ((Shard(dim=3),), True)
    >>> out = torch.zeros_like(x_ft)                  # a ShardTensor buffer, split like x_ft
    >>> out[:, :, :4, :6] = y                         # local writes (here i == o)
    >>> torch.equal(out.full_tensor()[:, :, :4, :6], y.full_tensor()), out.to_local().shape[3] == [5, 4][rank]
    (True, True)
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    build_shard_tensor,
    delegate,
    eager_handler,
    elementwise_with_replicated,
    fallback,
    gather_full,
    gather_global_indices,
    is_partial,
    local_of,
    mesh_of,
    placements_of,
    refuse_untracked_view_update,
    replicated_local,
    sharded_dims,
    sum_grad_over,
    sum_to_replicated,
)

__all__ = ["plan_index", "replicated_add", "sharded_einsum", "sharded_getitem", "sharded_matmul", "sharded_setitem"]


# -- indexing -----------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexPlan:
    """A basic index applied per rank: the local index, and each surviving sharded dim's new split."""

    local_index: tuple[Any, ...]
    out_sizes: dict[int, tuple[int, ...]]  # output tensor dim -> rows per coordinate
    out_mesh_dims: dict[int, int]  # output tensor dim -> mesh dim


class _Unsupported(Exception):
    """This index form is not handled here (the caller falls back or refuses)."""


def _expand_index(index: Any, ndim: int) -> list[Any]:
    items = list(index) if isinstance(index, tuple) else [index]
    for item in items:
        if not (item is Ellipsis or isinstance(item, (slice, int)) and not isinstance(item, bool)):
            raise _Unsupported(f"index element {item!r}")
    if sum(item is Ellipsis for item in items) > 1:
        raise _Unsupported("several Ellipsis")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = ndim - (len(items) - 1)
        items = items[:at] + [slice(None)] * fill + items[at + 1 :]
    if len(items) > ndim:
        raise _Unsupported(f"{len(items)} indices for {ndim} dims")
    return items + [slice(None)] * (ndim - len(items))


def _local_slice(sl: slice, layout: DimLayout) -> tuple[slice, tuple[int, ...]]:
    """This rank's part of a global slice along a sharded dim, and the rows each coordinate keeps."""
    start, stop, step = sl.indices(layout.total)
    if step <= 0:
        raise _Unsupported("a slice with a non-positive step")
    counts, mine = [], slice(0, 0)
    for coord in range(layout.parts):
        lo, hi = layout.offsets[coord], layout.offsets[coord] + layout.sizes[coord]
        first = max(start, lo)
        first += (start - first) % step  # next selected row at or after lo
        last = min(stop, hi)
        n = max(0, (last - first + step - 1) // step)
        counts.append(n)
        if coord == layout.coord:
            mine = slice(first - lo, first - lo + n * step, step) if n else slice(0, 0)
    return mine, tuple(counts)


def _new_axes(index: Any, ndim: int) -> tuple[tuple[Any, ...], list[int]]:
    """``index`` without its ``None`` entries, and how many ``None`` come before each input dim (and at the end)."""
    items = list(index) if isinstance(index, tuple) else [index]
    kept = tuple(item for item in items if item is not None)
    fill = ndim - sum(1 for item in kept if item is not Ellipsis)
    before, consumed = [0] * (ndim + 1), 0
    for item in items:
        if item is None:
            before[min(consumed, ndim)] += 1
        else:
            consumed += fill if item is Ellipsis else 1
    return kept, before


def plan_index(x: ShardTensor, index: Any) -> IndexPlan:
    """Plan ``x[index]`` for a basic index (slices, ints on unsharded dims, ``None``, one ``...``).

    Raises ``_Unsupported`` for other forms.
    """
    layouts = sharded_dims(x)
    kept, new_axes = _new_axes(index, x.ndim)
    items = _expand_index(kept, x.ndim)
    local_index: list[Any] = []
    out_sizes: dict[int, tuple[int, ...]] = {}
    out_mesh_dims: dict[int, int] = {}
    out_dim = 0
    for dim, item in enumerate(items + [None]):
        # a new axis is a dim of one row in the output, on every rank
        local_index += [None] * new_axes[dim]
        out_dim += new_axes[dim]
        if dim == x.ndim:
            break
        layout = layouts.get(dim)
        if isinstance(item, int):
            if layout is not None:
                raise _Unsupported(f"an int index on sharded dim {dim}")
            local_index.append(item)
            continue
        if layout is None:
            local_index.append(item)
        else:
            mine, counts = _local_slice(item, layout)
            local_index.append(mine)
            out_sizes[out_dim] = counts
            out_mesh_dims[out_dim] = layout.mesh_dim
        out_dim += 1
    return IndexPlan(tuple(local_index), out_sizes, out_mesh_dims)


def _placements_for(x: ShardTensor, plan: IndexPlan) -> list[Any]:
    placements = list(placements_of(x))
    for out_dim, mesh_dim in plan.out_mesh_dims.items():
        placements[mesh_dim] = Shard(out_dim)
    return placements


@eager_handler
def sharded_getitem(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``x[index]`` on each rank's own rows for basic indices; other forms take the DTensor fallback.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x_ft = shard_tensor(torch.arange(18.0).reshape(2, 9), mesh, [Shard(1)], [5, 4])
        >>> top = sharded_getitem(torch.Tensor.__getitem__, (), (x_ft, (slice(None), slice(None, 6))), {})
        >>> top.to_local().shape[1] == [5, 1][rank], torch.equal(top.full_tensor(), x_ft.full_tensor()[:, :6])
        (True, True)
    """
    x, index = args[0], args[1]
    if not isinstance(x, ShardTensor) or is_partial(x):
        return fallback(func, args, kwargs)
    try:
        plan = plan_index(x, index)
    except _Unsupported:
        return fallback(func, args, kwargs)
    local = local_of(x)[plan.local_index]
    return build_shard_tensor(local, mesh_of(x), _placements_for(x, plan), plan.out_sizes)


# -- slice assignment ---------------------------------------------------------------------
@eager_handler
def sharded_setitem(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """``out[index] = value`` for a ShardTensor ``out``: local writes, autograd-correct.

    ``value`` is a number, a ShardTensor split like the target region (as a slice of a
    tensor sharded like ``out`` is), or a replicated tensor of the region's global shape.
    A plain ``out`` receives the gathered value instead (see ``_write_into_plain``).

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x_ft = shard_tensor(torch.arange(18.0).reshape(2, 9), mesh, [Shard(1)], [5, 4])
        >>> out = torch.zeros_like(x_ft)                # sharded like x_ft
        >>> out[:, 2:7] = 2 * x_ft[:, 2:7]             # each rank writes its own rows
        >>> out.full_tensor()[0].tolist()
        [0.0, 0.0, 4.0, 6.0, 8.0, 10.0, 12.0, 0.0, 0.0]
    """
    target, index, value = args[0], args[1], args[2]
    refuse_untracked_view_update(func, target)
    if not isinstance(target, ShardTensor):
        if _promoted_plain(target) is None and _fallback_writes_into(target, value):
            return delegate(func, types, args, kwargs)
        _write_into_plain(target, index, value)
        return
    if is_partial(target):
        raise MissingShardPatch(
            f"torch.Tensor.__setitem__: target has a Partial placement {placements_of(target)} (the DTensor "
            "fallback fails too, or from torch 2.15 writes the value into every rank's partial sum); "
            "redistribute the target first"
        )
    try:
        plan = plan_index(target, index)
    except _Unsupported as why:
        raise MissingShardPatch(
            f"torch.Tensor.__setitem__ on a ShardTensor with index {index!r}: {why} (the DTensor fallback fails "
            "too: an in-place fill_/index_put_ on a sharded target has no strategy, or from torch 2.15 writes "
            "the wrong rows)"
        ) from None
    region = local_of(target)[plan.local_index]
    value_local = _value_for_region(value, target, plan, region)
    updated = local_of(target).clone()
    updated[plan.local_index] = value_local
    layouts = sharded_dims(target)
    new = build_shard_tensor(updated, mesh_of(target), placements_of(target), {d: l.sizes for d, l in layouts.items()})
    try:
        torch.utils.swap_tensors(target, new)
    except RuntimeError as why:
        raise MissingShardPatch(
            f"torch.Tensor.__setitem__ on a ShardTensor: cannot update it in place ({why}); "
            "write out = out.index_put(...) style code or use F.pad + add"
        ) from None


def _fallback_writes_into(target: Any, value: Any) -> bool:
    """Whether the DTensor fallback writes a sharded ``value`` into this DTensor ``target`` right.

    Measured on 2 ranks (values): a ``Replicate`` DTensor (e.g. a ``distribute_module`` buffer)
    with a ShardTensor value on any split; a ``Shard`` DTensor with a ShardTensor value holding
    ``torch.chunk``'s rows. A ``Shard`` target with another split hangs one rank.
    """
    if not isinstance(target, DTensor) or not isinstance(value, ShardTensor):
        return False
    if is_partial(target) or is_partial(value):
        return False
    return all(p.is_replicate() for p in target.placements) or _in_dtensor_layout(value)


def _promoted_plain(target: Any) -> torch.Tensor | None:
    """The user's plain tensor behind a ``Replicate`` DTensor that ShardTensor promoted for this call.

    ShardTensor hands handlers ``DTensor.from_local(plain)``, whose local tensor is a view
    of ``plain``; writing into that view would bypass autograd, so the write goes to
    ``plain`` itself.
    """
    if not isinstance(target, DTensor) or not all(p.is_replicate() for p in target.placements):
        return None
    base = target._local_tensor._base
    if type(base) not in (torch.Tensor, torch.nn.Parameter) or tuple(base.shape) != tuple(target.shape):
        return None
    return base if base.data_ptr() == target._local_tensor.data_ptr() else None


def _write_into_plain(target: Any, index: Any, value: Any) -> None:
    """``plain[index] = shard``: the plain buffer is replicated, so it receives the gathered value.

    Everything computed from the buffer afterwards is computed redundantly on every rank
    (correct, but not domain-parallel); ``replicated_part`` cuts it back to a shard where it
    meets one, and keeps its gradient whole.
    """
    plain = _promoted_plain(target)
    if plain is None:
        raise MissingShardPatch(
            f"torch.Tensor.__setitem__: cannot write into a {type(target).__name__} target with placements "
            f"{getattr(target, 'placements', None)}; only ShardTensors, plain tensors and the DTensor targets the "
            "DTensor fallback writes right are supported (a Shard target with a value split other than "
            "torch.chunk's hangs one rank there, measured)"
        )
    if isinstance(value, ShardTensor):
        value = gather_full(value)
    elif isinstance(value, DTensor):
        value = replicated_local(value, "torch.Tensor.__setitem__: value")
    plain[index] = value


def _value_for_region(value: Any, target: ShardTensor, plan: IndexPlan, region: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, ShardTensor):
        layouts = sharded_dims(value)
        wanted = {d: (plan.out_mesh_dims[d], sizes) for d, sizes in plan.out_sizes.items()}
        have = {d % value.ndim: (l.mesh_dim, l.sizes) for d, l in layouts.items()}
        if value.ndim != region.ndim or wanted != have:
            raise MissingShardPatch(
                "torch.Tensor.__setitem__: the value's sharding "
                f"{ {d: s for d, s in have.items()} } does not match the target region's "
                f"{ {d: s for d, s in wanted.items()} } (tensor dim -> (mesh dim, rows per coordinate)); "
                "slice the value from a tensor sharded like the target (the DTensor fallback writes wrong "
                "values here)"
            )
        return local_of(value)
    # A replicated value of the region's global shape: keep this rank's rows. Each rank writes
    # (and so differentiates) only its rows, so the gradient is summed over the region's mesh dims.
    value = sum_grad_over(
        replicated_local(value, "torch.Tensor.__setitem__: value"),
        mesh_of(target),
        sorted(set(plan.out_mesh_dims.values())),
    )
    index: list[Any] = [slice(None)] * value.ndim
    offset = value.ndim - region.ndim
    for out_dim, sizes in plan.out_sizes.items():
        d = out_dim + offset
        if d < 0 or value.shape[d] == 1:
            continue  # broadcast
        if value.shape[d] != sum(sizes):
            raise MissingShardPatch(
                f"torch.Tensor.__setitem__: value dim {d} has {value.shape[d]} rows, the region {sum(sizes)}"
            )
        coord = mesh_of(target).get_coordinate()[plan.out_mesh_dims[out_dim]]
        start = sum(sizes[:coord])
        index[d] = slice(start, start + sizes[coord])
    return value[tuple(index)]


# -- adding a replicated buffer -------------------------------------------------------------
@eager_handler
def replicated_add(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``replicated + shard`` (either order): add this rank's part of the replicated tensor locally.

    PhysicsNeMo's ``SpectralConv2d`` starts from ``torch.zeros(B, Co, H, W//2+1)`` (plain,
    promoted to ``Replicate``) and adds the padded, sharded mode products; AFNO adds a
    trainable positional embedding ``(1, N, D)`` to its ``(B, N, D)`` tokens. The DTensor
    fallback re-cuts the replicated tensor evenly, which fails for uneven splits; here it
    is cut to the ShardTensor's own rows (``replicated_part``: broadcasting like ``+``, the
    gradient summed over the shards). Two ShardTensors of identical shape and placements
    are added on the first one's split (the second's rows that change owner are exchanged).
    Every other addition (one that enlarges the ShardTensor, scalars, ``alpha=``) goes to
    the DTensor fallback as before.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x_ft = shard_tensor(torch.arange(18.0).reshape(2, 9), mesh, [Shard(1)], [5, 4])
        >>> bias = torch.arange(9.0)                    # replicated, broadcast over dim 0
        >>> y = replicated_add(torch.add, (), (x_ft, bias), {})
        >>> y.to_local().shape[1] == [5, 4][rank], torch.equal(y.full_tensor(), x_ft.full_tensor() + bias)
        (True, True)

        In PhysicsNeMo's layers (not run here):

        ```python
        out_ft = torch.zeros(x_ft.shape, dtype=torch.cfloat) + F.pad(modes, (0, w - m2, 0, h - m1))
        tokens = tokens + pos_embed          # pos_embed (1, N, D), trainable
        ```
    """
    if len(args) != 2 or kwargs:
        return fallback(func, args, kwargs)
    a, b = args
    if _same_placements(a, b):
        # Two ShardTensors sharded on the same dims (e.g. mode products padded back by F.pad,
        # whose splits depend on which side was padded): b's rows are moved to a's split
        # (only rows that change owner travel; nothing when the splits agree), then added locally.
        a_layouts = sharded_dims(a)
        b_local = local_of(b)
        for d, b_layout in sharded_dims(b).items():
            a_layout = a_layouts[d]
            if a_layout.sizes != b_layout.sizes:
                b_local = gather_global_indices(
                    b_local,
                    b_layout,
                    lambda c, al=a_layout: range(al.offsets[c], al.offsets[c] + al.sizes[c]),
                )
        return build_shard_tensor(
            local_of(a) + b_local, mesh_of(a), placements_of(a), {d: l.sizes for d, l in a_layouts.items()}
        )
    # A replicated operand (promoted DTensor, Replicate ShardTensor, plain tensor) is cut to the shard's rows.
    result = elementwise_with_replicated(func, args, kwargs)
    return fallback(func, args, kwargs) if result is None else result


def _same_placements(a: Any, b: Any) -> bool:
    return (
        isinstance(a, ShardTensor)
        and isinstance(b, ShardTensor)
        and tuple(a.shape) == tuple(b.shape)
        and mesh_of(a) == mesh_of(b)
        and placements_of(a) == placements_of(b)
        and not is_partial(a)
    )


# -- einsum -------------------------------------------------------------------------------
def _split_equation(equation: str, operands: Sequence[torch.Tensor]) -> tuple[list[str], str]:
    """Explicit subscripts per operand and for the output, with ``...`` spelled out."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != len(operands):
        raise MissingShardPatch(f"torch.einsum: {len(inputs)} subscripts for {len(operands)} operands")
    used = set(equation) - set(".,->")
    spare = [c for c in string.ascii_letters if c not in used]
    widths = [op.ndim - (len(s) - 3) if "..." in s else 0 for s, op in zip(inputs, operands)]
    width = max(widths, default=0)
    ell = "".join(spare[:width])
    inputs = [s.replace("...", ell[width - w :]) for s, w in zip(inputs, widths)]
    if not arrow:
        counts = {c: sum(s.count(c) for s in inputs) for c in set("".join(inputs))}
        rhs = ell + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    return inputs, rhs


class _NotLocal(MissingShardPatch):
    """An einsum the local-block path cannot run; ``sharded_einsum`` delegates it where the fallback is right."""


def _placements(op: Any) -> tuple[Any, ...]:
    return tuple(op.placements) if isinstance(op, (ShardTensor, DTensor)) else ()


def _in_dtensor_layout(op: Any) -> bool:
    """Whether ``op`` is laid out as DTensor assumes: a ShardTensor's shards hold ``torch.chunk``'s rows."""
    if not isinstance(op, ShardTensor):
        return True  # plain tensors, plain DTensors (DTensor's own layout)
    try:
        layouts = sharded_dims(op).values()
    except MissingShardPatch:  # one dim over several mesh dims
        return False
    return all(list(l.sizes) == [len(c) for c in torch.arange(l.total).chunk(l.parts)] for l in layouts)


@eager_handler
def sharded_einsum(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``torch.einsum`` on local blocks: replicated operands cut to this rank's rows, sharded sums reduced.

    A contracted sharded index (Transolver's slice tokens ``"bhng,bhnc->bhgc"``) gives each rank a
    partial sum; it is summed over the mesh dim at once (``sum_to_replicated``: one all-reduce of the
    result) and returned ``Replicate`` there. Two indices sharded over one mesh dim (attention scores
    ``"bhld,bhsd->bhls"`` of a sequence-sharded q and k) keep the first one that survives into the
    output sharded and gather the operands sharded on the others. What the local-block path still
    cannot run goes to the DTensor fallback (``delegate``) where that is right, measured on 2 ranks:
    a ``Partial(sum)`` operand whose fellow operands are all replicated; every other such case (an
    index sharded differently in two operands, a ``Partial`` next to a sharded operand, a sharded
    plain DTensor) where every ShardTensor operand holds ``torch.chunk``'s rows. On other splits the
    fallback raises or hangs, so those are refused.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x_ft = shard_tensor(torch.arange(18.0).reshape(2, 9), mesh, [Shard(1)], [5, 4])
        >>> w = torch.linspace(0, 1, 27).reshape(3, 9)            # replicated, shares the sharded index
        >>> y = sharded_einsum(torch.einsum, (), ("by,cy->bcy", x_ft, w), {})
        >>> y.placements, torch.allclose(y.full_tensor(), torch.einsum("by,cy->bcy", x_ft.full_tensor(), w))
        ((Shard(dim=2),), True)
        >>> s = sharded_einsum(torch.einsum, (), ("by,cy->bc", x_ft, w), {})   # contracts the split y
        >>> s.placements, torch.allclose(s.to_local(), x_ft.full_tensor() @ w.T)
        ((Replicate(),), True)
    """
    equation, *operands = args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if kwargs:
        raise MissingShardPatch(f"torch.einsum on ShardTensors: keyword arguments {sorted(kwargs)}")
    return _einsum_or_delegate(func, types, args, kwargs, equation, operands)


def _einsum_or_delegate(
    func: Callable[..., Any],
    types: tuple[type, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    equation: str,
    operands: Sequence[Any],
) -> Any:
    """The local-block einsum, else ``func``'s own fallback where that is right, else a refusal."""
    try:
        if any(is_partial(op) for op in operands):
            if not any(p.is_shard() for op in operands for p in _placements(op)):
                # A Partial(sum) operand, the others replicated: the fallback keeps or reduces the
                # pending sum as the product's linearity allows (two Partial operands included).
                return delegate(func, types, args, kwargs)
            raise _NotLocal("a Partial operand next to a sharded one")
        return _local_einsum(equation, operands)
    except _NotLocal as why:
        if all(_in_dtensor_layout(op) for op in operands):
            return delegate(func, types, args, kwargs)  # DTensor's own layout: the fallback is right
        raise MissingShardPatch(
            f"{why}; the DTensor fallback would take it, but on shards that are not torch.chunk's rows "
            f"(placements {[_placements(op) for op in operands]}) it raises or hangs (measured on 2 ranks)"
        ) from None


def _gather_conflicting(subscripts: Sequence[str], out: str, operands: Sequence[Any]) -> list[Any]:
    """Operands with every sharded index but one per mesh dim gathered (the one kept survives into ``out``).

    The local blocks of two operands sharded over one mesh dim on different indices meet only on
    the diagonal blocks of the result (e.g. q's rows against k's rows): one of them must be whole.
    The first index that appears in the output stays sharded (the scores keep the query's rows);
    the operands sharded on the other ones are gathered over that mesh dim (differentiable: their
    gradient, partial per rank, is summed back by ``_local_einsum``'s ``sum_grad_over``).
    """
    owners: dict[int, list[tuple[str, int, int]]] = {}
    for i, (subs, op) in enumerate(zip(subscripts, operands)):
        if isinstance(op, ShardTensor):
            for d, layout in sharded_dims(op).items():
                owners.setdefault(layout.mesh_dim, []).append((subs[d], i, d))
    result = list(operands)
    for mesh_dim, entries in owners.items():
        letters = list(dict.fromkeys(letter for letter, _, _ in entries))
        if len(letters) < 2:
            continue
        keep = ([c for c in letters if c in out] or letters)[0]
        for letter, i, _ in entries:
            if letter != keep:
                op = result[i]
                placements = list(placements_of(op))
                placements[mesh_dim] = Replicate()
                result[i] = op.redistribute(mesh_of(op), placements)
    return result


def _local_einsum(equation: str, operands: Sequence[Any]) -> ShardTensor:
    """The einsum on each rank's local blocks; ``_NotLocal`` where that would not be the answer."""
    subscripts, out = _split_equation(equation, operands)
    operands = _gather_conflicting(subscripts, out, operands)

    # Sharded indices: letter -> (mesh dim, sizes), consistent over all sharded operands.
    sharded: dict[str, tuple[int, tuple[int, ...], DimLayout]] = {}
    mesh = None
    for subs, op in zip(subscripts, operands):
        if isinstance(op, ShardTensor):
            mesh = mesh_of(op)
            for d, layout in sharded_dims(op).items():
                letter = subs[d]
                entry = (layout.mesh_dim, layout.sizes, layout)
                if letter in sharded and sharded[letter][:2] != entry[:2]:
                    raise _NotLocal(
                        f"torch.einsum {equation!r}: index {letter!r} is sharded differently in two operands "
                        f"({sharded[letter][:2]} vs {entry[:2]})"
                    )
                sharded[letter] = entry
        elif isinstance(op, DTensor) and not all(p.is_replicate() for p in op.placements):
            raise _NotLocal(f"torch.einsum {equation!r}: a plain DTensor operand with placements {op.placements}")
    shard_mesh_dims = sorted({m for m, _, _ in sharded.values()})

    locals_: list[torch.Tensor] = []
    for subs, op in zip(subscripts, operands):
        if isinstance(op, ShardTensor):
            own = {subs[d] for d in sharded_dims(op)}
            local = local_of(op)
            # Replicate over a mesh dim that shards another operand (Transolver's attended slice
            # tokens, a Replicate ShardTensor, against the point-sharded slice weights; a gathered
            # key block): each rank uses it for its own rows only, so its gradient is summed over
            # that mesh dim, as for plain ones.
            replicated_over = [d for d in shard_mesh_dims if placements_of(op)[d].is_replicate()]
            for d, letter in enumerate(subs):
                if letter in sharded and letter not in own and local.shape[d] != 1:
                    mesh_dim = sharded[letter][0]
                    if mesh_dim not in replicated_over:
                        raise _NotLocal(
                            f"torch.einsum {equation!r}: operand {subs!r} is sharded over mesh dim {mesh_dim}, "
                            f"but not on index {letter!r}, which another operand shards there"
                        )
            local = sum_grad_over(local, mesh, replicated_over)
        else:
            # Each rank only sees its rows: the full gradient is the sum over ranks.
            local = sum_grad_over(replicated_local(op, f"torch.einsum {equation!r}: operand"), mesh, shard_mesh_dims)
        for d, letter in enumerate(subs):
            if letter in sharded and letter not in (own if isinstance(op, ShardTensor) else ()) and local.shape[d] != 1:
                _, sizes, layout = sharded[letter]
                if local.shape[d] != sum(sizes):
                    raise MissingShardPatch(
                        f"torch.einsum {equation!r}: replicated operand {subs!r} has {local.shape[d]} rows on "
                        f"index {letter!r}, the sharded operand {sum(sizes)}"
                    )
                local = local.narrow(d, layout.start, layout.local_size)
        if local.numel() == 0 and local.untyped_storage().nbytes() > 0:
            # Saved by the einsum, an empty view keeps its whole block alive until the backward
            # (an FNO rank without low modes kept its spectrum); a clone owns no bytes.
            local = local.clone()
        locals_.append(local)
    result = torch.einsum(",".join(subscripts) + "->" + out, *locals_)
    placements: list[Any] = [Replicate()] * mesh.ndim
    dim_sizes = {}
    summed = []
    for letter, (mesh_dim, sizes, _) in sharded.items():
        if letter in out:
            placements[mesh_dim] = Shard(out.index(letter))
            dim_sizes[out.index(letter)] = sizes
        else:
            summed.append(mesh_dim)  # contracted: each rank holds the sum over its own rows
    # The total is replicated and its cotangent is the same on every rank: each rank's rows get it unchanged.
    result = sum_to_replicated(result, mesh, sorted(summed))
    return build_shard_tensor(result, mesh, placements, dim_sizes)


# -- matmul -------------------------------------------------------------------------------
_BATCH_LETTERS = "abcdefghpqrstuvw"


def _matmul_equation(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """``torch.matmul(a, b)`` as an einsum equation; ``None`` where it broadcasts a batch dim of size 1."""
    if a.ndim == 0 or b.ndim == 0:
        return None
    if a.ndim == 1 and b.ndim == 1:
        return "k,k->"
    a_batch, b_batch = max(a.ndim - 2, 0), max(b.ndim - 2, 0)
    width = max(a_batch, b_batch)
    if width > len(_BATCH_LETTERS):
        return None
    batch = _BATCH_LETTERS[:width]
    for i in range(1, min(a_batch, b_batch) + 1):
        if a.shape[-2 - i] != b.shape[-2 - i]:
            return None  # broadcasting a size-1 batch dim: left to the fallback
    a_subs = batch[width - a_batch :] + ("mk" if a.ndim > 1 else "k")
    b_subs = batch[width - b_batch :] + ("kn" if b.ndim > 1 else "k")
    out = batch + ("m" if a.ndim > 1 else "") + ("n" if b.ndim > 1 else "")
    return f"{a_subs},{b_subs}->{out}"


@eager_handler
def sharded_matmul(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``torch.matmul`` / ``@`` / ``torch.bmm`` of ShardTensors as the equivalent `sharded_einsum`.

    Every sharding the einsum path runs works here, uneven and empty shards included: a sharded
    batch or row dim stays sharded; a contracted sharded dim (``w.transpose(-1, -2) @ x`` over
    sequence-sharded points) is summed over the ranks and returned ``Replicate``; a product of
    two operands sharded on different dims of one mesh dim (``q @ k.transpose(-1, -2)``) gathers
    the second. What it cannot express (a size-1 batch dim broadcast against a larger one, ``out=``,
    0-d operands) goes to the fallback as before this plugin.

    Examples:
        Slice tokens from points split 5/4 (a contraction over the sharded dim):

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> g = torch.Generator().manual_seed(0)
        >>> w, x = torch.randn(9, 3, generator=g), torch.randn(9, 4, generator=g)
        >>> ws, xs = (shard_tensor(t, mesh, [Shard(0)], [5, 4]) for t in (w, x))
        >>> tokens = torch.matmul(ws.transpose(0, 1), xs)
        >>> tokens.placements, torch.allclose(tokens.to_local(), w.T @ x, atol=1e-6)
        ((Replicate(),), True)
    """
    if len(args) != 2 or kwargs or not all(isinstance(t, torch.Tensor) for t in args):
        return delegate(func, types, args, kwargs)
    a, b = args
    if func in (torch.bmm, torch.Tensor.bmm) and (a.ndim != 3 or b.ndim != 3):
        return delegate(func, types, args, kwargs)  # torch's own error
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    equation = _matmul_equation(a, b)
    if equation is None:
        return delegate(func, types, args, kwargs)
    return _einsum_or_delegate(func, types, args, kwargs, equation, [a, b])


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare mode slicing, einsum and slice assignment on ShardTensors."""
    patches.function(
        torch.Tensor.__getitem__,
        sharded_getitem,
        description="basic slicing on each rank's own rows (uneven result, no communication)",
    )
    patches.function(
        torch.Tensor.__setitem__,
        sharded_setitem,
        description="slice assignment into a ShardTensor by local writes; into a plain tensor by gathering",
    )
    for target in (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__):
        patches.function(
            target,
            replicated_add,
            description="replicated full tensor + ShardTensor cut to the shard's own split; else fallback",
        )
    patches.function(
        torch.einsum,
        sharded_einsum,
        description="einsum on local blocks; replicated operands sliced, sharded contractions all-reduced",
    )
    for target in (
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.bmm,
        torch.Tensor.bmm,
    ):
        patches.function(
            target,
            sharded_matmul,
            description="matmul/bmm as the local-block einsum (uneven shards, sharded contractions)",
        )
