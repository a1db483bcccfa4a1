"""Keep every rank in the backward graph, even where its share of a result is empty or constant.

The backward pass of a sharded op runs collectives, and a collective completes
only when every rank of its group reaches it. A rank whose output does not
depend on its input in autograd (an empty shard, a constant fill) would skip
that backward and leave the other ranks waiting. Tying the output to the
inputs with a zero-valued term keeps it in the graph. The tie reads no values
(an empty slice is summed), so an ``inf`` or ``nan`` in a source cannot leak in.

Examples:
    >>> import torch
    >>> x = torch.tensor([float("inf"), 1.0], requires_grad=True)
    >>> out = tie_to_graph(torch.zeros(2), x)
    >>> out, out.requires_grad
    (tensor([0., 0.], grad_fn=<AddBackward0>), True)
    >>> connected_zeros(x, (0, 3)).shape
    torch.Size([0, 3])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["connected_zeros", "tie_to_graph"]


def tie_to_graph(out: torch.Tensor, *sources: torch.Tensor | None) -> torch.Tensor:
    """``out`` with the same values, made to depend on every non-``None`` ``source`` in autograd.

    Each source receives a zero gradient, so its backward (and the collectives in
    it) runs on this rank too.

    Examples:
        >>> weight = torch.ones(3, requires_grad=True)
        >>> out = tie_to_graph(torch.empty(0, 3), weight, None)   # this rank's output rows are empty
        >>> out.sum().backward()
        >>> weight.grad
        tensor([0., 0., 0.])
    """
    for source in sources:
        if source is not None:
            out = out + source.reshape(-1)[:0].sum()
    return out


def connected_zeros(source: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zeros of ``shape`` (``source``'s dtype and device) that stay in ``source``'s autograd graph.

    A rank whose share of the output is empty must still reach the exchanges of
    the backward pass, so its empty output hangs off the input.

    Examples:
        >>> local = torch.ones(2, 3, requires_grad=True)
        >>> zeros = connected_zeros(local, (0, 3))     # an empty share that still reaches ``local``
        >>> zeros.shape, zeros.grad_fn is not None
        (torch.Size([0, 3]), True)
    """
    return tie_to_graph(source.new_zeros(tuple(shape)), source)
