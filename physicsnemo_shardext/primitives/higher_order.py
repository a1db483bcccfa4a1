"""Second-order gradients through hand-written backwards: keep the graph, or refuse by name.

Under ``torch.autograd.grad(..., create_graph=True)`` autograd runs every
``backward`` with grad mode on and differentiates what it returns. A backward
built from collectives on raw tensors (an all-to-all, a halo exchange, a
re-wrap of a local block as a new ShardTensor) returns a tensor with no graph:
the gradient penalty or PINN residual built from it then trains without its
second-order terms, and nothing says so. Two tools close that gap:

* `linear_backward` runs a *linear* backward map (an exchange, a slice, a
  scatter-add: anything whose value is a linear function of the gradient alone)
  through an autograd Function whose own backward is the forward map, and so
  on at every order. The pair must be adjoint: ``<bwd(g), x> == <g, fwd(x)>``
  summed over the ranks, which is what every exchange and its reverse are.
* `refuse_higher_order` raises ``MissingShardPatch`` naming the op when a
  backward that cannot be differentiated is asked to build a graph.

`materialized` gives a block with no two elements sharing memory: a gradient
that is an expanded view (stride 0, the backward of a sum or a mean) must not
become a leaf's ``.grad``, into which the next backward adds in place.

Examples:
    A map and its adjoint (here a reversal, its own adjoint) differentiate at every order:

    >>> flip = lambda t: t.flip(0)
    >>> g = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> out = linear_backward(g, flip, flip)
    >>> out, torch.autograd.grad((out * torch.tensor([3.0, 5.0])).sum(), g)[0]
    (tensor([2., 1.], grad_fn=<_LinearMapBackward>), tensor([5., 3.]))
    >>> materialized(torch.ones(1).expand(3)).stride()
    (1,)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from physicsnemo_shardext.errors import MissingShardPatch

__all__ = ["builds_graph", "has_internal_overlap", "linear_backward", "materialized", "refuse_higher_order"]

LinearMap = Callable[[torch.Tensor], torch.Tensor]


def builds_graph(*grads: Any) -> bool:
    """Whether this backward must return a differentiable result (``create_graph=True`` and a grad that needs it).

    Examples:
        >>> builds_graph(torch.ones(2))          # grad mode on, but nothing to differentiate
        False
        >>> builds_graph(torch.ones(2, requires_grad=True))
        True
    """
    return torch.is_grad_enabled() and any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads)


class _LinearMap(torch.autograd.Function):
    """``apply(x)``; backward ``adjoint(g)``, itself through this Function (so every order is exact)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, apply: LinearMap, adjoint: LinearMap) -> torch.Tensor:
        ctx.maps = (apply, adjoint)
        return apply(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        apply, adjoint = ctx.maps
        return linear_backward(grad, adjoint, apply), None, None


def linear_backward(grad: torch.Tensor, backward_map: LinearMap, forward_map: LinearMap) -> torch.Tensor:
    """``backward_map(grad)``, differentiable (its adjoint is ``forward_map``) when a graph is being built.

    Call it from an autograd Function's ``backward`` whose result is a linear
    function of ``grad`` only. Outside ``create_graph`` it is ``backward_map(grad)``
    with no extra cost. Both maps must be called identically on every rank (they
    usually hold collectives).

    Examples:
        A backward that scatters a gradient into a zero block of 3 rows (adjoint: take the rows):

        >>> put = lambda g: torch.zeros(3).index_add(0, torch.tensor([0, 2]), g)
        >>> take = lambda t: t[torch.tensor([0, 2])]
        >>> g = torch.tensor([1.0, 4.0], requires_grad=True)
        >>> linear_backward(g, put, take).detach()
        tensor([1., 0., 4.])
    """
    if builds_graph(grad):
        return cast(
            torch.Tensor, cast(Any, _LinearMap).apply(grad, backward_map, forward_map)
        )  # Function.apply: untyped before torch 2.14
    return backward_map(grad)


def refuse_higher_order(op: str, *grads: Any) -> None:
    """Raise ``MissingShardPatch`` naming ``op`` when a graph of this backward is requested.

    For a backward that is not differentiable (a hand-written ring attention, say):
    a second-order gradient through it would silently miss terms.

    Examples:
        >>> refuse_higher_order("my_op", torch.ones(1))          # first order: nothing to refuse
        >>> try:
        ...     refuse_higher_order("my_op", torch.ones(1, requires_grad=True))
        ... except MissingShardPatch as error:
        ...     print(str(error).split(";")[0])
        my_op: second-order gradients (create_graph=True) are not supported through its backward
    """
    if builds_graph(*grads):
        raise MissingShardPatch(
            f"{op}: second-order gradients (create_graph=True) are not supported through its backward; "
            "compute this term on plain tensors (full_tensor()) or without create_graph"
        )


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a stride of 0 over more than one element).

    Examples:
        >>> has_internal_overlap(torch.ones(1, 4).expand(3, 4)), has_internal_overlap(torch.ones(3, 4))
        (True, False)
    """
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where elements share memory (what AccumulateGrad can add into in place).

    Examples:
        >>> base = torch.ones(2)
        >>> materialized(base) is base
        True
    """
    return t.contiguous() if has_internal_overlap(t) else t
