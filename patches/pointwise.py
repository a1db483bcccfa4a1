"""Pointwise activations computed on the local shard, with no communication.

PhysicsNeMo has no patch for activation functions, so each call on a
ShardTensor goes through the DTensor fallback (conversion to DTensor and back,
sharding propagation). An activation is elementwise: applying it to each
rank's local block *is* the sharded result, for any split, even or uneven,
on any mesh. The output keeps the input's placements and shard sizes.

Inputs with a ``Partial`` placement are summed first (redistributed to
``Replicate`` over those mesh dims, one all-reduce, as the DTensor fallback
does): a nonlinear function of a partial sum is not the partial sum of the
function. The output is then replicated over those mesh dims.

Delegated (:func:`~physicsnemo_shardext.primitives.delegate`, to the DTensor
fallback: PhysicsNeMo has no activation handler): calls whose first argument is
not a ShardTensor, and ``inplace=True`` of ``silu``/``elu``/``leaky_relu``/``mish``
(checked on 2 ranks, uneven and empty shards, with the ``fallback_fix`` plugin: the
input is updated in place, values and gradients equal single-process).

Refused (``MissingShardPatch``):

* ``inplace=True`` on a ``Partial`` input (checked on 2 ranks, re-examined since the
  ``fallback_fix`` plugin): for ``silu``/``elu``/``leaky_relu``/``mish`` the fallback
  raises "in-place operations that require placement changes are not supported";
  for ``hardswish`` it is *wrong* (it applies the activation to each rank's term,
  keeping ``Partial``) and its backward fails (no rule for ``aten.hardswish_backward``);
* ``inplace=True`` of ``hardswish`` on a sharded input: the fallback's forward is right
  but its backward fails (DTensor has no sharding rule for ``aten.hardswish_backward``).

Example (2 ranks)::

    y = torch.nn.functional.gelu(x_shard)   # same placements and shard sizes as x_shard
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Replicate

from physicsnemo_shardext import MissingShardPatch, hookimpl
from physicsnemo_shardext.primitives import delegate
from physicsnemo_shardext.targets import describe_target

__all__ = ["INPLACE_DELEGATED", "POINTWISE_ACTIVATIONS", "local_pointwise"]

POINTWISE_ACTIVATIONS: tuple[Callable[..., Any], ...] = (
    F.gelu,
    F.silu,
    F.mish,
    F.elu,
    F.leaky_relu,
    F.softplus,
    F.hardswish,
    F.softshrink,
    F.hardshrink,
    F.tanhshrink,
    torch.tanh,
    torch.sigmoid,
    torch.Tensor.tanh,
    torch.Tensor.sigmoid,
)


#: Activations whose ``inplace=True`` calls are delegated to the DTensor fallback (checked right,
#: values and gradients, on uneven and empty shards); hardswish's backward op has no DTensor rule.
INPLACE_DELEGATED: frozenset[Callable[..., Any]] = frozenset({F.silu, F.elu, F.leaky_relu, F.mish})


def local_pointwise(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """Apply an elementwise activation to the local shard and keep the input's sharding.

    Example::

        patches.function(torch.nn.functional.gelu, local_pointwise)
    """
    tensor, *rest = args
    if not isinstance(tensor, ShardTensor):
        # Only reachable when a ShardTensor hides in another argument.
        return delegate(func, types, args, kwargs)
    partial = any(placement.is_partial() for placement in tensor._spec.placements)
    if kwargs.get("inplace") or any(arg is True for arg in rest):
        if partial:
            raise MissingShardPatch(
                f"{describe_target(func)}(inplace=True): input has a Partial placement "
                f"{tuple(tensor._spec.placements)}; an in-place activation of a partial sum cannot keep "
                "the placement (the DTensor fallback refuses it, or for hardswish computes it per term: "
                "wrong); use inplace=False, or redistribute first"
            )
        if func not in INPLACE_DELEGATED:
            raise MissingShardPatch(
                f"{describe_target(func)}(inplace=True) on a ShardTensor: the DTensor fallback has no "
                "sharding rule for its backward (use inplace=False)"
            )
        return delegate(func, types, args, kwargs)
    if partial:
        # The sum first (one all-reduce, differentiable), as the DTensor fallback does.
        placements = [Replicate() if p.is_partial() else p for p in tensor._spec.placements]
        tensor = tensor.redistribute(tensor._spec.mesh, placements)
    local_output = func(tensor.to_local(), *rest, **kwargs)
    return ShardTensor.from_local(
        local_output,
        tensor._spec.mesh,
        tensor._spec.placements,
        sharding_shapes=tensor._spec.sharding_shapes(),
    )


@hookimpl
def shardext_requirements() -> dict[str, str]:
    """This plugin relies on PhysicsNeMo 2.2's ShardTensor spec API."""
    return {"nvidia-physicsnemo": ">=2.2,<2.3"}


@hookimpl
def shardext_declare_patches(patches: Any) -> None:
    """Declare the local pointwise handler for every supported activation."""
    for activation in POINTWISE_ACTIVATIONS:
        patches.function(
            activation,
            local_pointwise,
            description=f"{describe_target(activation)} on the local shard (no communication)",
        )
