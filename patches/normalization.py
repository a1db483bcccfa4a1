"""Batch, instance, layer, RMS and group normalization over sharded dims.

Every norm here computes statistics (mean, variance or mean square) over some
tensor dims. Dims that are sharded among those are reduced with
`all_reduce_sum` (sum forward and backward) of the
per-statistic partial sums, over exactly the mesh dims that shard them: communication is O(number of statistics) (channels for batch norm,
samples x groups for group norm...), activations are never gathered, and the
normalization itself is local, so the output keeps the input's layout.
Batch norm in training is one autograd Function whose backward all-reduces
``sum(dy)`` and ``sum(dy * x_hat)`` once (they are also the bias and weight
gradients); layer and RMS norm over dims none of which is sharded call torch's
own kernel on the block.

* ``F.batch_norm`` (``nn.BatchNorm1d/2d/3d``): training uses global statistics over
  batch and every sharded spatial dim (counts from the uneven shard sizes, no
  communication); running stats are updated identically on every rank with the
  unbiased variance of the *global* count. Eval (running stats) is purely local.
* ``F.instance_norm``: per-sample, per-channel statistics over the spatial dims.
* ``F.layer_norm`` / ``F.rms_norm``: statistics over the normalized (trailing) dims;
  local when none of them is sharded. PhysicsNeMo registers no handler for them.
* ``F.group_norm``: overrides PhysicsNeMo's handler, which reduces over mesh dim 0
  only (wrong on a ddp x domain or 2-D spatial mesh); 1-D meshes go the same way.

Parameters (Replicate) get gradients all-reduced over every mesh dim that shards
the input, so they come back Replicate and complete.

Delegated (`delegate`, to the DTensor
fallback: PhysicsNeMo has no handler for these four), checked on 2 ranks against
single-process (values, input and parameter gradients):

* ``Partial`` inputs of batch (training and eval), instance, layer and RMS norm: the
  fallback sums the terms first (output ``Replicate``), and every term gets the
  whole gradient; for batch norm in training and instance norm the handler sums them
  itself before delegating (see `_delegate_summed`: torch 2.12's fallback alone is
  rank-divergent there);
* calls torch itself rejects (batch norm of rank < 2, instance norm of rank < 3, eval /
  ``use_input_stats=False`` without running statistics): the delegate raises torch's error.

Refused (`MissingShardPatch`):

* ``group_norm`` of a ``Partial`` input (the built-in fails: ``'Partial' object has no
  attribute 'dim'``), of rank < 2 (the built-in fails with an IndexError), with the
  channel dim sharded (the built-in refuses it too);
* ``batch_norm`` with the channel dim sharded (the fallback is wrong with affine parameters:
  it applies the whole replicated weight/bias to each rank's channels; checked on 2 ranks,
  ``BatchNorm2d(4)``: split 3/1 output off by 1e7, split 2/2 running stats off by 2e-2,
  split 4/0 the ranks hang);
* ``instance_norm`` with the channel dim sharded (the fallback's forward is right but
  its backward fails: "view size is not compatible with input tensor's size and stride");
* a tensor dim sharded by two mesh dims (PhysicsNeMo 2.2's ShardTensor cannot hold that
  layout on CPU ranks: ``from_dtensor`` rejects its local shape, checked on a 2x2 mesh).

Examples:
    Batch norm of a height split 10 + 7 on 2 ranks keeps the split and equals single-process:

    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-3, 3, 2 * 4 * 17 * 3).reshape(2, 4, 17, 3)
    >>> x = shard_tensor(full, mesh, [Shard(2)], [10, 7])
    >>> y = torch.nn.BatchNorm2d(4)(x)   # two all_reduces of 4 floats each
    >>> tuple(y.to_local().shape) == [(2, 4, 10, 3), (2, 4, 7, 3)][rank], y.placements
    (True, (Shard(dim=2),))
    >>> torch.allclose(y.full_tensor(), torch.nn.BatchNorm2d(4)(full), atol=1e-5)
    True
    >>> torch.allclose(F.layer_norm(x, (17, 3)).full_tensor(), F.layer_norm(full, (17, 3)), atol=1e-5)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Replicate

from physicsnemo_shardext import FunctionHandler, MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    all_reduce_sum,
    bind_arguments,
    delegate,
    eager_handler,
    from_local_like,
    is_partial,
    local_of,
    mesh_of,
    output_dtype_under_autocast,
    profiled_range,
    replicated_local,
    sharded_dims,
    sharding_mesh_dims,
    sum_grad_over,
    summed_over,
)

__all__ = ["NORMALIZATION_TARGETS"]


# -- plan: which mesh dims shard the reduced dims ------------------------------------------
def _layouts(x: ShardTensor, op: str) -> dict[int, DimLayout]:
    """The sharded dims of a norm's input; ``Partial`` and nested sharding are refused."""
    if is_partial(x):  # group_norm only: the others delegate Partial inputs
        raise MissingShardPatch(
            f"{op}: Partial input placements {tuple(x.placements)} are not supported "
            "(PhysicsNeMo's built-in fails on them too)"
        )
    try:
        return sharded_dims(x)
    except MissingShardPatch as error:  # a tensor dim sharded by two mesh dims
        raise MissingShardPatch(f"{op}: {error}") from None


