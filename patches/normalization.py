"""Batch, instance, layer, RMS and group normalization over sharded dims.

Every norm here computes statistics (mean, variance or mean square) over some
tensor dims. Dims that are sharded among those are reduced with an autograd-aware
``all_reduce`` of the per-statistic partial sums, over exactly the mesh dims that
shard them: communication is O(number of statistics) (channels for batch norm,
samples x groups for group norm...), activations are never gathered, and the
normalization itself is local, so the output keeps the input's layout.

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

Delegated (:func:`~physicsnemo_shardext.primitives.delegate`, to the DTensor
fallback: PhysicsNeMo has no handler for these four), checked on 2 ranks against
single-process (values, input and parameter gradients):

* ``Partial`` inputs of batch (training and eval), instance, layer and RMS norm: the
  fallback sums the terms first (output ``Replicate``), and every term gets the
  whole gradient;
* calls torch itself rejects (batch norm of rank < 2, instance norm of rank < 3, eval /
  ``use_input_stats=False`` without running statistics): the delegate raises torch's error.

Refused (:class:`~physicsnemo_shardext.MissingShardPatch`):

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

Example (2 ranks, H sharded unevenly)::

    bn = torch.nn.BatchNorm2d(4)
    y = bn(x_sharded)          # Shard(2) output; two all_reduces of 4 floats each
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Partial, Shard

from physicsnemo_shardext import MissingShardPatch, hookimpl
from physicsnemo_shardext.primitives import delegate
from physicsnemo_shardext.primitives.replicated import replicated_local, sum_grad_over

__all__ = ["NORMALIZATION_TARGETS"]


@hookimpl
def shardext_requirements() -> dict[str, str]:
    """This plugin relies on PhysicsNeMo 2.2's ShardTensor internals."""
    return {"nvidia-physicsnemo": ">=2.2,<2.3"}


# -- layout helpers -------------------------------------------------------------------------
class _Layout:
    """Which tensor dim each mesh dim shards, and the global sizes, of one ShardTensor."""

    def __init__(self, x: ShardTensor, op: str) -> None:
        self.x, self.mesh = x, x.device_mesh
        self.ndim = x.dim()
        self.shard_of: dict[int, int] = {}  # mesh dim -> tensor dim
        for mesh_dim, p in enumerate(x.placements):
            if isinstance(p, Partial):  # group_norm only: the others delegate Partial inputs
                raise MissingShardPatch(
                    f"{op}: Partial input placements {tuple(x.placements)} are not supported "
                    "(PhysicsNeMo's built-in fails on them too)"
                )
            if isinstance(p, Shard):
                dim = p.dim % self.ndim
                if dim in self.shard_of.values():
                    raise MissingShardPatch(f"{op}: tensor dim {dim} sharded by two mesh dims is not supported")
                self.shard_of[mesh_dim] = dim
        self.global_shape = tuple(x.shape)

    def groups_sharding(self, dims: Sequence[int]) -> list[Any]:
        """Process groups of the mesh dims that shard any of ``dims``."""
        wanted = {d % self.ndim for d in dims}
        return [self.mesh.get_group(m) for m, d in self.shard_of.items() if d in wanted]

    def all_shard_groups(self) -> list[Any]:
        return [self.mesh.get_group(m) for m in self.shard_of]

    def offset_size(self, dim: int) -> tuple[int, int] | None:
        """This rank's (start, length) along a sharded tensor dim, else ``None``."""
        for mesh_dim, d in self.shard_of.items():
            if d == dim:
                sizes = [s[dim] for s in self.x._spec.sharding_shapes()[mesh_dim]]
                coord = self.mesh.get_local_rank(mesh_dim)
                return sum(sizes[:coord]), sizes[coord]
        return None

    def wrap(self, local: torch.Tensor) -> ShardTensor:
        """A ShardTensor laid out like the input (same placements and uneven shapes)."""
        return ShardTensor.from_local(
            local, self.mesh, self.x.placements, sharding_shapes=self.x._spec.sharding_shapes()
        )


