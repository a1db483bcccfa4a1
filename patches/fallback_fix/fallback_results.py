"""The DTensor fallback's call, guarded: what it returns wrong is refused, what it leaves pending is settled.

`fallback_without_partial_avg` replaces PhysicsNeMo's ``_torch_function_fallback_via_dtensor``:
the same call, with replicated operands whose gradient must stay whole passed through
`settle_replicated_operands`, an in-place update's history given to its target, the
fallback's bare "expected local shape" error on an uneven split turned into a
``MissingShardPatch`` naming the op (`refusal_of_uneven_result`), and a ``Partial(avg)``
result refused unless harmless (`refuse_partial_avg`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_leaves, tree_map

from physicsnemo_shardext import AttributeTarget, MissingShardPatch, describe_target, original_attribute
from physicsnemo_shardext.primitives import placements_of, refuse_untracked_view_update, shard_shapes_of

__all__ = [
    "fallback_without_partial_avg",
    "refusal_of_uneven_result",
    "refuse_partial_avg",
    "settle_replicated_operands",
]

_FALLBACK = AttributeTarget(_shard_tensor_module, "_torch_function_fallback_via_dtensor")

#: The fallback op being run, recorded on the conversion's autograd context for a refusal's message.
_FALLBACK_OP: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardext_fallback_op", default=None)


def _shard_tensors(tree: Any) -> list[ShardTensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, ShardTensor)]


def _has_partial_avg(tensor: ShardTensor) -> bool:
    return any(isinstance(p, Partial) and p.reduce_op == "avg" for p in placements_of(tensor))


def _shards_are_equal(inputs: Sequence[ShardTensor]) -> bool:
    """Whether every sharded input holds the same number of rows on every rank (so local means average right)."""
    for tensor in inputs:
        shapes = shard_shapes_of(tensor)
        for mesh_dim, placement in enumerate(placements_of(tensor)):
            if isinstance(placement, Shard) and len({tuple(s) for s in shapes[mesh_dim]}) > 1:
                return False
    return True


def _needs_grad(inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves(inputs)
    )


def refuse_partial_avg(func: Callable, args: tuple, kwargs: dict | None, result: Any) -> Any:
    """``result`` of the DTensor fallback, or ``MissingShardPatch`` if it holds a ``Partial(avg)`` it cannot trust.

    DTensor gives ``Partial(avg)`` to a mean over a sharded dim (``F.mse_loss``'s default
    reduction, ``torch.nanmean``...). Its value is the average of the ranks' local means,
    wrong whenever ranks hold different row counts, and on torch 2.14 its backward scales
    every gradient by the mesh size. Such a result is let through only where neither
    matters: equal shards and no gradient to compute.
    """
    outputs = [t for t in _shard_tensors(result) if _has_partial_avg(t)]
    if not outputs:
        return result
    inputs = _shard_tensors((args, kwargs))
    needs_grad, equal = _needs_grad((args, kwargs)), _shards_are_equal(inputs)
    if equal and not needs_grad:
        return result
    why = "its gradient would be scaled by the mesh size" if needs_grad else "its value would be wrong"
    layouts = ", ".join(f"{placements_of(t)} rows {_row_summary(t)}" for t in inputs)
    raise MissingShardPatch(
        f"{describe_target(func)}: the DTensor fallback returns a Partial(avg) result here ({why}; "
        f"inputs {layouts}). Compute it with reduction='none' (or sum) and then .mean(), which "
        "ShardTensor averages correctly"
    )


def _row_summary(tensor: ShardTensor) -> str:
    shapes = shard_shapes_of(tensor)
    rows = {}
    for mesh_dim, placement in enumerate(placements_of(tensor)):
        if isinstance(placement, Shard):
            rows[placement.dim % tensor.ndim] = [s[placement.dim % tensor.ndim] for s in shapes[mesh_dim]]
    return str(rows)


def fallback_without_partial_avg(func: Callable, args: tuple, kwargs: dict | None = None) -> Any:
    """Replacement for PhysicsNeMo's ``_torch_function_fallback_via_dtensor``: the same call, then
    `refuse_partial_avg` on its result.

    Examples:
        A mean over rows split 9/8 (the ``losses`` family handles ``mse_loss`` before it
        gets here; called directly, the fallback's result is refused):

        >>> import torch.nn.functional as F
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(17.0), mesh, [Shard(0)], [9, 8])
        >>> try:
        ...     fallback_without_partial_avg(F.mse_loss, (x, 2 * x), {})
        ... except MissingShardPatch as error:
        ...     print(str(error).split(" (")[0])
        torch.nn.functional.mse_loss: the DTensor fallback returns a Partial(avg) result here
    """
    original = original_attribute(_FALLBACK)
    target = args[0] if args and _in_place(func) and isinstance(args[0], ShardTensor) else None
    if target is not None:
        refuse_untracked_view_update(func, target)
    args, kwargs = settle_replicated_operands(args, kwargs)
    token = _FALLBACK_OP.set(describe_target(func))  # named by a second-order refusal in its backward
    try:
        result = original(func, args, kwargs)
    except ValueError as error:
        raise refusal_of_uneven_result(func, args, kwargs, error) or error  # noqa: B904 - the refusal chains itself; else the error as raised
    finally:
        _FALLBACK_OP.reset(token)
    if (
        target is not None
        and result is not target
        and isinstance(result, ShardTensor)
        and torch.is_grad_enabled()
        and (result.shape, result.dtype) == (target.shape, target.dtype)
    ):
        result = _UpdatedInPlace.apply(target, result)
    return refuse_partial_avg(func, args, kwargs, result)


class _UpdatedInPlace(torch.autograd.Function):
    """``target`` (updated in place by the fallback) takes the history of ``result``, the fallback's new wrapper.

    The fallback runs ``x.mul_(2)`` on a DTensor converted from ``x``: the values of
    ``x`` change (shared storage) and the returned wrapper has the right history, but
    ``x`` itself kept its old one, so ``x.mul_(2); loss = x.sum()`` gave ``x``'s inputs
    the gradient of the old value (silently wrong; ``y = x.mul_(2)`` was right).
    ``mark_dirty`` rebases ``x`` on this node, whose backward hands the gradient to the
    new value, as torch's own in-place ops do. Returns ``target``, as an in-place op does.
    """

    @staticmethod
    def forward(ctx: Any, target: ShardTensor, result: ShardTensor) -> ShardTensor:  # type: ignore[override]
        held, new = target._local_tensor, result._local_tensor
        if held.data_ptr() != new.data_ptr() or held.shape != new.shape:
            held.copy_(new)
        ctx.mark_dirty(target)
        return target

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[None, Any]:  # type: ignore[override]
        return None, grad


#: The augmented-assignment operators (``x += y``): in place, unlike other ``__i...__`` names
#: (``__invert__`` is ``~x``, ``__index__``, ``__int__``, ``__iter__`` read only).
_IN_PLACE_OPERATORS = frozenset(
    f"__i{op}__"
    for op in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "matmul",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
    )
)


def _in_place(func: Callable) -> bool:
    """``x.mul_(...)``, ``x += ...``: a method that updates its first argument.

    Examples:
        >>> _in_place(torch.Tensor.mul_), _in_place(torch.Tensor.__iadd__), _in_place(torch.Tensor.__invert__)
        (True, True, False)
    """
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_OPERATORS


#: What PhysicsNeMo's spec inference says when a fallback result's local blocks are not
#: ``torch.chunk``'s (``_infer_shard_tensor_spec_from_local_chunks``, PhysicsNeMo 2.2).
_UNEVEN_RESULT = "expected local shape"


def refusal_of_uneven_result(
    func: Callable, args: tuple, kwargs: dict | None, error: ValueError
) -> MissingShardPatch | None:
    """The ``MissingShardPatch`` naming ``func`` for the fallback's failure on an uneven split, else ``None``.

    The DTensor fallback sizes a result's blocks as ``torch.chunk``'s; on any other split
    PhysicsNeMo's spec inference stops with "Rank 0 expected local shape (2, 4, 3) does
    not match tensor's local shape (2, 5, 3)", which names neither the op nor a way out
    (``Tensor.rot90``, ``Tensor.type``... on rows 5/3). It is raised on every rank alike,
    after the same collectives, so every rank raises this refusal instead.

    Examples:
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(16.0).reshape(2, 8), mesh, [Shard(1)], [5, 3])
        >>> why = refusal_of_uneven_result(torch.rot90, (x,), {}, ValueError("Rank 0 expected local shape (2, 4)"))
        >>> str(why).split(";")[0]
        'torch.rot90: the DTensor fallback sizes its result as even chunks and fails on this split (inputs (Shard(dim=1),) rows {1: [5, 3]})'
    """
    if _UNEVEN_RESULT not in str(error):
        return None
    inputs = [t for t in _shard_tensors((args, kwargs)) if any(isinstance(p, Shard) for p in placements_of(t))]
    layouts = ", ".join(f"{placements_of(t)} rows {_row_summary(t)}" for t in inputs)
    refusal = MissingShardPatch(
        f"{describe_target(func)}: the DTensor fallback sizes its result as even chunks and fails on this split "
        f"(inputs {layouts}); give the op a shard patch, or split the tensor as torch.chunk does "
        f"(PhysicsNeMo: {error})"
    )
    refusal.__cause__ = error
    return refusal


class _SettledGrad(torch.autograd.Function):
    """Identity on a replicated DTensor; its gradient, a pending ``Partial`` sum, comes back summed."""

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> DTensor:  # type: ignore[override]
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
        return grad


def _needs_settling(value: Any) -> bool:
    return (
        isinstance(value, DTensor)
        and not isinstance(value, ShardTensor)
        and value.requires_grad
        and all(isinstance(p, Replicate) for p in value.placements)
    )


def settle_replicated_operands(args: tuple, kwargs: dict | None) -> tuple[tuple, dict | None]:
    """Replicated DTensor operands (parameters and what is computed from them) whose gradient must stay whole.

    Next to a sharded ShardTensor, DTensor's backward gives a replicated operand a
    ``Partial`` gradient (each rank's share of a sum over its rows). Left so, a
    ``Replicate`` parameter ends with a pending-sum gradient: SongUNet's
    ``x.add_(self.affine(emb)[..., None, None])`` gave every ``affine`` weight a
    ``Partial(sum)`` gradient that an optimizer or gradient clipping reads as local
    values. Each such operand passes through an identity whose backward sums that
    gradient (one all-reduce of the operand's size), as the first-party handlers'
    ``sum_grad_over`` does. Nothing changes without a sharded ShardTensor operand or
    with grad mode off.

    Examples:
        >>> from torch.distributed.tensor import Replicate, distribute_tensor
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.ones(1, 2, 9, 3), mesh, [Shard(2)], [5, 4])
        >>> bias = distribute_tensor(torch.zeros(1, 2, 1, 1), mesh, [Replicate()]).requires_grad_()
        >>> y = fallback_without_partial_avg(torch.Tensor.add_, (x.clone(), bias), {})
        >>> y.sum().backward()
        >>> bias.grad.placements, bias.grad.to_local().flatten().tolist()
        ((Replicate(),), [27.0, 27.0])
    """
    if not torch.is_grad_enabled():
        return args, kwargs
    leaves = tree_leaves((args, kwargs))
    if not any(isinstance(v, ShardTensor) and any(isinstance(p, Shard) for p in placements_of(v)) for v in leaves):
        return args, kwargs
    if not any(_needs_settling(v) for v in leaves):
        return args, kwargs
    return tree_map(lambda v: _SettledGrad.apply(v) if _needs_settling(v) else v, (args, kwargs))
