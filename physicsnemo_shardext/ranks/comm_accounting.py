"""Count collectives and the bytes they move, with a TorchDispatchMode.

`CommCounter` intercepts the dispatcher ops behind ``torch.distributed``
(``torch.ops.c10d.*``: ``allreduce_``, ``allgather_``, ``_allgather_base_``,
``reduce_scatter_``, ``alltoall_``, ``broadcast_``, ``send``, ``recv_`` ...) and
the functional collectives DTensor uses (``torch.ops._c10d_functional.*``).
Unlike ``CommDebugMode`` it installs no module hooks, so it cannot disturb
unevenly sharded ShardTensors. Ops on DTensor / ShardTensor are deferred to
their own dispatch with the counter still active, so the collectives issued
*inside* it (a redistribution of the DTensor fallback) are counted too.

**Bytes definition**: for each call, the sum of ``nbytes`` of the tensors this
rank *hands to* the collective (its input/payload: e.g. the tensor of an
``all_reduce``, this rank's input of an ``all_gather``, the send buffer of a
``send``; for ``recv`` the receive buffer). Output buffers are not counted, so
an all_gather of a 1 KiB shard counts 1 KiB whatever the world size.

Examples:
    On any number of ranks:

    ```python
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(256))        # 1 call, 1024 bytes
    assert counter.stats.counts == {"c10d.allreduce_": 1}
    assert counter.stats.bytes == {"c10d.allreduce_": 1024}
    ```

    Local computation issues no collective:

    >>> with CommCounter() as counter:
    ...     _ = torch.ones(256) * 2
    >>> counter.stats.counts, str(counter.stats)
    ({}, 'no collectives')
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CommCounter", "CommStats", "PhaseCommStats"]

_DISTRIBUTED_SUBCLASSES = (DTensor, ShardTensor)

# Ops that are bookkeeping, not communication.
_IGNORED = {"wait_tensor", "wait", "_wrap_tensor_autograd"}

# For c10d in-place ops the payload is not always argument 0: ops that take
# (outputs, inputs, ...) carry this rank's contribution in argument 1.
_PAYLOAD_ARGUMENT = {
    "allgather_": 1,
    "_allgather_base_": 1,
    "allgather_coalesced_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "reduce_scatter_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "alltoall_": 1,
    "alltoall_base_": 1,
    "gather_": 1,
    "scatter_": 1,
}


def _op_name(func: Any) -> tuple[str, str] | None:
    """``(namespace, op)`` for a collective op, else ``None``."""
    namespace = getattr(func, "namespace", None)
    if namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"):
        return None
    name = func._schema.name.split("::", 1)[-1]
    if name in _IGNORED:
        return None
    return namespace, name


def _payload_bytes(namespace: str, name: str, args: tuple, kwargs: dict) -> int:
    index = _PAYLOAD_ARGUMENT.get(name, 0) if namespace == "c10d" else 0
    if index >= len(args):
        return 0
    return sum(t.nbytes for t in tree_leaves(args[index]) if isinstance(t, torch.Tensor))


@dataclass
class CommStats:
    """Collective calls and bytes, keyed by ``"namespace.op"`` (e.g. ``"c10d.allreduce_"``).

    Examples:
        >>> stats = CommStats()
        >>> stats.record("c10d.allreduce_", 1024)
        >>> stats.record("c10d.allreduce_", 16)
        >>> stats.total_calls, stats.total_bytes, str(stats)
        (2, 1040, 'c10d.allreduce_ x2 (1040 B)')
    """

    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total_calls(self) -> int:
        """All collective calls."""
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> int:
        """All payload bytes (see the module docstring for the definition)."""
        return sum(self.bytes.values())

    def record(self, key: str, nbytes: int) -> None:
        """Add one call of ``key`` moving ``nbytes``."""
        self.counts[key] = self.counts.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def __str__(self) -> str:
        if not self.counts:
            return "no collectives"
        parts = [f"{k} x{self.counts[k]} ({self.bytes[k]} B)" for k in sorted(self.counts)]
        return ", ".join(parts)


@dataclass
class PhaseCommStats:
    """Collectives of a forward and a backward pass, counted separately."""

    forward: CommStats = field(default_factory=CommStats)
    backward: CommStats = field(default_factory=CommStats)

    def __str__(self) -> str:
        return f"forward: {self.forward}; backward: {self.backward}"


class CommCounter(TorchDispatchMode):
    """A dispatch mode that records every collective issued while it is active.

    Collectives issued by autograd inside ``backward()`` are seen too, as long as
    ``backward()`` is called within the ``with`` block (on CPU autograd runs the
    backward on the calling thread, where the mode is active).

    Examples:
        ```python
        counter = CommCounter()
        with counter:
            y = model(xs)
        print(counter.stats.counts, counter.stats.total_bytes)
        ```
    """

    def __init__(self) -> None:
        super().__init__()
        self.stats = CommStats()
        self.calls: list[tuple[str, int]] = []  # in order, for debugging

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, _DISTRIBUTED_SUBCLASSES) for t in types):
            # A mode is switched off while its handler runs. Deferring ops on DTensor /
            # ShardTensor lets their own dispatch run with the counter still active, so
            # the collectives they issue inside (e.g. a DTensor fallback's all-gather) count.
            return NotImplemented
        kwargs = kwargs or {}
        named = _op_name(func)
        if named is not None:
            namespace, name = named
            nbytes = _payload_bytes(namespace, name, args, kwargs)
            key = f"{namespace}.{name}"
            self.stats.record(key, nbytes)
            self.calls.append((key, nbytes))
        return func(*args, **kwargs)

    def counts(self) -> Counter:
        """The call counts as a ``collections.Counter``."""
        return Counter(self.stats.counts)