def _mesh_dims_sharding(layouts: dict[int, DimLayout], dims: Sequence[int], ndim: int) -> list[int]:
    """The mesh dims that shard any of ``dims``, in mesh-dim order (one all-reduce each)."""
    wanted = {d % ndim for d in dims}
    return sorted(layout.mesh_dim for d, layout in layouts.items() if d in wanted)


def _param(t: Any, x: ShardTensor, op: str, name: str) -> torch.Tensor | None:
    """Local full copy of a Replicate parameter whose gradient is completed over the shards."""
    if t is None:
        return None
    return sum_grad_over(replicated_local(t, f"{op}: {name}"), mesh_of(x), sharding_mesh_dims(x))


def _delegate_summed(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any], x: Any
) -> Any:
    """Delegate a norm of the ``Partial`` input ``x`` after summing its terms (Partial -> Replicate).

    The fallback sums the terms itself, but keeps the ``Partial`` input for the backward;
    torch 2.12's strategies for ``native_batch_norm_backward`` of a ``Partial`` input tie
    (a ``Replicate`` or a ``Partial`` gradient) and the tie falls differently on each rank
    (set order of placements follows the per-process hash seed), so the ranks' collectives
    mismatch and gradients come back silently wrong (seen on 2 CPU ranks). Summed first,
    the backward sees a ``Replicate`` input and every rank takes the same path.
    """
    summed = x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
    if args and args[0] is x:
        return delegate(func, types, (summed, *args[1:]), kwargs)
    if kwargs.get("input") is x:
        return delegate(func, types, args, {**kwargs, "input": summed})
    return delegate(func, types, args, kwargs)


def _buffer(t: Any, op: str, name: str) -> torch.Tensor | None:
    """The tensor a running statistic is stored in (the local copy of a Replicate DTensor)."""
    if t is None:
        return None
    if isinstance(t, (DTensor, ShardTensor)):
        if any(not p.is_replicate() for p in t.placements):
            raise MissingShardPatch(f"{op}: {name} must be Replicate, got {tuple(t.placements)}")
        return t._local_tensor
    return t


