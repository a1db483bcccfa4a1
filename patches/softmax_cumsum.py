"""softmax, log_softmax, softmin and cumsum along a sharded dim, with O(statistics) communication.

Without these patches the calls go through the DTensor fallback, which
all-gathers the activation to ``Replicate`` (and whose backward fails on
torch 2.14). Here the output keeps the input's placements and exact (uneven)
shard sizes, and only per-rank statistics cross ranks:

* **softmax / log_softmax / softmin** along a sharded dim: the global max of each
  row (``all_reduce(MAX)``, no gradient needed: softmax does not depend on the
  shift) and the global sum of ``exp(x - max)`` (``all_reduce(SUM)``, autograd-aware,
  so the backward is one more ``all_reduce`` of the same size). One autograd Function
  that saves only its output and works in place (one block-sized buffer forward and
  backward); its backward is differentiable again. Along an unsharded dim: purely local.
* **cumsum** along a sharded dim: the local cumsum plus the exclusive prefix of
  the per-rank totals (one ``all_gather`` of a single row per rank; the backward
  all-gathers the gradient of that row: the prefix of rank ``r`` feeds every
  later rank). Along an unsharded dim: purely local.

Delegated (`delegate`, to the DTensor
fallback: PhysicsNeMo has no handler for these): inputs with a ``Partial``
placement. Checked on 2 ranks against single-process, values and gradients: the
fallback sums the partial terms first (softmax family, output ``Replicate``) or
keeps the ``Partial(sum)`` (cumsum, which is linear), and its backward (with the
``fallback_fix`` plugin) gives every rank's term the whole gradient.

Refused (``MissingShardPatch``), each checked against the delegate on 2 ranks:

* ``cumsum(out=...)``: with a ShardTensor ``out`` the fallback fails ("aten.cumsum.out:
  no valid sharding strategy"); with a plain ``out`` it fills it but returns a new
  ShardTensor instead of ``out``; under autograd torch refuses ``out=`` anyway;
* named dims and a softmax of an integer tensor along a sharded dim without ``dtype=``:
  the fallback raises torch's own error (torch has no such call either);
* a tensor dim sharded over two mesh dims: PhysicsNeMo 2.2's ShardTensor cannot hold
  that layout on CPU ranks (``from_dtensor`` rejects its local shape), so nothing to delegate;
* the sharded tensor not being the first argument (e.g. a plain input with a ShardTensor ``out=``).

Examples:
    On 2 ranks, ``x`` sharded ``Shard(1)`` 10/7: the outputs keep that split and equal single-process:

    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-2, 2, 3 * 17 * 2).reshape(3, 17, 2)
    >>> x = shard_tensor(full, mesh, [Shard(1)], [10, 7])
    >>> y = torch.softmax(x, dim=1)   # 2 all_reduces of 3 * 2 values
    >>> tuple(y.to_local().shape) == [(3, 10, 2), (3, 7, 2)][rank], y.placements
    (True, (Shard(dim=1),))
    >>> torch.allclose(y.full_tensor(), torch.softmax(full, dim=1))
    True
    >>> c = x.cumsum(1)               # 1 all_gather of one row per rank
    >>> torch.allclose(c.full_tensor(), full.cumsum(1), atol=1e-6)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    all_gather_rows,
    all_reduce_sum,
    bind_arguments,
    delegate,
    describe_target,
    dim_layout,
    eager_handler,
    from_local_like,
    is_partial,
    linear_backward,
    local_of,
    max_over,
    normalize_dim,
    output_dtype_under_autocast,
    require_shard_input,
)

__all__ = ["CUMSUM_TARGETS", "SOFTMAX_TARGETS", "sharded_cumsum", "sharded_softmax"]


# Mirrors of torch's C builtins (no introspectable signature), for ``bind_arguments``.
def _softmax(input: Any, dim: Any, dtype: Any = None) -> None:
    """``torch.softmax``/``log_softmax``, ``Tensor.softmax``/``log_softmax``, ``torch.special.*``."""


def _cumsum(input: Any, dim: Any, dtype: Any = None, out: Any = None) -> None:
    """``torch.cumsum``/``Tensor.cumsum``."""


def _checked_input(func: Callable[..., Any], x: Any, dim: Any) -> tuple[ShardTensor, int]:
    """Validate the sharded input and normalize ``dim``."""
    x = require_shard_input(func, x)
    return x, normalize_dim(func, dim, x.ndim)


def _softmax_dim_legacy(ndim: int) -> int:
    # What F.softmax picks when dim is None (deprecated implicit dim).
    return 0 if ndim in (0, 1, 3) else 1


def _global_row_max(local: torch.Tensor, layout: DimLayout, negate: bool = False) -> torch.Tensor:
    """Max over the sharded dim across all ranks (no gradient: softmax is shift-invariant); of ``-local`` if ``negate``."""
    dim = layout.tensor_dim
    with torch.no_grad():
        if local.shape[dim] == 0:
            shape = list(local.shape)
            shape[dim] = 1
            row_max = local.new_full(shape, float("-inf"))
        else:
            row_max = local.amin(dim, keepdim=True).neg_() if negate else local.amax(dim, keepdim=True)
        row_max = max_over(row_max, layout.mesh, [layout.mesh_dim])
    # A row whose every entry is -inf keeps max -inf: exp(x - max) is then nan, as in torch.
    return row_max


class _ShardedSoftmax(torch.autograd.Function):
    """softmax / log_softmax (of ``-x`` for softmin) along a sharded dim; saves only its output.

    Forward: the global row max (``max_over``, no gradient: it cancels), ``exp(x - max)``
    written into the output buffer in place, the global sum (one all-reduce), one
    in-place divide (softmax) or subtract of its log (log_softmax). Backward, from the
    output ``y`` alone: ``dx = y * (dy - S(sum(dy * y)))`` (softmax) or
    ``dx = dy - exp(y) * S(sum(dy))`` (log_softmax), ``S`` the sum over ranks
    (`all_reduce_sum`, so a backward under ``create_graph=True`` differentiates again),
    formed in one block-sized buffer in place when no graph is being built.
    bf16/fp16 inputs are computed in float32 (as torch's kernels) and rounded once.
    """

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, layout: DimLayout, log: bool, negate: bool, out_dtype: torch.dtype
    ) -> torch.Tensor:
        dim = layout.tensor_dim
        work_dtype = torch.float32 if local.dtype in (torch.bfloat16, torch.float16) else local.dtype
        # max(-x) = -min(x): softmin needs no negated copy of the block.
        row_max = _global_row_max(local, layout, negate).to(work_dtype)
        if negate:
            out = torch.neg(local.to(work_dtype)) if local.dtype != work_dtype else torch.neg(local)
            out.sub_(row_max)
        else:
            out = torch.sub(local, row_max) if local.dtype == work_dtype else local.to(work_dtype).sub_(row_max)
        if log:
            total = out.exp().sum(dim, keepdim=True)  # one transient block: log_softmax keeps x - max
            out.sub_(all_reduce_sum(total, layout.mesh, [layout.mesh_dim]).log_())
        else:
            out.exp_()
            out.div_(all_reduce_sum(out.sum(dim, keepdim=True), layout.mesh, [layout.mesh_dim]))
        out = out.to(out_dtype)
        ctx.layout, ctx.log, ctx.negate, ctx.in_dtype = layout, log, negate, local.dtype
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        (y,) = ctx.saved_tensors
        layout: DimLayout = ctx.layout
        dim, mesh, mesh_dims = layout.tensor_dim, layout.mesh, [layout.mesh_dim]
        work_dtype = torch.float32 if y.dtype in (torch.bfloat16, torch.float16) else y.dtype
        if torch.is_grad_enabled():
            # create_graph=True: out-of-place, differentiable ops (y is this Function's output: its own
            # gradient flows back through this backward again) and the autograd-aware sum over ranks.
            yw, gw = y.to(work_dtype), grad.to(work_dtype)
            if ctx.log:
                dx = gw - yw.exp() * all_reduce_sum(gw.sum(dim, keepdim=True), mesh, mesh_dims)
            else:
                dx = yw * (gw - all_reduce_sum((gw * yw).sum(dim, keepdim=True), mesh, mesh_dims))
            if ctx.negate:
                dx = -dx
        else:
            # Plain backward: one block-sized buffer, everything else in place.
            if ctx.log:
                dx = y.to(work_dtype, copy=True).exp_()
                dx.mul_(all_reduce_sum(grad.sum(dim, keepdim=True, dtype=work_dtype), mesh, mesh_dims).neg_())
                dx.add_(grad)
            else:
                dx = grad.to(work_dtype, copy=True).mul_(y)
                total = all_reduce_sum(dx.sum(dim, keepdim=True), mesh, mesh_dims)
                dx.copy_(grad).sub_(total).mul_(y)  # y * (dy - sum(dy * y)), as torch's kernel
            if ctx.negate:
                dx.neg_()
        return dx.to(ctx.in_dtype), None, None, None, None


SOFTMAX_TARGETS: dict[Callable[..., Any], tuple[str, Callable[..., Any]]] = {
    # target -> (kind, the callable its arguments are bound against)
    F.softmax: ("softmax", F.softmax),
    F.log_softmax: ("log_softmax", F.log_softmax),
    F.softmin: ("softmin", F.softmin),
    torch.softmax: ("softmax", _softmax),
    torch.log_softmax: ("log_softmax", _softmax),
    torch.Tensor.softmax: ("softmax", _softmax),
    torch.Tensor.log_softmax: ("log_softmax", _softmax),
    torch.special.softmax: ("softmax", _softmax),
    torch.special.log_softmax: ("log_softmax", _softmax),
}


@eager_handler
def sharded_softmax(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """softmax / log_softmax / softmin of a ShardTensor; communicates only along a sharded ``dim``.

    Examples:
        Along an unsharded dim the call is local (no communication):

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(12.0).reshape(3, 4)
        >>> y = torch.log_softmax(shard_tensor(full, mesh, [Shard(0)], [2, 1]), dim=1)
        >>> torch.allclose(y.full_tensor(), torch.log_softmax(full, dim=1))
        True
    """
    kind, reference = SOFTMAX_TARGETS[func]
    bound = bind_arguments(reference, args, kwargs)
    x = bound["input"]
    if is_partial(x):
        return delegate(func, types, args, kwargs)  # the fallback sums the terms first (checked: values, grads)
    dim = bound["dim"]
    if dim is None and isinstance(x, torch.Tensor):
        dim = _softmax_dim_legacy(x.ndim)
    x, dim = _checked_input(func, x, dim)
    local = local_of(x)
    if bound["dtype"] is not None:
        local = local.to(bound["dtype"])  # torch casts before the op
    layout = dim_layout(x, dim)
    if layout is not None and not (local.is_floating_point() or local.is_complex()):
        raise MissingShardPatch(
            f"{describe_target(func)}: {kind} of a {local.dtype} tensor (torch has no kernel for it); pass dtype="
        )
    if layout is None:
        if kind == "softmin":
            local = -local
        out = (torch.log_softmax if kind == "log_softmax" else torch.softmax)(local, dim)
    else:
        # CUDA autocast runs softmax in float32 and returns float32 when no dtype is given.
        aten_op = "aten::log_softmax.int" if kind == "log_softmax" else "aten::softmax.int"
        out_dtype = local.dtype if bound["dtype"] is not None else output_dtype_under_autocast(aten_op, local)
        out = cast(Any, _ShardedSoftmax).apply(local, layout, kind == "log_softmax", kind == "softmin", out_dtype)
    return from_local_like(out, x)


class _ExclusivePrefix(torch.autograd.Function):
    """Sum of the per-rank totals of all lower coordinates; differentiable.

    Forward all-gathers one row per rank; backward all-gathers the prefix gradients,
    since coordinate ``c``'s total feeds the prefix of every coordinate above it.
    """

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor, layout: DimLayout) -> torch.Tensor:
        ctx.layout = layout
        gathered = _gather_rows(total, layout)
        prefix = torch.zeros_like(total)
        for coord in range(layout.coord):
            prefix += gathered[coord]
        return prefix

    @staticmethod
    def backward(ctx: Any, grad_prefix: torch.Tensor) -> tuple[torch.Tensor, None]:
        layout = ctx.layout
        # Linear in the gradient: under create_graph=True its own backward is the forward prefix sum.
        return linear_backward(grad_prefix, lambda g: _suffix_sum(g, layout), lambda t: _prefix_sum(t, layout)), None


def _prefix_sum(total: torch.Tensor, layout: DimLayout) -> torch.Tensor:
    """Sum of the per-rank ``total`` of all lower coordinates (one all-gather)."""
    gathered = _gather_rows(total.contiguous(), layout)
    prefix = torch.zeros_like(total)
    for coord in range(layout.coord):
        prefix += gathered[coord]
    return prefix


def _suffix_sum(grad: torch.Tensor, layout: DimLayout) -> torch.Tensor:
    """The adjoint of `_prefix_sum`: sum of the per-rank ``grad`` of all higher coordinates."""
    gathered = _gather_rows(grad.contiguous(), layout)
    total = torch.zeros_like(grad)
    for coord in range(layout.coord + 1, layout.parts):
        total += gathered[coord]
    return total


def _gather_rows(row: torch.Tensor, layout: DimLayout) -> list[torch.Tensor]:
    """All-gather ``row`` along the layout's mesh dim; returned in coordinate order."""
    return list(all_gather_rows(row.unsqueeze(0), layout.mesh, layout.mesh_dim, 0).unbind(0))


CUMSUM_TARGETS: tuple[Callable[..., Any], ...] = (torch.cumsum, torch.Tensor.cumsum)


@eager_handler
def sharded_cumsum(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """cumsum of a ShardTensor; along a sharded dim adds the exclusive prefix of per-rank totals.

    Examples:
        An empty shard (split 5/0) still gets the right (empty) rows and joins the exchange:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(10.0).reshape(5, 2)
        >>> c = torch.cumsum(shard_tensor(full, mesh, [Shard(0)], [5, 0]), 0)
        >>> tuple(c.to_local().shape) == [(5, 2), (0, 2)][rank]
        True
        >>> torch.equal(c.full_tensor(), full.cumsum(0))
        True
    """
    bound = bind_arguments(_cumsum, args, kwargs)
    if is_partial(bound["input"]) and bound["out"] is None:
        return delegate(func, types, args, kwargs)  # cumsum is linear: the fallback keeps Partial(sum) (checked)
    if bound["out"] is not None:
        raise MissingShardPatch(
            f"{describe_target(func)}: out= is not supported on ShardTensor (the DTensor fallback fails for a "
            "ShardTensor out=, 'no valid sharding strategy' for aten.cumsum.out, and returns a new tensor "
            "instead of a plain out=; torch refuses out= under autograd)"
        )
    x, dim = _checked_input(func, bound["input"], bound["dim"])
    local = local_of(x)
    if x.ndim == 0:
        return from_local_like(torch.cumsum(local, 0, dtype=bound["dtype"]), x)
    summed = torch.cumsum(local, dim, dtype=bound["dtype"])
    layout = dim_layout(x, dim)
    if layout is not None:
        if summed.shape[dim] == 0:
            # Zeros that stay in the autograd graph, so this rank joins the backward's collective too.
            total = summed.sum(dim, keepdim=True)
        else:
            total = summed.narrow(dim, summed.shape[dim] - 1, 1)
        summed = summed + _ExclusivePrefix.apply(total, layout)
    return from_local_like(summed, x)


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare softmax-family and cumsum handlers."""
    for target, (kind, _) in SOFTMAX_TARGETS.items():
        patches.function(
            target,
            sharded_softmax,
            description=f"{describe_target(target)}: {kind} with global max/sum all_reduces along a sharded dim",
        )
    for target in CUMSUM_TARGETS:
        patches.function(
            target,
            sharded_cumsum,
            description=f"{describe_target(target)}: local cumsum plus the exclusive prefix of per-rank totals",
        )
