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

Binary ``sub``/``mul``/``div`` (and their operators) of a sharded ShardTensor and a
replicated operand (a ``Replicate`` target, a promoted weight) run on the local rows,
the replicated operand cut to them: the DTensor fallback raises a shape error there
on any split other than ``torch.chunk``'s. So do ``addcmul``, ``addcdiv``, ``lerp``,
``maximum``, ``minimum`` and ``where`` of operands sharded alike and replicated ones
(SongUNet's ``torch.addcmul(shift, x, scale + 1)`` adaptive scale): the fallback
leaves a replicated parameter's gradient as a pending ``Partial`` sum (``where``
with a broadcast operand raises a shape error); here it comes back summed, as for
``sub``/``mul``/``div``. Comparisons (``gt``, ``ge``, ``lt``, ``le``, ``eq``, ``ne``
and their operators) run on the local block with scalars too: the fallback infers a
boolean result's split as ``torch.chunk``'s and raises a shape error on other splits.
Dtype conversions (``x.type(torch.int64)``, ``x.float()``, ``x.long()``...) likewise
run on the local block (`local_conversion`).

``F.prelu`` is elementwise too, with a replicated weight: each rank applies it to
its own block, and the weight's gradient, a partial sum over the shards, is summed
over the mesh dims that shard the input in the backward pass only (DTensor has no
sharding rule for ``aten._prelu_kernel_backward``, so the fallback's backward fails).

In-place arithmetic (``add_``, ``sub_``, ``mul_``, ``div_`` and ``+=``, ``-=``, ``*=``,
``/=``) is handed to the DTensor fallback as before (`in_place_eagerly`); it is declared
only so that under ``torch.compile`` it breaks the graph and runs eagerly (traced, the
fallback's update gave a replicated operand a wrong gradient).

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
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    bind_arguments,
    delegate,
    describe_target,
    eager_handler,
    elementwise_with_replicated,
    from_local_like,
    is_partial,
    local_of,
    mesh_of,
    placements_of,
    replicated_local,
    require_shard_input,
    shard_shapes_of,
    sharding_mesh_dims,
    sum_grad_over,
    wrap_local,
)

__all__ = [
    "BINARY_WITH_REPLICATED",
    "COMPARISONS",
    "CONVERSIONS",
    "ELEMENTWISE_WITH_REPLICATED",
    "INPLACE_DELEGATED",
    "IN_PLACE_ARITHMETIC",
    "POINTWISE_ACTIVATIONS",
    "binary_with_replicated",
    "in_place_eagerly",
    "local_conversion",
    "local_pointwise",
    "prelu_local",
]

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


@eager_handler
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
                f"{placements_of(tensor)}; an in-place activation of a partial sum cannot keep "
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
        placements = [Replicate() if p.is_partial() else p for p in placements_of(tensor)]
        tensor = tensor.redistribute(mesh_of(tensor), placements)
    local_output = func(local_of(tensor), *rest, **kwargs)
    # Not from_local_like: it refuses one tensor dim sharded over several mesh dims, which this keeps.
    return wrap_local(local_output, mesh_of(tensor), placements_of(tensor), shard_shapes_of(tensor))


def _prelu(input: Any, weight: Any) -> None:
    """Mirror of ``F.prelu``'s parameters (a C builtin without an introspectable signature)."""


@eager_handler
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
        func,
        x,
        why_partial="the DTensor fallback sums it right in the forward, but its backward fails: no rule for "
        "aten._prelu_kernel_backward",
    )
    w = sum_grad_over(replicated_local(weight, f"{name}: weight"), mesh_of(x), sharding_mesh_dims(x))
    return from_local_like(F.prelu(local_of(x), w), x)


#: Binary elementwise ops whose sharded x replicated form runs on local blocks (``add`` is
#: the ``indexing_einsum`` family's, which also aligns two ShardTensors' splits).
BINARY_WITH_REPLICATED: tuple[Callable[..., Any], ...] = (
    torch.sub,
    torch.Tensor.sub,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.mul,
    torch.Tensor.mul,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.div,
    torch.Tensor.div,
    torch.Tensor.__truediv__,
    torch.Tensor.__rtruediv__,
)

#: Comparisons: on a sharded tensor and a scalar the DTensor fallback infers the boolean result's
#: split as torch.chunk's and raises a shape error on any other split (``x > 0`` on rows 5/3).
COMPARISONS: tuple[Callable[..., Any], ...] = tuple(
    op
    for name in ("gt", "ge", "lt", "le", "eq", "ne")
    for op in (getattr(torch, name), getattr(torch.Tensor, name), getattr(torch.Tensor, f"__{name}__"))
)

#: Elementwise ops of several operands (sharded alike, or replicated) that run on local blocks the same way.
ELEMENTWISE_WITH_REPLICATED: tuple[Callable[..., Any], ...] = (
    torch.addcmul,
    torch.Tensor.addcmul,
    torch.addcdiv,
    torch.Tensor.addcdiv,
    torch.lerp,
    torch.Tensor.lerp,
    torch.maximum,
    torch.Tensor.maximum,
    torch.minimum,
    torch.Tensor.minimum,
    torch.where,
    torch.Tensor.where,
)


