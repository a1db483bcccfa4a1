"""``F.linear`` on row-sharded inputs with parameter gradients reduced and ``Replicate``.

A linear layer acts on the last (feature) dimension only, so for an input
sharded on any other dimension each rank applies the weight to its own rows and
the output keeps the input's placements and uneven split, with no forward
communication. PhysicsNeMo 2.2's built-in does the same forward, but when the
parameters are distributed (``distribute_module``) it hands back weight and
bias gradients as ``Partial`` DTensors, leaving the reduction to whoever reads
them. Every other first-party patch (convolution, normalization) returns
reduced ``Replicate`` gradients, which is what an optimizer step on replicated
parameters and ``check_conformance`` expect. This override reduces them in the
backward pass: one all-reduce of the weight (and one of the bias) gradient per
mesh dimension that shards the input.

Delegated to the built-in (:func:`~physicsnemo_shardext.primitives.delegate`):
calls whose input is not a ShardTensor, inputs sharded on the feature dimension
(a contraction over a sharded dim, which the built-in routes to DTensor), and
Inputs with a ``Partial`` placement (GALE's attention projection) are summed
first (one all-reduce, as the built-in's DTensor path does), then handled like
any other, so the weight gradient is reduced and ``Replicate`` where the built-in
leaves it ``Partial``.
Refused (``MissingShardPatch``): sharded (non-``Replicate``) weights or biases,
and one tensor dim sharded over several mesh dims (what PhysicsNeMo's own ``view`` gives
when flattening an H- and W-sharded grid into points, and cannot reshape back;
with the ``misc_ops`` plugin that reshape gathers W first, so FNO's decoder
gets points sharded over one mesh dim).

Example (2 ranks, rows split 9/8)::

    decoder = distribute_module(torch.nn.Linear(8, 3), mesh)
    y = decoder(x_shard)             # Shard(1) like x_shard, 9/8 rows
    y.sum().backward()               # decoder.weight.grad is Replicate and summed over both ranks
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel.shard_utils.grad_ops import GradReducer
from torch.distributed.tensor import Replicate

from physicsnemo_shardext import hookimpl
from physicsnemo_shardext.primitives import delegate, from_local_like, sharded_dims
from physicsnemo_shardext.primitives.replicated import replicated_local

__all__ = ["sharded_linear"]


def sharded_linear(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """Local ``F.linear`` on each rank's rows; weight/bias gradients all-reduced over the sharded mesh dims.

    Example::

        patches.function(torch.nn.functional.linear, sharded_linear, override=True)
    """
    names = ("input", "weight", "bias")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
    if not isinstance(x, ShardTensor):
        return delegate(func, types, args, kwargs)
    if any(p.is_partial() for p in x._spec.placements):
        # The sum first (one all-reduce, as the built-in does inside DTensor), so that the
        # weight gradient comes back reduced and Replicate like every other call's.
        x = x.redistribute(x._spec.mesh, [Replicate() if p.is_partial() else p for p in x._spec.placements])
    if (x.ndim - 1) in sharded_dims(x):  # raises MissingShardPatch for nested sharding of one dim
        return delegate(func, types, args, kwargs)  # contraction over the sharded feature dim
    weight = GradReducer.apply(replicated_local(weight, "torch.nn.functional.linear: weight"), x._spec)
    if bias is not None:
        bias = GradReducer.apply(replicated_local(bias, "torch.nn.functional.linear: bias"), x._spec)
    return from_local_like(F.linear(x.to_local(), weight, bias), x)


@hookimpl
def shardext_requirements() -> dict[str, str]:
    """This plugin relies on PhysicsNeMo 2.2's ShardTensor internals (and its GradReducer)."""
    return {"nvidia-physicsnemo": ">=2.2,<2.3"}


@hookimpl
def shardext_declare_patches(patches: Any) -> None:
    """Override the built-in ``F.linear`` handler (it delegates back for what it does not change)."""
    patches.function(
        F.linear,
        sharded_linear,
        override=True,
        description="F.linear on row shards; weight/bias gradients reduced to Replicate",
    )
