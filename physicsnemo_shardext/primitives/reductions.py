"""The three gradient contracts of a sum over ranks, each named after what it does forward and backward.

Every sharded handler that adds something up across ranks needs exactly one of
these, and picking the wrong one is how a model trains on doubled (or halved)
gradients without any error. Choose by asking *what the forward value is* and
*what the backward cotangent is* on each rank:

================================  ================  ===================  ==============================
primitive                         forward           backward             right when
================================  ================  ===================  ==============================
`sum_grad_over`             identity          sum over ranks       a replicated operand (weight,
                                                                         bias, embedding) meets this
                                                                         rank's rows only
`all_reduce_sum`            sum over ranks    sum over ranks       a partial statistic (softmax
                                                                         denominator, norm moments)
                                                                         feeds back into *sharded* rows
`sum_to_replicated`         sum over ranks    identity             the total is a *replicated*
                                                                         value (a loss, a pooled vector)
                                                                         whose cotangent is the same on
                                                                         every rank
================================  ================  ===================  ==============================

Second order (``create_graph=True``): each backward is built from these primitives too,
so it differentiates again. `sum_grad_over` and `sum_to_replicated` are each other's
adjoint (a parameter's summed gradient is a replicated value; a replicated cotangent
that feeds every rank's terms gets its gradient summed), and `all_reduce_sum` is its own.

Design decision (see docs/reference/primitives.md): these use the in-place
``torch.distributed`` collectives inside ``torch.autograd.Function`` s, like every
other exchange in ``primitives/``. ShardTensor's handlers run in eager mode (its
``__torch_function__`` dispatch is where a compiled graph hands over to them), the
gloo backend that CPU tests use implements every c10d op needed, and
``CommCounter`` reports them under stable ``c10d.*`` names. Each call opens a
``torch.profiler.record_function`` range named ``shardext.<primitive>``.

Examples:
    On 2 ranks (``mesh`` a 1-D device mesh over them, ``rank`` this rank's index;
    ``tests/test_doctests.py`` runs these on 2 gloo ranks):

    >>> import torch
    >>> w = torch.ones(3, requires_grad=True)
    >>> sum_grad_over(w, mesh, [0]).sum().backward()
    >>> w.grad                        # each rank's ones, summed over the 2 ranks
    tensor([2., 2., 2.])
    >>> all_reduce_sum(torch.tensor([rank + 1.0]), mesh, [0])
    tensor([3.])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_shardext.primitives.collectives import reduce_copy
from physicsnemo_shardext.primitives.profiling import profiled_range

__all__ = ["all_reduce_sum", "max_over", "min_over", "sum_grad_over", "sum_to_replicated", "summed_over"]


def _spanning(mesh: DeviceMesh, mesh_dims: Sequence[int]) -> tuple[int, ...]:
    """The mesh dims with more than one coordinate: a sum over a single rank is the value itself."""
    return tuple(d for d in mesh_dims if mesh.size(d) > 1)


def summed_over(value: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """A contiguous copy of ``value`` summed over each of ``mesh_dims`` in turn; not differentiable.

    The collective under the three gradient contracts, for the inside of an
    ``autograd.Function`` whose backward is written by hand (a norm's statistics
    and their gradients). One all-reduce per mesh dim of more than one rank; none
    (a copy) where every dim has a single rank. Use `all_reduce_sum` where autograd
    should see the sum.

    Examples:
        On 2 ranks:

        >>> summed_over(torch.tensor([rank + 1.0]), mesh, [0])
        tensor([3.])
    """
    total = value.detach().clone(memory_format=torch.contiguous_format)
    for mesh_dim in _spanning(mesh, mesh_dims):
        total = reduce_copy(total, "sum", mesh.get_group(mesh_dim))
    return total


def _reduced_over(value: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int], op: Any, name: str) -> torch.Tensor:
    """A contiguous, detached copy of ``value`` all-reduced with ``op`` over each spanning mesh dim in turn."""
    result = value.detach().clone(memory_format=torch.contiguous_format)
    spanning = _spanning(mesh, mesh_dims)
    if not spanning:
        return result
    with profiled_range(name):
        for mesh_dim in spanning:
            result = reduce_copy(result, op, mesh.get_group(mesh_dim))
    return result


def max_over(value: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """The elementwise maximum of every rank's ``value`` over ``mesh_dims``; a new tensor, not differentiable.

    For a shift that needs no gradient (a softmax's row maximum over a sharded dim,
    the winning value of a max pool) or a decision every rank must take alike. Each
    rank passes a tensor of the same shape and dtype; a rank without rows of its own
    passes the identity of the maximum (``-inf``, or the dtype's smallest value).
    ``value`` is left as it was. One all-reduce per mesh dim of more than one rank;
    none (a copy) where every dim has a single rank.

    Examples:
        On 2 ranks:

        >>> max_over(torch.tensor([rank + 1.0, -rank]), mesh, [0])
        tensor([2., 0.])
    """
    return _reduced_over(value, mesh, mesh_dims, "max", "shardext.max_over")


def min_over(value: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """The elementwise minimum of every rank's ``value`` over ``mesh_dims``; a new tensor, not differentiable.

    The counterpart of `max_over`: the smallest candidate index among tied maxima (a
    max pool's first maximum, as PyTorch picks it), the smallest of per-rank bounds.
    A rank without a candidate passes the identity of the minimum (``inf``, or the
    dtype's largest value).

    Examples:
        On 2 ranks:

        >>> min_over(torch.tensor([rank + 1, 5 - rank]), mesh, [0])
        tensor([1, 4])
    """
    return _reduced_over(value, mesh, mesh_dims, "min", "shardext.min_over")


def _apply(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """``function.apply(*args)``, typed: torch's stubs type ``Function.apply`` from 2.14 on only."""
    return cast(torch.Tensor, cast(Any, function).apply(*args))


class _SumGradOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.mesh_dims = mesh, mesh_dims
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # The summed gradient is a replicated value (a parameter's gradient, the same on every rank):
        # its adjoint is `_SumToReplicated`'s, so a penalty on it (create_graph=True) is not summed twice.
        with profiled_range("shardext.sum_grad_over.backward"):
            return _apply(_SumToReplicated, grad, ctx.mesh, ctx.mesh_dims), None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.mesh_dims = mesh, mesh_dims
        return summed_over(value, mesh, mesh_dims)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # The sum over ranks is its own adjoint: applying it again keeps double backward exact.
        with profiled_range("shardext.all_reduce_sum.backward"):
            return _apply(_AllReduceSum, grad, ctx.mesh, ctx.mesh_dims), None, None


class _SumToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, addend: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.mesh_dims = mesh, mesh_dims
        return summed_over(addend, mesh, mesh_dims)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if torch.is_grad_enabled() and grad.requires_grad:
            # create_graph=True: the replicated cotangent now feeds every rank's terms, so its own
            # gradient is a sum over the ranks (`_SumGradOver`, this Function's adjoint).
            return _apply(_SumGradOver, grad, ctx.mesh, ctx.mesh_dims), None, None
        return grad, None, None


def sum_grad_over(value: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """``value`` unchanged; in backward its gradient is summed over ``mesh_dims``.

    Right for a replicated operand that each rank applies to its own rows only: a
    conv/linear weight, a norm's affine parameters, a positional embedding cut to a
    shard. Each rank's gradient is then a partial sum over its rows, and the sum
    over the ranks that shard those rows is the whole gradient, the same on every
    rank. Pass the mesh dims that shard the *counterpart* (the sharded input), e.g.
    ``sharding_mesh_dims(x)``. Forward: no communication; backward: one all-reduce
    per mesh dim.

    Examples:
        On 2 ranks, each rank scaling the shared weight by its own factor:

        >>> w = torch.ones(2, requires_grad=True)
        >>> (sum_grad_over(w, mesh, [0]) * (rank + 1)).sum().backward()
        >>> w.grad                    # 1 + 2 on both ranks
        tensor([3., 3.])
    """
    mesh_dims = _spanning(mesh, mesh_dims)
    if not mesh_dims:
        return value
    with profiled_range("shardext.sum_grad_over"):
        return _apply(_SumGradOver, value, mesh, mesh_dims)


def all_reduce_sum(value: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """The sum of every rank's ``value`` over ``mesh_dims``; in backward the gradient is summed too.

    Right for a partial statistic whose total is used again by *sharded* rows: the
    denominator of a softmax over a sharded dim, the moments of a norm. Every rank's
    rows contribute to the total and every rank's rows read it, so each addend's
    gradient is the sum of all ranks' cotangents. Forward and backward: one
    all-reduce per mesh dim.

    Examples:
        On 2 ranks, a softmax denominator from each rank's partial sum:

        >>> part = torch.tensor([rank + 1.0], requires_grad=True)
        >>> total = all_reduce_sum(part, mesh, [0])
        >>> total.backward(torch.ones(1))
        >>> total, part.grad          # the sum, and every rank's cotangent summed
        (tensor([3.], grad_fn=<_AllReduceSumBackward>), tensor([2.]))
    """
    mesh_dims = _spanning(mesh, mesh_dims)
    if not mesh_dims:
        return value
    with profiled_range("shardext.all_reduce_sum"):
        return _apply(_AllReduceSum, value, mesh, mesh_dims)


def sum_to_replicated(addend: torch.Tensor, mesh: DeviceMesh, mesh_dims: Sequence[int]) -> torch.Tensor:
    """The sum of every rank's ``addend`` over ``mesh_dims``, the same on each rank; identity in backward.

    Right where the total is a *replicated* value (a loss every rank holds whole and
    calls ``backward`` on with the same cotangent, a globally pooled vector): each
    rank's addend then receives that cotangent unchanged, and the ranks together
    cover every term exactly once. Using `all_reduce_sum` here would scale the
    gradient by the number of ranks. Forward: one all-reduce per mesh dim.

    Examples:
        On 2 ranks, a loss summed from each rank's terms:

        >>> part = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> loss = sum_to_replicated(part.sum(), mesh, [0])
        >>> loss.backward()
        >>> loss.item(), part.grad    # 3 + 3 on both ranks; the cotangent passes unchanged
        (6.0, tensor([1., 1.]))
    """
    mesh_dims = _spanning(mesh, mesh_dims)
    if not mesh_dims:
        return addend
    with profiled_range("shardext.sum_to_replicated"):
        return _apply(_SumToReplicated, addend, mesh, mesh_dims)
