"""``torch.clamp`` with scalar bounds on the local shard of a ShardTensor.

Clamping is elementwise, so each rank clamps its own block and the result
keeps the input's placements and (possibly uneven) shard sizes: no
communication at all. Tensor-valued bounds are refused, because their layout
would have to match the input's sharding; so is a ``Partial`` input, whose
clamp is not the clamp of its sum.

Example::

    y = torch.clamp(x_shard, min=-1.0, max=1.0)   # stays sharded like x_shard
"""

from __future__ import annotations

from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl


def clamp_on_local_shard(func: Any, types: tuple, args: tuple, kwargs: dict) -> ShardTensor:
    """Clamp each rank's local block; scalar bounds only."""
    tensor, *bounds = args
    bounds += [kwargs.get("min"), kwargs.get("max")]
    if not isinstance(tensor, ShardTensor) or any(isinstance(b, torch.Tensor) for b in bounds):
        raise MissingShardPatch("clamp on ShardTensor supports scalar min/max only, not tensor bounds")
    if any(p.is_partial() for p in tensor._spec.placements):
        raise MissingShardPatch("clamp of a Partial ShardTensor: redistribute to Shard or Replicate first")
    local = func(tensor.to_local(), *args[1:], **kwargs)
    return ShardTensor.from_local(
        local, tensor._spec.mesh, tensor._spec.placements, sharding_shapes=tensor._spec.sharding_shapes()
    )


@hookimpl
def shardext_requirements() -> dict[str, str]:
    """Versions this plugin was tested with; outside them it is skipped with a warning."""
    return {"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the clamp handler for the function and the method form."""
    patches.function(torch.clamp, clamp_on_local_shard)
    patches.function(torch.Tensor.clamp, clamp_on_local_shard)