def _moments(
    x: torch.Tensor, dims: Sequence[int], like: ShardTensor, mesh_dims: Sequence[int], count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and biased variance over ``dims`` (two all_reduces of the statistics' size).

    The partial sums feed back into every rank's sharded rows: ``all_reduce_sum`` (sum forward
    and backward).
    """
    return _moments_over(x, dims, mesh_of(like), mesh_dims, count)


def _moments_over(
    x: torch.Tensor, dims: Sequence[int], mesh: Any, mesh_dims: Sequence[int], count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_moments` given the mesh itself."""
    mean = all_reduce_sum(x.sum(dim=tuple(dims), keepdim=True), mesh, mesh_dims) / count
    centered = x - mean
    var = all_reduce_sum((centered * centered).sum(dim=tuple(dims), keepdim=True), mesh, mesh_dims) / count
    return mean, var


#: Chunk size of `_dot_over`: small against a block, large enough to keep the loop short.
_DOT_CHUNK_BYTES = 1 << 20


def _dot_over(a: torch.Tensor, b: torch.Tensor, dims: Sequence[int], keepdim: bool = True) -> torch.Tensor:
    """``(a * b).sum(dims)`` without forming the block-sized product: chunk by chunk along a reduced dim.

    The norms' forward (the centred variance) and backward (``sum(dy * x_hat)``) would
    otherwise hold one more block for an instant: a third of a rank's peak.

    Examples:
        >>> a, b = torch.randn(2, 3, 64, 5, dtype=torch.float64), torch.randn(2, 3, 64, 5, dtype=torch.float64)
        >>> torch.allclose(_dot_over(a, b, (0, 2, 3)), (a * b).sum((0, 2, 3), keepdim=True))
        True
    """
    d = max(dims, key=lambda i: a.shape[i])
    rows = a.shape[d]
    row_bytes = a.numel() // max(rows, 1) * a.element_size()
    step = max(1, _DOT_CHUNK_BYTES // max(row_bytes, 1))
    if step >= rows:
        return (a * b).sum(dim=tuple(dims), keepdim=keepdim)
    total = None
    for start in range(0, rows, step):
        n = min(step, rows - start)
        part = (a.narrow(d, start, n) * b.narrow(d, start, n)).sum(dim=tuple(dims), keepdim=keepdim)
        total = part if total is None else total.add_(part)
    assert total is not None
    return total


def _count(x: ShardTensor, dims: Sequence[int]) -> int:
    return math.prod(x.shape[d] for d in dims)


_REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def _opmath(local: torch.Tensor) -> torch.Tensor:
    """The dtype torch's norm kernels compute in: float32 for bf16/fp16 inputs (e.g. under autocast)."""
    return local.float() if local.dtype in _REDUCED_PRECISION else local


def _as_input(y: torch.Tensor, local: torch.Tensor, aten_op: str) -> torch.Tensor:
    """torch returns a bf16/fp16 input's dtype, whatever the parameters' dtype, unless autocast
    runs ``aten_op`` in float32 (layer/group/RMS norm on CUDA), which returns float32."""
    if local.dtype not in _REDUCED_PRECISION:
        return y
    return y.to(output_dtype_under_autocast(aten_op, local))


def _refuse_sharded(layouts: dict[int, DimLayout], dims: Sequence[int], ndim: int, op: str, what: str) -> None:
    for d in dims:
        if d % ndim in layouts:
            raise MissingShardPatch(
                f"{op}: sharding the {what} (tensor dim {d % ndim}) is not supported "
                "(the DTensor fallback is wrong or fails there: checked on 2 ranks)"
            )


def _channel_view(t: torch.Tensor | None, ndim: int) -> torch.Tensor | None:
    """Shape a per-channel vector to broadcast against (N, C, *spatial)."""
    return None if t is None else t.reshape((1, -1) + (1,) * (ndim - 2))


def _scale_and_shift(
    local: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)``, then the per-channel affine transform (local, no communication)."""
    y = (local - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * _channel_view(weight, local.dim())
    if bias is not None:
        y = y + _channel_view(bias, local.dim())
    return y


# -- batch norm -----------------------------------------------------------------------------
def _update_running(running: torch.Tensor | None, value: torch.Tensor, momentum: float | None) -> None:
    if running is None:
        return
    with torch.no_grad():
        running.mul_(1.0 - momentum).add_(value.detach().to(running.dtype), alpha=momentum)


def _channel_layouts(x: ShardTensor, op: str, min_rank: int) -> dict[int, DimLayout]:
    """What batch, instance and group norm check first: rank and unsharded channels; the sharded dims."""
    layouts = _layouts(x, op)
    if x.dim() < min_rank:
        raise MissingShardPatch(f"{op}: inputs of rank {x.dim()} are not supported")
    _refuse_sharded(layouts, [1], x.dim(), op, "channel dim")
    return layouts


def _raw_param(t: Any, op: str, name: str) -> torch.Tensor | None:
    """The local copy of a Replicate parameter, for a Function that completes its gradient itself."""
    return None if t is None else replicated_local(t, f"{op}: {name}")


def _no_stats(a: dict[str, Any]) -> bool:
    return a["running_mean"] is None or a["running_var"] is None


def _grads_through(
    composed: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor | None, ...], grad: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``inputs`` (``None`` for absent or frozen ones) through ``composed()``, kept differentiable.

    A hand-written backward is not itself differentiable. Under ``create_graph=True``
    (a double backward) the norm Functions rebuild the output from differentiable
    ops and differentiate that instead, so second derivatives stay exact.
    """
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    by_input = dict(zip(map(id, wanted), torch.autograd.grad(composed(), wanted, grad, create_graph=True)))
    return tuple(None if t is None else by_input.get(id(t)) for t in inputs)


def _batch_norm_composed(
    local: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mesh: Any,
    mesh_dims: Sequence[int],
    dims: Sequence[int],
    count: int,
    eps: float,
) -> torch.Tensor:
    """Training batch norm from differentiable ops (what double backward differentiates)."""
    mean = all_reduce_sum(local.sum(dim=tuple(dims), keepdim=True), mesh, mesh_dims) / count
    centered = local - mean
    var = all_reduce_sum((centered * centered).sum(dim=tuple(dims), keepdim=True), mesh, mesh_dims) / count
    weight = None if weight is None else sum_grad_over(weight, mesh, mesh_dims)
    bias = None if bias is None else sum_grad_over(bias, mesh, mesh_dims)
    return _scale_and_shift(local, mean, var, eps, weight, bias)


class _BatchNormTrain(torch.autograd.Function):
    """Training batch norm over sharded rows with the minimum communication, forward and backward.

    Forward: two all-reduces of C values (mean, then the centred variance: two passes,
    as torch's kernels, for accuracy). Backward: ONE all-reduce of ``[sum(dy), sum(dy *
    x_hat)]`` (2C values), which gives the input gradient and, being the same two sums,
    the bias and weight gradients complete on every rank. Composing the norm from
    autograd ops instead all-reduces those sums twice and keeps several block-sized
    intermediates; this saves the input and the per-channel statistics only.

    Double backward (``create_graph=True``) differentiates the composed form, recomputed
    from the saved inputs, so gradient penalties stay exact.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mesh: Any,
        mesh_dims: tuple[int, ...],
        dims: tuple[int, ...],
        count: int,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean = summed_over(local.sum(dim=dims, keepdim=True), mesh, mesh_dims) / count
        centered = local - mean
        var = summed_over(_dot_over(centered, centered, dims), mesh, mesh_dims) / count
        invstd = torch.rsqrt(var + eps)
        y = centered.mul_(invstd)
        if weight is not None:
            y = y.mul_(_channel_view(weight, local.dim()))
        if bias is not None:
            y = y.add_(_channel_view(bias, local.dim()))
        ctx.save_for_backward(local, weight, bias, mean, invstd)
        ctx.plan = (mesh, mesh_dims, dims, count, eps)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        local, weight, bias, mean, invstd = ctx.saved_tensors
        mesh, mesh_dims, dims, count, eps = ctx.plan
        nones = (None,) * 5
        if torch.is_grad_enabled():  # create_graph=True

            def composed() -> torch.Tensor:
                return _batch_norm_composed(local, weight, bias, mesh, mesh_dims, dims, count, eps)

            return (*_grads_through(composed, (local, weight, bias), grad), *nones)
        with profiled_range("shardext.batch_norm.backward"):
            x_hat = (local - mean).mul_(invstd)
            sums = summed_over(
                torch.stack([grad.sum(dim=dims, keepdim=True), _dot_over(grad, x_hat, dims)]),
                mesh,
                mesh_dims,
            )
            sum_dy, sum_dy_x_hat = sums[0], sums[1]
            grad_input = None
            if ctx.needs_input_grad[0]:
                scale = invstd if weight is None else invstd * _channel_view(weight, local.dim())
                # (dy - mean(dy) - x_hat * mean(dy * x_hat)) * scale, in x_hat's storage: one block-sized buffer.
                grad_input = x_hat.mul_(-sum_dy_x_hat / count).add_(grad).sub_(sum_dy / count).mul_(scale)
            grad_weight = (
                sum_dy_x_hat.reshape(-1).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
            )
            grad_bias = sum_dy.reshape(-1).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return (grad_input, grad_weight, grad_bias, *nones)


@eager_handler
def batch_norm_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Batch norm with global statistics over batch and sharded spatial dims (O(C) communication)."""
    op = "batch_norm"
    a = bind_arguments(F.batch_norm, args, kwargs)
    x = a["input"]
    if is_partial(x) and a["training"]:
        return _delegate_summed(func, types, args, kwargs, x)
    if is_partial(x) or x.dim() < 2 or (not a["training"] and _no_stats(a)):
        # Checked on 2 ranks: the fallback keeps an eval norm of a Partial input right; torch's
        # own errors (rank < 2, eval without running statistics) come back.
        return delegate(func, types, args, kwargs)
    layouts = _channel_layouts(x, op, min_rank=2)
    running_mean, running_var = (
        _buffer(a["running_mean"], op, "running_mean"),
        _buffer(a["running_var"], op, "running_var"),
    )
    local, eps, ndim = local_of(x), a["eps"], x.dim()
    if not a["training"]:
        if running_mean is None or running_var is None:
            raise MissingShardPatch(f"{op}: eval mode without running statistics is not supported")
        weight, bias = _param(a["weight"], x, op, "weight"), _param(a["bias"], x, op, "bias")
        mean, var = _channel_view(running_mean, ndim), _channel_view(running_var, ndim)
        y = _scale_and_shift(_opmath(local), mean, var, eps, weight, bias)
        return from_local_like(_as_input(y, local, "aten::batch_norm"), x)
    dims = [0] + list(range(2, ndim))
    count = _count(x, dims)
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
    # The channel dim is never sharded here, so the mesh dims that shard the reduced dims are
    # exactly those that shard the input: the same sums complete the parameter gradients.
    weight, bias = _raw_param(a["weight"], op, "weight"), _raw_param(a["bias"], op, "bias")
    y, mean, var = _BatchNormTrain.apply(
        _opmath(local),
        weight,
        bias,
        mesh_of(x),
        tuple(_mesh_dims_sharding(layouts, dims, ndim)),
        tuple(dims),
        count,
        eps,
    )
    momentum = a["momentum"] if a["momentum"] is not None else 0.0
    _update_running(running_mean, mean.flatten(), momentum)
    _update_running(running_var, var.flatten() * (count / (count - 1)), momentum)
    return from_local_like(_as_input(y, local, "aten::batch_norm"), x)


def _grouped_view(local: torch.Tensor, groups: int) -> tuple[int, ...]:
    """``(N, groups, C // groups, *spatial)``: statistics of a group (instance norm: groups = C) over dims 2.."""
    return (local.shape[0], groups, local.shape[1] // groups) + tuple(local.shape[2:])


def _channel_norm_composed(
    local: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mesh: Any,
    stat_mesh_dims: Sequence[int],
    param_mesh_dims: Sequence[int],
    groups: int,
    count: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (instance) norm from differentiable ops: ``(output, mean, var)``, the statistics in the grouped view."""
    grouped = local.reshape(_grouped_view(local, groups))
    mean, var = _moments_over(grouped, tuple(range(2, grouped.dim())), mesh, stat_mesh_dims, count)
    y = ((grouped - mean) * torch.rsqrt(var + eps)).reshape(local.shape)
    if weight is not None:
        y = y * _channel_view(sum_grad_over(weight, mesh, param_mesh_dims), local.dim())
    if bias is not None:
        y = y + _channel_view(sum_grad_over(bias, mesh, param_mesh_dims), local.dim())
    return y, mean, var


class _GroupNormTrain(torch.autograd.Function):
    """Group norm (instance norm with ``groups = C``) over sharded spatial rows, saving what torch's kernel saves.

    Forward: two all-reduces of the ``N x groups`` statistics over the mesh dims that shard
    the spatial dims. Backward: one all-reduce of ``[sum(dz), sum(dz * x_hat)]`` per
    statistic (``dz`` the gradient of the normalized value) over the same mesh dims, and one
    of ``[sum(dy * x_hat), sum(dy)]`` per channel (the weight and bias gradients) over every
    mesh dim that shards the input. It saves the input and the statistics only; the
    composed form kept several block-sized intermediates. Double backward differentiates
    the composed form, recomputed from the saved inputs.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mesh: Any,
        stat_mesh_dims: tuple[int, ...],
        param_mesh_dims: tuple[int, ...],
        groups: int,
        count: int,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grouped = local.reshape(_grouped_view(local, groups))
        dims = tuple(range(2, grouped.dim()))
        mean = summed_over(grouped.sum(dim=dims, keepdim=True), mesh, stat_mesh_dims) / count
        centered = grouped - mean
        var = summed_over(_dot_over(centered, centered, dims), mesh, stat_mesh_dims) / count
        invstd = torch.rsqrt(var + eps)
        y = centered.mul_(invstd).reshape(local.shape)
        if weight is not None:
            y = y.mul_(_channel_view(weight, local.dim()))
        if bias is not None:
            y = y.add_(_channel_view(bias, local.dim()))
        ctx.save_for_backward(local, weight, bias, mean, invstd)
        ctx.plan = (mesh, stat_mesh_dims, param_mesh_dims, groups, count, eps)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        local, weight, bias, mean, invstd = ctx.saved_tensors
        mesh, stat_mesh_dims, param_mesh_dims, groups, count, eps = ctx.plan
        nones = (None,) * 6
        if torch.is_grad_enabled():  # create_graph=True

            def composed() -> torch.Tensor:
                return _channel_norm_composed(
                    local, weight, bias, mesh, stat_mesh_dims, param_mesh_dims, groups, count, eps
                )[0]

            return (*_grads_through(composed, (local, weight, bias), grad), *nones)
        with profiled_range("shardext.group_norm.backward"):
            view = _grouped_view(local, groups)
            x_hat = (local.reshape(view) - mean).mul_(invstd)
            # Per (sample, channel) sums of dy and dy * x_hat: the parameter gradients, and,
            # weighted by the channel's weight and summed over the group, the statistics the
            # input gradient needs (dz = dy * weight is never formed as a block).
            spatial = tuple(range(2, local.dim()))
            sum_dy = grad.sum(dim=spatial)
            sum_dy_x_hat = _dot_over(grad, x_hat.reshape(local.shape), spatial, keepdim=False)
            wants_weight = weight is not None and ctx.needs_input_grad[1]
            wants_bias = bias is not None and ctx.needs_input_grad[2]
            grad_weight = grad_bias = None
            if wants_weight or wants_bias:
                params = summed_over(torch.stack([sum_dy_x_hat.sum(0), sum_dy.sum(0)]), mesh, param_mesh_dims)
                grad_weight = params[0].to(weight.dtype) if wants_weight else None
                grad_bias = params[1].to(bias.dtype) if wants_bias else None
            grad_input = None
            if ctx.needs_input_grad[0]:
                if weight is not None:
                    sum_dy, sum_dy_x_hat = sum_dy * weight, sum_dy_x_hat * weight
                n, per_group = local.shape[0], local.shape[1] // groups
                stats = summed_over(
                    torch.stack([sum_dy, sum_dy_x_hat]).reshape(2, n, groups, per_group).sum(-1), mesh, stat_mesh_dims
                ).reshape((2, n, groups) + (1,) * (len(view) - 2))
                dy = grad.reshape(view)
                # (dz - mean(dz) - x_hat * mean(dz * x_hat)) * invstd, in x_hat's storage.
                grad_input = x_hat.mul_(-stats[1] / count)
                if weight is None:
                    grad_input.add_(dy)
                else:
                    grad_input.addcmul_(dy, weight.reshape((1, groups, per_group) + (1,) * (len(view) - 3)))
                grad_input = grad_input.sub_(stats[0] / count).mul_(invstd).reshape(local.shape)
        return (grad_input, grad_weight, grad_bias, *nones)


# -- instance norm --------------------------------------------------------------------------
@eager_handler
def instance_norm_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Instance norm: per-sample per-channel statistics over sharded spatial dims (O(N*C))."""
    op = "instance_norm"
    a = bind_arguments(F.instance_norm, args, kwargs)
    x = a["input"]
    if is_partial(x):
        return _delegate_summed(func, types, args, kwargs, x)
    if x.dim() < 3 or (not a["use_input_stats"] and _no_stats(a)):
        return delegate(func, types, args, kwargs)  # torch's own errors come back
    layouts = _channel_layouts(x, op, min_rank=3)
    running_mean, running_var = (
        _buffer(a["running_mean"], op, "running_mean"),
        _buffer(a["running_var"], op, "running_var"),
    )
    local, eps, ndim = local_of(x), a["eps"], x.dim()
    spatial = list(range(2, ndim))
    if a["use_input_stats"]:
        count = _count(x, spatial)
        if count <= 1:
            raise ValueError(f"Expected more than 1 spatial element when training, got input size {tuple(x.shape)}")
        y, mean, var = _GroupNormTrain.apply(
            _opmath(local),
            _raw_param(a["weight"], op, "weight"),
            _raw_param(a["bias"], op, "bias"),
            mesh_of(x),
            tuple(_mesh_dims_sharding(layouts, spatial, ndim)),
            tuple(sharding_mesh_dims(x)),
            x.shape[1],
            count,
            eps,
        )
        if running_mean is not None or running_var is not None:
            # Running stats average the per-instance stats over the (possibly sharded) batch.
            batch_mesh_dims, n = _mesh_dims_sharding(layouts, [0], ndim), x.shape[0]
            with torch.no_grad():
                stats = torch.stack([mean.detach().flatten(1).sum(0), var.detach().flatten(1).sum(0)])
                stats = all_reduce_sum(stats, mesh_of(x), batch_mesh_dims) / n
            _update_running(running_mean, stats[0], a["momentum"])
            _update_running(running_var, stats[1] * (count / (count - 1)), a["momentum"])
        return from_local_like(_as_input(y, local, "aten::instance_norm"), x)
    if running_mean is None or running_var is None:
        raise MissingShardPatch(f"{op}: use_input_stats=False without running statistics is not supported")
    mean, var = _channel_view(running_mean, ndim), _channel_view(running_var, ndim)
    weight, bias = _param(a["weight"], x, op, "weight"), _param(a["bias"], x, op, "bias")
    y = _scale_and_shift(_opmath(local), mean, var, eps, weight, bias)
    return from_local_like(_as_input(y, local, "aten::instance_norm"), x)


#: torch's forms of F.group_norm / F.layer_norm (their aliases): a trailing cuDNN flag F's forms lack.
_CUDNN_FLAG: dict[Callable[..., Any], str] = {torch.group_norm: "cudnn_enabled", torch.layer_norm: "cudnn_enable"}


def _functional_arguments(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` of a call of ``func`` as F's form takes them: the cuDNN flag of torch's form dropped."""
    flag = _CUDNN_FLAG.get(func)
    if flag is None:
        return args, kwargs
    return args[:5], {name: value for name, value in kwargs.items() if name != flag}


# -- group norm -----------------------------------------------------------------------------
@eager_handler
def group_norm_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Group norm: per-sample per-group statistics over channels of the group and sharded spatial dims."""
    op = "group_norm"
    a = bind_arguments(F.group_norm, *_functional_arguments(func, args, kwargs))
    x = a["input"]
    layouts = _channel_layouts(x, op, min_rank=2)
    groups_n, n_channels = a["num_groups"], x.shape[1]
    if n_channels % groups_n:
        raise ValueError(
            f"Expected number of channels in input to be divisible by num_groups, got {tuple(x.shape)} and num_groups={groups_n}"
        )
    local, ndim = local_of(x), x.dim()
    spatial = list(range(2, ndim))
    # Statistics over (channels in group, spatial) of the grouped view; the sharded ones are spatial.
    y = _GroupNormTrain.apply(
        _opmath(local),
        _raw_param(a["weight"], op, "weight"),
        _raw_param(a["bias"], op, "bias"),
        mesh_of(x),
        tuple(_mesh_dims_sharding(layouts, spatial, ndim)),
        tuple(sharding_mesh_dims(x)),
        groups_n,
        (n_channels // groups_n) * _count(x, spatial),
        a["eps"],
    )[0]
    return from_local_like(_as_input(y, local, "aten::group_norm"), x)


# -- layer norm and RMS norm ----------------------------------------------------------------
def _normalized_slice(
    t: torch.Tensor | None, layouts: dict[int, DimLayout], first: int, ndim: int
) -> torch.Tensor | None:
    """This rank's slice of an elementwise affine parameter covering dims ``first..ndim-1``."""
    if t is None:
        return None
    for offset, dim in enumerate(range(first, ndim)):
        layout = layouts.get(dim)
        if layout is not None:
            t = t.narrow(offset, layout.start, layout.local_size)
    return t


def _trailing_norm(x: Any, normalized_shape: Sequence[int], op: str) -> tuple[dict[int, DimLayout], list[int], int]:
    layouts = _layouts(x, op)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"{op}: normalized_shape {shape} does not match the input's trailing dims {tuple(x.shape)}")
    first = x.dim() - len(shape)
    return layouts, list(range(first, x.dim())), first


@eager_handler
def layer_norm_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Layer norm; statistics all-reduced only when a normalized dim is sharded."""
    a = bind_arguments(F.layer_norm, *_functional_arguments(func, args, kwargs))
    x, op = a["input"], "layer_norm"
    if is_partial(x):
        return delegate(func, types, args, kwargs)  # the fallback sums the terms first (checked on 2 ranks)
    layouts, dims, first = _trailing_norm(x, a["normalized_shape"], op)
    weight = _normalized_slice(_param(a["weight"], x, op, "weight"), layouts, first, x.dim())
    bias = _normalized_slice(_param(a["bias"], x, op, "bias"), layouts, first, x.dim())
    local = local_of(x)
    stats_mesh_dims = _mesh_dims_sharding(layouts, dims, x.dim())
    if not stats_mesh_dims:
        # No normalized dim is sharded: every row's statistics are local, so torch's fused
        # kernel runs on the block (it keeps the input and per-row statistics only, a third
        # of what the composed form keeps, and matches torch's dtype rules under autocast).
        return from_local_like(F.layer_norm(local, tuple(x.shape[first:]), weight, bias, a["eps"]), x)
    work = _opmath(local)
    mean, var = _moments(work, dims, x, stats_mesh_dims, _count(x, dims))
    y = (work - mean) * torch.rsqrt(var + a["eps"])
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return from_local_like(_as_input(y, local, "aten::layer_norm"), x)


@eager_handler
def rms_norm_handler(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """RMS norm; the mean square is all-reduced only when a normalized dim is sharded."""
    a = bind_arguments(F.rms_norm, args, kwargs)
    x, op = a["input"], "rms_norm"
    if is_partial(x):
        return delegate(func, types, args, kwargs)  # the fallback sums the terms first (checked on 2 ranks)
    layouts, dims, first = _trailing_norm(x, a["normalized_shape"], op)
    weight = _normalized_slice(_param(a["weight"], x, op, "weight"), layouts, first, x.dim())
    local = local_of(x)
    stats_mesh_dims = _mesh_dims_sharding(layouts, dims, x.dim())
    if not stats_mesh_dims:  # local statistics: torch's own kernel on the block (see layer norm)
        return from_local_like(F.rms_norm(local, tuple(x.shape[first:]), weight, a["eps"]), x)
    work = _opmath(local)
    eps = a["eps"] if a["eps"] is not None else torch.finfo(work.dtype).eps
    square = all_reduce_sum((work * work).sum(dim=tuple(dims), keepdim=True), mesh_of(x), stats_mesh_dims)
    y = work * torch.rsqrt(square / _count(x, dims) + eps)
    if weight is not None:
        y = y * weight
    return from_local_like(_as_input(y, local, "aten::rms_norm"), x)


NORMALIZATION_TARGETS: dict[Callable[..., Any], FunctionHandler] = {
    F.batch_norm: batch_norm_handler,
    F.instance_norm: instance_norm_handler,
    F.layer_norm: layer_norm_handler,
    F.rms_norm: rms_norm_handler,
    F.group_norm: group_norm_handler,
}

#: The targets whose PhysicsNeMo built-in handler these replace (explicit consent, not computed):
#: group_norm's reduces over mesh dim 0 only. PhysicsNeMo 2.2 has none for the other four.
_OVERRIDES: frozenset[Callable[..., Any]] = frozenset({F.group_norm})


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the normalization handlers (group_norm overrides PhysicsNeMo's mesh-dim-0-only one)."""
    for target, handler in NORMALIZATION_TARGETS.items():
        patches.function(target, handler, override=target in _OVERRIDES)