def _all_reduce(t: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """Differentiable sum over each group in turn (one collective per sharding mesh dim)."""
    for group in groups:
        t = dist_fn.all_reduce(t, group=group)
    return t


def _param(t: Any, layout: _Layout, op: str, name: str) -> torch.Tensor | None:
    """Local full copy of a Replicate parameter whose gradient is completed over the shards."""
    if t is None:
        return None
    return sum_grad_over(replicated_local(t, f"{op}: {name}"), layout.mesh, list(layout.shard_of))


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
    x: torch.Tensor, dims: Sequence[int], groups: Sequence[Any], count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and biased variance over ``dims`` (two all_reduces of the statistics' size)."""
    mean = _all_reduce(x.sum(dim=tuple(dims), keepdim=True), groups) / count
    centered = x - mean
    var = _all_reduce((centered * centered).sum(dim=tuple(dims), keepdim=True), groups) / count
    return mean, var


def _count(layout: _Layout, dims: Sequence[int]) -> int:
    return math.prod(layout.global_shape[d] for d in dims)


_REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def _opmath(local: torch.Tensor) -> torch.Tensor:
    """The dtype torch's norm kernels compute in: float32 for bf16/fp16 inputs (e.g. under autocast)."""
    return local.float() if local.dtype in _REDUCED_PRECISION else local


def _as_input(y: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """torch returns a bf16/fp16 input's dtype, whatever the parameters' dtype."""
    return y.to(local.dtype) if local.dtype in _REDUCED_PRECISION else y


def _bind(func: Callable, signature_of: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(signature_of).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _refuse_sharded(layout: _Layout, dims: Sequence[int], op: str, what: str) -> None:
    for d in dims:
        if d % layout.ndim in layout.shard_of.values():
            raise MissingShardPatch(
                f"{op}: sharding the {what} (tensor dim {d % layout.ndim}) is not supported "
                "(the DTensor fallback is wrong or fails there: checked on 2 ranks)"
            )


def _channel_view(t: torch.Tensor | None, ndim: int) -> torch.Tensor | None:
    """Shape a per-channel vector to broadcast against (N, C, *spatial)."""
    return None if t is None else t.reshape((1, -1) + (1,) * (ndim - 2))


def _scale_and_shift(
    local: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float,
    weight: torch.Tensor | None, bias: torch.Tensor | None,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)``, then the per-channel affine transform (local, no communication)."""
    y = (local - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * _channel_view(weight, local.dim())
    if bias is not None:
        y = y + _channel_view(bias, local.dim())
    return y


# -- batch norm -----------------------------------------------------------------------------
def _update_running(
    running: torch.Tensor | None, value: torch.Tensor, momentum: float | None
) -> None:
    if running is None:
        return
    with torch.no_grad():
        running.mul_(1.0 - momentum).add_(value.detach().to(running.dtype), alpha=momentum)


def _channel_norm_call(
    func: Callable, reference: Callable, args: tuple, kwargs: dict, op: str, min_rank: int
) -> tuple[dict, ShardTensor, _Layout, torch.Tensor | None, torch.Tensor | None]:
    """What batch, instance and group norm check first: bound arguments, rank, unsharded channels, parameters.

    Returns ``(arguments, input, layout, weight, bias)``; weight and bias are local copies whose
    gradients are completed over the shards.
    """
    a = _bind(func, reference, args, kwargs)
    x = a["input"]
    layout = _Layout(x, op)
    if x.dim() < min_rank:
        raise MissingShardPatch(f"{op}: inputs of rank {x.dim()} are not supported")
    _refuse_sharded(layout, [1], op, "channel dim")
    return a, x, layout, _param(a["weight"], layout, op, "weight"), _param(a["bias"], layout, op, "bias")


def _is_partial(x: Any) -> bool:
    return isinstance(x, (ShardTensor, DTensor)) and any(p.is_partial() for p in x.placements)


def _no_stats(a: dict) -> bool:
    return a["running_mean"] is None or a["running_var"] is None


def batch_norm_handler(func: Callable, types: Any, args: tuple, kwargs: dict) -> ShardTensor:
    """Batch norm with global statistics over batch and sharded spatial dims (O(C) communication)."""
    op = "batch_norm"
    a = _bind(func, F.batch_norm, args, kwargs)
    x = a["input"]
    if _is_partial(x) or x.dim() < 2 or (not a["training"] and _no_stats(a)):
        # Checked on 2 ranks: the fallback sums a Partial input first; torch's own errors
        # (rank < 2, eval without running statistics) come back.
        return delegate(func, types, args, kwargs)
    a, x, layout, weight, bias = _channel_norm_call(func, F.batch_norm, args, kwargs, op, min_rank=2)
    running_mean, running_var = _buffer(a["running_mean"], op, "running_mean"), _buffer(a["running_var"], op, "running_var")
    local, eps, ndim = x.to_local(), a["eps"], x.dim()
    if a["training"]:
        dims = [0] + list(range(2, ndim))
        count = _count(layout, dims)
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        mean, var = _moments(_opmath(local), dims, layout.groups_sharding(dims), count)
        momentum = a["momentum"] if a["momentum"] is not None else 0.0
        _update_running(running_mean, mean.flatten(), momentum)
        _update_running(running_var, var.flatten() * (count / (count - 1)), momentum)
    else:
        if running_mean is None or running_var is None:
            raise MissingShardPatch(f"{op}: eval mode without running statistics is not supported")
        mean, var = _channel_view(running_mean, ndim), _channel_view(running_var, ndim)
    return layout.wrap(_as_input(_scale_and_shift(_opmath(local), mean, var, eps, weight, bias), local))


# -- instance norm --------------------------------------------------------------------------
def instance_norm_handler(func: Callable, types: Any, args: tuple, kwargs: dict) -> ShardTensor:
    """Instance norm: per-sample per-channel statistics over sharded spatial dims (O(N*C))."""
    op = "instance_norm"
    a = _bind(func, F.instance_norm, args, kwargs)
    x = a["input"]
    if _is_partial(x) or x.dim() < 3 or (not a["use_input_stats"] and _no_stats(a)):
        # Checked on 2 ranks: the fallback sums a Partial input first; torch's own errors come back.
        return delegate(func, types, args, kwargs)
    a, x, layout, weight, bias = _channel_norm_call(func, F.instance_norm, args, kwargs, op, min_rank=3)
    running_mean, running_var = _buffer(a["running_mean"], op, "running_mean"), _buffer(a["running_var"], op, "running_var")
    local, eps, ndim = x.to_local(), a["eps"], x.dim()
    spatial = list(range(2, ndim))
    if a["use_input_stats"]:
        count = _count(layout, spatial)
        if count <= 1:
            raise ValueError(f"Expected more than 1 spatial element when training, got input size {tuple(x.shape)}")
        mean, var = _moments(_opmath(local), spatial, layout.groups_sharding(spatial), count)
        if running_mean is not None or running_var is not None:
            # Running stats average the per-instance stats over the (possibly sharded) batch.
            batch_groups, n = layout.groups_sharding([0]), layout.global_shape[0]
            with torch.no_grad():
                stats = torch.stack([mean.detach().flatten(1).sum(0), var.detach().flatten(1).sum(0)])
                stats = _all_reduce(stats, batch_groups) / n
            _update_running(running_mean, stats[0], a["momentum"])
            _update_running(running_var, stats[1] * (count / (count - 1)), a["momentum"])
    else:
        if running_mean is None or running_var is None:
            raise MissingShardPatch(f"{op}: use_input_stats=False without running statistics is not supported")
        mean, var = _channel_view(running_mean, ndim), _channel_view(running_var, ndim)
    return layout.wrap(_as_input(_scale_and_shift(_opmath(local), mean, var, eps, weight, bias), local))


# -- group norm -----------------------------------------------------------------------------
def group_norm_handler(func: Callable, types: Any, args: tuple, kwargs: dict) -> ShardTensor:
    """Group norm: per-sample per-group statistics over channels of the group and sharded spatial dims."""
    op = "group_norm"
    a, x, layout, weight, bias = _channel_norm_call(func, F.group_norm, args, kwargs, op, min_rank=2)
    groups_n, n_channels = a["num_groups"], x.shape[1]
    if n_channels % groups_n:
        raise ValueError(f"Expected number of channels in input to be divisible by num_groups, got {tuple(x.shape)} and num_groups={groups_n}")
    local, ndim = x.to_local(), x.dim()
    grouped = _opmath(local).reshape((local.shape[0], groups_n, n_channels // groups_n) + tuple(local.shape[2:]))
    spatial = list(range(2, ndim))
    count = (n_channels // groups_n) * _count(layout, spatial)
    # Reduce over (channels in group, spatial) of the grouped view: its dims 2.. ; sharded ones are spatial.
    mean, var = _moments(grouped, list(range(2, ndim + 1)), layout.groups_sharding(spatial), count)
    y = ((grouped - mean) * torch.rsqrt(var + a["eps"])).reshape(local.shape)
    if weight is not None:
        y = y * _channel_view(weight, ndim)
    if bias is not None:
        y = y + _channel_view(bias, ndim)
    return layout.wrap(_as_input(y, local))


# -- layer norm and RMS norm ----------------------------------------------------------------
def _normalized_slice(t: torch.Tensor | None, layout: _Layout, first: int) -> torch.Tensor | None:
    """This rank's slice of an elementwise affine parameter covering dims ``first..``."""
    if t is None:
        return None
    for offset, dim in enumerate(range(first, layout.ndim)):
        cut = layout.offset_size(dim)
        if cut is not None:
            t = t.narrow(offset, *cut)
    return t


def _trailing_norm(x: Any, normalized_shape: Sequence[int], op: str) -> tuple[_Layout, list[int], int]:
    layout = _Layout(x, op)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"{op}: normalized_shape {shape} does not match the input's trailing dims {tuple(x.shape)}")
    first = x.dim() - len(shape)
    return layout, list(range(first, x.dim())), first


def layer_norm_handler(func: Callable, types: Any, args: tuple, kwargs: dict) -> ShardTensor:
    """Layer norm; statistics all-reduced only when a normalized dim is sharded."""
    a = _bind(func, F.layer_norm, args, kwargs)
    x, op = a["input"], "layer_norm"
    if _is_partial(x):
        return delegate(func, types, args, kwargs)  # the fallback sums the terms first (checked on 2 ranks)
    layout, dims, first = _trailing_norm(x, a["normalized_shape"], op)
    weight = _normalized_slice(_param(a["weight"], layout, op, "weight"), layout, first)
    bias = _normalized_slice(_param(a["bias"], layout, op, "bias"), layout, first)
    local = x.to_local()
    work = _opmath(local)
    mean, var = _moments(work, dims, layout.groups_sharding(dims), _count(layout, dims))
    y = (work - mean) * torch.rsqrt(var + a["eps"])
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return layout.wrap(_as_input(y, local))


def rms_norm_handler(func: Callable, types: Any, args: tuple, kwargs: dict) -> ShardTensor:
    """RMS norm; the mean square is all-reduced only when a normalized dim is sharded."""
    a = _bind(func, F.rms_norm, args, kwargs)
    x, op = a["input"], "rms_norm"
    if _is_partial(x):
        return delegate(func, types, args, kwargs)  # the fallback sums the terms first (checked on 2 ranks)
    layout, dims, first = _trailing_norm(x, a["normalized_shape"], op)
    weight = _normalized_slice(_param(a["weight"], layout, op, "weight"), layout, first)
    local = x.to_local()
    work = _opmath(local)
    eps = a["eps"] if a["eps"] is not None else torch.finfo(work.dtype).eps
    square = _all_reduce((work * work).sum(dim=tuple(dims), keepdim=True), layout.groups_sharding(dims))
    y = work * torch.rsqrt(square / _count(layout, dims) + eps)
    if weight is not None:
        y = y * weight
    return layout.wrap(_as_input(y, local))


NORMALIZATION_TARGETS: dict[Callable, Callable] = {
    F.batch_norm: batch_norm_handler,
    F.instance_norm: instance_norm_handler,
    F.layer_norm: layer_norm_handler,
    F.rms_norm: rms_norm_handler,
    F.group_norm: group_norm_handler,
}


@hookimpl
def shardext_declare_patches(patches: Any) -> None:
    """Declare the normalization handlers (group_norm overrides PhysicsNeMo's mesh-dim-0-only one)."""
    from physicsnemo_shardext import builtin_handler

    for target, handler in NORMALIZATION_TARGETS.items():
        patches.function(target, handler, override=builtin_handler(target) is not None)
