"""Pointwise activations and PReLU computed on the local shard, with no forward communication.

PhysicsNeMo has no patch for activation functions, so each call on a
ShardTensor goes through the DTensor fallback (conversion to DTensor and back,
sharding propagation). An activation is elementwise: applying it to each
rank's local block *is* the sharded result, for any split, even or uneven,
on any mesh. The output keeps the input's placements and shard sizes.

Inputs with a ``Partial`` placement are summed first (redistributed to
``Replicate`` over those mesh dims, one all-reduce, as the DTensor fallback
does): a nonlinear function of a partial sum is not the partial sum of the
function. The output is then replicated over those mesh dims.

``F.prelu`` is elementwise too, with a replicated weight: each rank applies it to
its own block, and the weight's gradient, a partial sum over the shards, is summed
over the mesh dims that shard the input in the backward pass only (DTensor has no
sharding rule for ``aten._prelu_kernel_backward``, so the fallback's backward fails).

Delegated (`delegate`, to the DTensor
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
  but its backward fails (DTensor has no sharding rule for ``aten.hardswish_backward``);
* ``prelu`` of a ``Partial`` input, with a sharded weight, or of a plain input with a
  ShardTensor weight (the fallback's forward is right but its backward fails: DTensor has
  no rule for ``aten._prelu_kernel_backward``).

Examples:
    Rows split 5 + 2 on 2 ranks keep their split; the values are the single-process ones:

    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-2, 2, 42).reshape(1, 2, 7, 3)
    >>> x = shard_tensor(full, mesh, [Shard(2)], [5, 2])
    >>> y = F.gelu(x)
    >>> tuple(y.to_local().shape) == [(1, 2, 5, 3), (1, 2, 2, 3)][rank], y.placements
    (True, (Shard(dim=2),))
    >>> torch.allclose(y.full_tensor(), F.gelu(full))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Replicate

from physicsnemo_shardext import FunctionHandler, MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # the shared PhysicsNeMo range
from physicsnemo_shardext.primitives import (
    bind_arguments,
    delegate,
    describe_target,
    from_local_like,
    is_partial,
    replicated_local,
    require_shard_input,
    sharding_mesh_dims,
    sum_grad_over,
)

__all__ = ["INPLACE_DELEGATED", "POINTWISE_ACTIVATIONS", "local_pointwise", "prelu_local"]

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


def local_pointwise(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Apply an elementwise activation to the local shard and keep the input's sharding.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.linspace(-1, 1, 14).reshape(2, 7), mesh, [Shard(1)], [6, 1])
        >>> y = local_pointwise(torch.tanh, (), (x,), {})
        >>> torch.equal(y.to_local(), torch.tanh(x.to_local())), y.to_local().shape[1] == [6, 1][rank]
        (True, True)
    """
    tensor, *rest = args
    if not isinstance(tensor, ShardTensor):
        # Only reachable when a ShardTensor hides in another argument.
        return delegate(func, types, args, kwargs)
    partial = is_partial(tensor)
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
    # Not from_local_like: it refuses one tensor dim sharded over several mesh dims, which this keeps.
    return ShardTensor.from_local(
        local_output,
        tensor._spec.mesh,
        tensor._spec.placements,
        sharding_shapes=tensor._spec.sharding_shapes(),
    )


def _prelu(input: Any, weight: Any) -> None:
    """Mirror of ``F.prelu``'s parameters (a C builtin without an introspectable signature)."""


def prelu_local(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """``F.prelu(x, weight)`` on the local block; the weight gradient is summed over the shards.

    Examples:
        >>> import torch.nn.functional as F
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.linspace(-3, 3, 14).reshape(1, 2, 7)
        >>> w = torch.tensor([0.25, 0.5], requires_grad=True)
        >>> y = prelu_local(F.prelu, (), (shard_tensor(full, mesh, [Shard(2)], [5, 2]), w), {})
        >>> torch.allclose(y.full_tensor(), F.prelu(full, w))
        True
        >>> y.to_local().sum().backward()          # each rank's part of the gradient, summed
        >>> torch.allclose(w.grad, torch.where(full < 0, full, 0).sum(dim=(0, 2)))
        True
    """
    bound = bind_arguments(_prelu, args, kwargs)
    x, weight = bound["input"], bound["weight"]
    name = describe_target(func)
    if not isinstance(x, ShardTensor):
        raise MissingShardPatch(
            f"{name}: the input must be the ShardTensor (weight {type(weight).__name__}; the DTensor fallback's "
            "backward fails: no rule for aten._prelu_kernel_backward)"
        )
    require_shard_input(
        func, x,
        why_partial="the DTensor fallback sums it right in the forward, but its backward fails: no rule for "
        "aten._prelu_kernel_backward",
    )
    w = sum_grad_over(replicated_local(weight, f"{name}: weight"), x._spec.mesh, sharding_mesh_dims(x))
    return from_local_like(F.prelu(x.to_local(), w), x)


#: The handler of every target this family declares, with its description.
_HANDLERS: dict[Callable[..., Any], tuple[FunctionHandler, str]] = {
    **{
        activation: (local_pointwise, f"{describe_target(activation)} on the local shard (no communication)")
        for activation in POINTWISE_ACTIVATIONS
    },
    F.prelu: (prelu_local, "prelu on the local block; weight gradient all-reduced over the shards"),
}



@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the local pointwise handler for every supported activation, and prelu."""
    for target, (handler, description) in _HANDLERS.items():
        patches.function(target, handler, description=description)
