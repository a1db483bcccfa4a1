"""The three collectives every exchange of this package goes through, eager or traced.

Eagerly each is the c10d call it replaces (in-place into a buffer, no extra copy).
On *fake* operands (Dynamo's shape propagation, AOTAutograd's trace; see
`is_tracing`) each becomes the matching *functional* collective of
``torch.distributed._functional_collectives``: an op with a fake implementation
that the trace records as a graph node, so a handler built on the exchanges
(`move_shard`, `all_gather_rows`, `summed_over`, the halo fetch, ...) compiles
into the graph with its communication, instead of breaking the graph.

A traced collective of a backward is tagged to stay in the backward graph
(`_kept_in_backward`): AOTAutograd's partitioner moves every node that does not
depend on a tangent into the forward graph, and on a rank whose contribution is
empty or zeros (an empty shard, a halo with no gradient) a collective would move
while its partner on another rank stays: the ranks would then pair different
collectives (a hang, or gloo's "Received data size doesn't match").

Why the split rather than functional collectives everywhere: eagerly the
functional ops allocate their output and wrap it in an ``AsyncCollectiveTensor``;
the c10d calls reuse the buffer the caller already holds, which keeps the eager
host time and memory exactly as they were.

Examples:
    On 2 ranks:

    >>> group = mesh.get_group(0)
    >>> reduce_copy(torch.tensor([rank + 1.0]), "sum", group)
    tensor([3.])
    >>> wait = start_all_to_all(torch.tensor([10.0 * rank, 10.0 * rank + 1]), [1, 1], [1, 1], group)
    >>> wait().tolist() == ([0.0, 10.0] if rank == 0 else [1.0, 11.0])
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

__all__ = ["gather_blocks", "reduce_copy", "start_all_to_all"]


#: The reduce ops by name: callers pass names (Dynamo of torch 2.12 cannot trace a ``ReduceOp``).
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` belongs to a trace: Dynamo tracing this code itself, or a handler run on fake operands."""
    return torch.compiler.is_dynamo_compiling() or is_fake(t)


def _functional() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


@contextlib.contextmanager
def _kept_in_backward() -> Iterator[None]:
    """While AOTAutograd traces a backward, tag the nodes made here ``must_be_in_backward``."""
    from torch.fx import traceback as fx_traceback

    if torch.compiler.is_dynamo_compiling():  # Dynamo records the collective; AOTAutograd never runs this code
        yield
        return
    meta = fx_traceback.current_meta
    if not (fx_traceback.has_preserved_node_meta() and meta.get("partitioner_tag") == "is_backward"):
        yield
        return
    meta["partitioner_tag"] = "must_be_in_backward"
    try:
        yield
    finally:
        meta["partitioner_tag"] = "is_backward"


def start_all_to_all(
    send: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any
) -> Callable[[], torch.Tensor]:
    """Start one ``all_to_all_single`` of the rows of ``send``; return a wait that gives the received rows.

    ``in_splits[r]`` rows of ``send`` (along dim 0, in group-rank order) go to group
    rank ``r``; ``out_splits[r]`` rows come from it. Eagerly the collective runs
    asynchronously into a new buffer; traced, it is a functional all-to-all whose
    wait is recorded where the caller waits.
    """
    out_splits, in_splits = [int(n) for n in out_splits], [int(n) for n in in_splits]
    send = send.contiguous()
    if _traced(send):
        funcol = _functional()
        with _kept_in_backward():
            pending = funcol.all_to_all_single(send, out_splits, in_splits, group)

        def wait_traced() -> torch.Tensor:
            with _kept_in_backward():
                return funcol.wait_tensor(pending)  # type: ignore[no-any-return]

        return wait_traced
    recv = send.new_empty((sum(out_splits), *send.shape[1:]))
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)

    def wait() -> torch.Tensor:
        if work is not None:
            work.wait()
        return recv

    return wait


def reduce_copy(value: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """A contiguous, detached copy of ``value`` all-reduced with ``op`` (``"sum"``, ``"max"``, ``"min"``) over ``group``."""
    result = value.detach().clone(memory_format=torch.contiguous_format)
    if _traced(result):
        funcol = _functional()
        with _kept_in_backward():
            return funcol.wait_tensor(funcol.all_reduce(result, op, group))  # type: ignore[no-any-return]
    dist.all_reduce(result, op=_REDUCE_OPS[op], group=group)
    return result


def gather_blocks(block: torch.Tensor, parts: int, group: Any) -> list[torch.Tensor]:
    """Every group rank's ``block`` (all the same shape), in group-rank order: one all-gather."""
    block = block.contiguous()
    if _traced(block):
        funcol = _functional()
        with _kept_in_backward():
            stacked = funcol.wait_tensor(funcol.all_gather_tensor(block.unsqueeze(0), 0, group))
        return list(stacked.unbind(0))
    received = [torch.empty_like(block) for _ in range(parts)]
    dist.all_gather(received, block, group=group)
    return received
