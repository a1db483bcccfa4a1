"""Second-order gradients through PhysicsNeMo's autograd bridges: backwards that keep the graph.

PhysicsNeMo 2.2's autograd bridges build the gradient they return as a new wrapper around a raw
local tensor (``ShardTensor(grad, spec)``, ``_dtensor_to_shard_tensor``, ``grad._local_tensor``).
Under ``create_graph=True`` that cuts the graph: the gradient of a ShardTensor input came back as
a leaf (or not requiring grad at all), and a penalty on it trained without its second-order terms.
Each replacement here keeps the graph when one is being built (`builds_graph`) and otherwise
delegates to PhysicsNeMo's own backward; the first-order path is unchanged except that an expanded
(stride-0) local gradient is copied before it is wrapped (the next backward adds into it in place).

`SECOND_ORDER_BACKWARDS` lists each replacement with its owner; the family declares them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from physicsnemo.domain_parallel._shard_redistribute import ShardRedistribute
from physicsnemo.domain_parallel.custom_ops import _reductions
from physicsnemo.domain_parallel.shard_utils.grad_ops import GradReducer
from physicsnemo.domain_parallel.shard_utils.view_ops import ShardedView
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: F401 - Shard: the examples' placements

from physicsnemo_shardext import AttributeTarget, original_attribute
from physicsnemo_shardext.patches.fallback_fix.fallback_results import _FALLBACK_OP
from physicsnemo_shardext.patches.fallback_fix.gradient_layout import _OWNER
from physicsnemo_shardext.primitives import (
    builds_graph,
    has_internal_overlap,
    materialized,
    spec_of,
    sum_to_replicated,
    wrap_gradient,
)

__all__ = [
    "SECOND_ORDER_BACKWARDS",
    "grad_reducer_backward",
    "redistribute_backward",
    "setup_context_naming_op",
    "to_dtensor_backward",
    "to_local_backward",
    "view_backward",
]


def _original(owner: Any, name: str) -> Callable[..., Any]:
    held = original_attribute(AttributeTarget(owner, name))
    return held.__func__ if isinstance(held, staticmethod) else held


def setup_context_naming_op(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """``_ShardTensorToDTensor.setup_context``, also recording which fallback op converted the input."""
    _original(_OWNER, "setup_context")(ctx, inputs, output)
    ctx.shardext_op = _FALLBACK_OP.get()


def _rewrapped(grad: Any) -> Any:
    """``grad`` with an expanded local block copied (no-op otherwise)."""
    if isinstance(grad, ShardTensor) and has_internal_overlap(grad._local_tensor):
        return ShardTensor(materialized(grad._local_tensor), spec_of(grad), requires_grad=grad.requires_grad)
    return grad


def to_local_backward(ctx: Any, grad_output: torch.Tensor) -> tuple[ShardTensor, None]:
    """``_ToTorchTensor.backward`` (``to_local``'s): PhysicsNeMo's gradient spec, the wrap kept in the graph.

    Examples:
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.ones(7, 2), mesh, [Shard(0)], [5, 2], requires_grad=True)
        >>> (g,) = torch.autograd.grad((x.to_local() ** 3).sum(), x, create_graph=True)
        >>> g.requires_grad, g.grad_fn is not None       # 3 x**2, still differentiable
        (True, True)
    """
    grad, none = _original(_shard_tensor_module._ToTorchTensor, "backward")(ctx, grad_output.detach())
    if builds_graph(grad_output):
        return wrap_gradient(grad_output, spec_of(grad)), none
    return _rewrapped(ShardTensor(grad_output, spec_of(grad), requires_grad=grad_output.requires_grad)), none


def to_dtensor_backward(ctx: Any, grad_output: Any) -> tuple[Any, None]:
    """``_DTensorToShardTensor.backward``: the ShardTensor gradient as a DTensor, through the differentiable bridge."""
    if isinstance(grad_output, ShardTensor) and builds_graph(grad_output):
        return _OWNER.apply(grad_output), None
    return _original(_shard_tensor_module._DTensorToShardTensor, "backward")(ctx, grad_output)


class _ExactRedistribute(torch.autograd.Function):
    """A ShardTensor moved to ``spec``'s placements *and* uneven shard shapes; backward: moved back.

    What ``ShardRedistribute.backward`` computes, as a Function of its own so that a
    second-order gradient differentiates it (the two moves are each other's adjoint).
    """

    @staticmethod
    def forward(ctx: Any, x: ShardTensor, spec: Any) -> ShardTensor:  # type: ignore[override]
        ctx.source_spec = spec_of(x)
        return _redistribute_to(x, spec)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:  # type: ignore[override]
        if builds_graph(grad):
            return _ExactRedistribute.apply(grad, ctx.source_spec), None
        return _redistribute_to(grad, ctx.source_spec), None


def _redistribute_to(x: ShardTensor, spec: Any) -> ShardTensor:
    stub = SimpleNamespace(current_spec=spec, async_op=False)
    return _original(ShardRedistribute, "backward")(stub, x)[0]


def redistribute_backward(ctx: Any, grad_output: Any) -> tuple[Any, None, None, None]:
    """``ShardRedistribute.backward`` (``redistribute``'s), differentiable under ``create_graph=True``."""
    if isinstance(grad_output, ShardTensor) and builds_graph(grad_output):
        return _ExactRedistribute.apply(grad_output, ctx.current_spec), None, None, None
    return _original(ShardRedistribute, "backward")(ctx, grad_output)


def _reduction_backward(owner: type) -> Callable[..., Any]:
    """``owner.backward`` (PhysicsNeMo's sharded sum or mean): its own arithmetic, on a local block kept in the graph."""

    def backward(ctx: Any, grad_output: Any) -> tuple[Any, ...]:
        original = _original(owner, "backward")
        if not (isinstance(grad_output, ShardTensor) and builds_graph(grad_output)):
            grad, *rest = original(ctx, grad_output)
            return (_rewrapped(grad), *rest)  # its broadcast gradient is an expanded view
        resolved = _reductions.resolve_partial_cotangent(grad_output)
        # PhysicsNeMo's backward reads ``_local_tensor``: hand it a wrapper whose block is in the graph.
        # Each rank spreads the replicated cotangent over its own rows only, so the gradient of that
        # block is this rank's part of a sum: Partial, not Replicate, on every replicated mesh dim.
        partial = [Partial() if isinstance(p, Replicate) else p for p in resolved.placements]
        proxy = ShardTensor(resolved.to_local(grad_placements=partial), spec_of(resolved), requires_grad=False)
        grad, *rest = original(ctx, proxy)
        return (wrap_gradient(grad._local_tensor, spec_of(grad)), *rest)

    backward.__name__ = backward.__qualname__ = f"{owner.__name__.lower()}_backward"
    backward.__doc__ = f"``{owner.__name__}.backward``: kept in the graph under create_graph=True; no expanded grads."
    return backward


def grad_reducer_backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
    """``GradReducer.backward`` (a built-in conv's weight gradient, summed over the ranks), differentiable.

    Its ``funcol.all_reduce`` has no autograd formula: under ``create_graph=True`` the
    sum goes through `sum_to_replicated`, whose adjoint hands a penalty on the
    (replicated) parameter gradient back to every rank's rows once.
    """
    if type(grad_output) is torch.Tensor and builds_graph(grad_output):
        spec = ctx.ref_spec
        dims = [d for d in range(spec.mesh.ndim) if spec.placements[d].is_shard()]
        return sum_to_replicated(grad_output, spec.mesh, dims), None
    return _original(GradReducer, "backward")(ctx, grad_output)


def view_backward(ctx: Any, grad_output: Any) -> tuple[Any, None]:
    """``ShardedView.backward`` (the built-in view/reshape of unsharded dims): the view back, as a ShardedView."""
    if isinstance(grad_output, ShardTensor) and builds_graph(grad_output):
        return ShardedView.apply(grad_output, ctx.input_global_shape), None
    grad, none = _original(ShardedView, "backward")(ctx, grad_output)
    return _rewrapped(grad), none


#: (owner, attribute, replacement, why) of every backward replaced for second-order gradients.
SECOND_ORDER_BACKWARDS: tuple[tuple[Any, str, Callable[..., Any], str], ...] = (
    (_shard_tensor_module._ToTorchTensor, "backward", to_local_backward, "to_local"),
    (_shard_tensor_module._DTensorToShardTensor, "backward", to_dtensor_backward, "the fallback's result bridge"),
    (ShardRedistribute, "backward", redistribute_backward, "redistribute"),
    (_reductions.ShardedSum, "backward", _reduction_backward(_reductions.ShardedSum), "sum"),
    (_reductions.ShardedMean, "backward", _reduction_backward(_reductions.ShardedMean), "mean over unsharded dims"),
    (GradReducer, "backward", grad_reducer_backward, "weight-gradient reduction (built-in conv)"),
    (ShardedView, "backward", view_backward, "view/reshape"),
)