@eager_handler
def binary_with_replicated(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``shard - target``, ``shard * weight``...: a replicated operand is cut to the shard's rows.

    The training loop of PhysicsNeMo's guidance scatters the input sharded and the
    target ``Replicate``. The DTensor fallback re-cuts a replicated operand with
    ``torch.chunk``'s split, so on any other split (a 20/16 band of patches) it raises
    a shape error. Here the replicated operand is narrowed to this rank's rows (its
    gradient summed over the shards) and the op runs locally, with no communication.
    Everything else (two ShardTensors, scalars, keyword arguments, ``Partial``
    operands) is delegated unchanged.

    Examples:
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full, target = torch.linspace(-1, 1, 36).reshape(1, 1, 9, 4), torch.ones(1, 1, 9, 4)
        >>> x = shard_tensor(full, mesh, [Shard(2)], [6, 3])
        >>> y = x - shard_tensor(target, mesh, [Replicate()])
        >>> y.placements, torch.allclose(y.full_tensor(), full - target)
        ((Shard(dim=2),), True)
    """
    result = elementwise_with_replicated(func, args, kwargs)
    if result is None and func in COMPARISONS:
        result = _with_scalars(func, args, kwargs)
    return delegate(func, types, args, kwargs) if result is None else result


def _with_scalars(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` of one sharded ShardTensor and scalars on the local block, or ``None`` (another case)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if len(tensors) != 1 or not isinstance(tensors[0], ShardTensor) or is_partial(tensors[0]):
        return None
    (tensor,) = tensors
    local_args = [local_of(a) if a is tensor else a for a in args]
    return wrap_local(func(*local_args, **kwargs), mesh_of(tensor), placements_of(tensor), shard_shapes_of(tensor))


#: Dtype conversions: elementwise, so each rank converts its own block.
CONVERSIONS: tuple[Callable[..., Any], ...] = (
    torch.Tensor.type,
    torch.Tensor.float,
    torch.Tensor.double,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.long,
    torch.Tensor.int,
    torch.Tensor.bool,
)


@eager_handler
def local_conversion(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``x.type(torch.int64)``, ``x.float()``... on the local block; the split is kept.

    The DTensor fallback sizes the converted result as ``torch.chunk``'s blocks and fails on
    other splits (DoMINO's ``mapping.type(torch.int64)`` on points 7/5). Delegated: ``type()``
    without a dtype (it returns a string), a ``Partial`` input (rounding a pending sum is not
    the sum of rounded terms), anything that is not a ShardTensor.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.linspace(0, 4, 8).reshape(1, 8), mesh, [Shard(1)], [5, 3])
        >>> y = local_conversion(torch.Tensor.type, (), (x, torch.int64), {})
        >>> y.dtype, y.placements, torch.equal(y.full_tensor(), x.full_tensor().long())
        (torch.int64, (Shard(dim=1),), True)
    """
    x, *rest = args
    if not isinstance(x, ShardTensor) or is_partial(x):
        return delegate(func, types, args, kwargs)
    if func is torch.Tensor.type and not isinstance(kwargs.get("dtype", rest[0] if rest else None), torch.dtype):
        return delegate(func, types, args, kwargs)
    return wrap_local(func(local_of(x), *rest, **kwargs), mesh_of(x), placements_of(x), shard_shapes_of(x))


#: In-place arithmetic: served by the DTensor fallback, as without this package, and never traced.
IN_PLACE_ARITHMETIC: tuple[Callable[..., Any], ...] = (
    torch.Tensor.add_,
    torch.Tensor.sub_,
    torch.Tensor.mul_,
    torch.Tensor.div_,
    torch.Tensor.__iadd__,
    torch.Tensor.__isub__,
    torch.Tensor.__imul__,
    torch.Tensor.__itruediv__,
)


@eager_handler
def in_place_eagerly(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``x.add_(y)``, ``x += y``... handed to the DTensor fallback; under ``torch.compile``, a graph break.

    Eagerly nothing changes (`delegate`). Traced, the fallback's in-place update of a
    ShardTensor computed in the same graph came out with a wrong gradient for a replicated
    operand (SongUNet's ``x.add_(params)``: the weight gradient stayed a ``Partial`` term
    of one rank), so `eager_handler` breaks the graph there instead and the update runs eagerly.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.zeros(1, 8), mesh, [Shard(1)], [5, 3])
        >>> y = in_place_eagerly(torch.Tensor.add_, (), (x, 1.0), {})
        >>> y is x, torch.equal(x.full_tensor(), torch.ones(1, 8))
        (True, True)
    """
    return delegate(func, types, args, kwargs)


#: The handler of every target this family declares, with its description.
_HANDLERS: dict[Callable[..., Any], tuple[FunctionHandler, str]] = {
    **{
        activation: (local_pointwise, f"{describe_target(activation)} on the local shard (no communication)")
        for activation in POINTWISE_ACTIVATIONS
    },
    F.prelu: (prelu_local, "prelu on the local block; weight gradient all-reduced over the shards"),
    **{
        op: (binary_with_replicated, f"{describe_target(op)} of a shard and a replicated operand on local rows")
        for op in BINARY_WITH_REPLICATED
    },
    **{
        op: (
            binary_with_replicated,
            f"{describe_target(op)} of operands sharded alike and replicated ones on local rows",
        )
        for op in ELEMENTWISE_WITH_REPLICATED
    },
    **{op: (binary_with_replicated, f"{describe_target(op)} on local blocks (with scalars too)") for op in COMPARISONS},
    **{op: (local_conversion, f"{describe_target(op)}: dtype conversion of the local block") for op in CONVERSIONS},
    **{
        op: (in_place_eagerly, f"{describe_target(op)}: the DTensor fallback, eagerly (a graph break when compiled)")
        for op in IN_PLACE_ARITHMETIC
    },
}


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the local pointwise handler for every supported activation, and prelu."""
    for target, (handler, description) in _HANDLERS.items():
        patches.function(target, handler, description=description)
