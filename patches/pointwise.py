"""Pointwise activations computed on the local shard, with no communication.

PhysicsNeMo has no patch for activation functions, so each call on a
ShardTensor goes through the DTensor fallback (conversion to DTensor and back,
sharding propagation). An activation is elementwise: applying it to each
rank's local block *is* the sharded result, for any split, even or uneven,
on any mesh. The output keeps the input's placements and shard sizes.

Refused (``MissingShardPatch``):

* ``inplace=True``: would mutate the caller's local block behind autograd's back;
* inputs with a ``Partial`` placement: a nonlinear function of a partial sum is
  not the partial sum of the function.

Example (2 ranks)::

    y = torch.nn.functional.gelu(x_shard)   # same placements and shard sizes as x_shard
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import MissingShardPatch, hookimpl
from physicsnemo_shardext.targets import describe_target

__all__ = ["POINTWISE_ACTIVATIONS", "local_pointwise"]

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


def local_pointwise(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """Apply an elementwise activation to the local shard and keep the input's sharding.

    Example::

        patches.function(torch.nn.functional.gelu, local_pointwise)
    """
    tensor, *rest = args
    if not isinstance(tensor, ShardTensor):
        # Only reachable when a ShardTensor hides in another argument: refuse loudly.
        raise MissingShardPatch(
            f"{describe_target(func)}: the sharded tensor must be the first argument"
        )
    if kwargs.get("inplace") or any(arg is True for arg in rest):
        raise MissingShardPatch(f"{describe_target(func)}: inplace=True is not supported on ShardTensor")
    if any(placement.is_partial() for placement in tensor._spec.placements):
        raise MissingShardPatch(
            f"{describe_target(func)}: input has a Partial placement {tensor._spec.placements}; "
            "a nonlinear activation of a partial sum needs the sum first (redistribute to Shard/Replicate)"
        )
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
