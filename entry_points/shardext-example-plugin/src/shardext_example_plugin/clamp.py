"""``torch.clamp`` with scalar bounds on the local shard of a ShardTensor.

Clamping is elementwise, so each rank clamps its own block and the result
keeps the input's placements and (possibly uneven) shard sizes: no
communication at all. The handler takes the five steps every handler takes,
each with its primitive from ``physicsnemo_shardext.primitives``: bind the call
(`bind_arguments`), gate the input (`require_shard_input`), plan and
exchange (nothing to do here), compute on the local block, and wrap it like the
input (`from_local_like`). `eager_handler` keeps it eager under
``torch.compile`` (a graph break at the call, never a trace on fake tensors).

Refused (``MissingShardPatch``): tensor-valued bounds, whose layout would have
to match the input's sharding; a ``Partial`` input, whose clamp is not the
clamp of its sum; and ``out=``, which would write into a tensor of another
layout.

Examples:
    On 2 ranks (``mesh`` a 1-D device mesh over them, ``rank`` this rank's index;
    ``tests/test_clamp.py`` runs these), a length of 11 split 6/5:

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-2.0, 2.0, 22).reshape(2, 11)
    >>> x = shard_tensor(full, mesh, [Shard(1)], [6, 5])
    >>> y = torch.clamp(x, min=-1.0, max=1.0)
    >>> tuple(y.to_local().shape) == [(2, 6), (2, 5)][rank]     # stays sharded like x
    True
    >>> torch.equal(y.full_tensor(), full.clamp(-1.0, 1.0))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import MissingShardPatch, PatchSet, describe_target, hookimpl
from physicsnemo_shardext.primitives import bind_arguments, eager_handler, from_local_like, require_shard_input

__all__ = ["clamp_on_local_shard", "shardext_declare_patches", "shardext_requirements"]


def _clamp(input: Any, min: Any = None, max: Any = None, *, out: Any = None) -> None:
    """Mirror of ``torch.clamp``'s parameters (a C builtin has no signature to bind against)."""


# Runs eagerly under torch.compile: a clean graph break at the sharded call, never a wrong trace.
@eager_handler
def clamp_on_local_shard(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ShardTensor:
    """Clamp each rank's local block; scalar bounds only.

    Serves ``torch.clamp`` and ``Tensor.clamp``: it calls the ``func`` it receives.

    Args:
        func: the function called (``torch.clamp`` or ``torch.Tensor.clamp``).
        types: the tensor subclasses among the arguments.
        args: the positional arguments as the user wrote them.
        kwargs: the keyword arguments as the user wrote them.

    Returns:
        A ShardTensor with the input's mesh, placements and shard sizes.

    Raises:
        MissingShardPatch: for tensor bounds, ``out=``, or a ``Partial`` input.

    Examples:
        On 2 ranks, as the module example; a tensor bound is refused:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(6.0).reshape(1, 6), mesh, [Shard(1)], [4, 2])
        >>> torch.clamp(x, min=torch.zeros(()))
        Traceback (most recent call last):
        ...
        physicsnemo.domain_parallel.shard_utils.patch_core.MissingShardPatch: torch.clamp: scalar min/max only on ShardTensor, not tensor bounds
    """
    name = describe_target(func)
    bound = bind_arguments(_clamp, args, kwargs)
    if isinstance(bound["min"], torch.Tensor) or isinstance(bound["max"], torch.Tensor):
        raise MissingShardPatch(f"{name}: scalar min/max only on ShardTensor, not tensor bounds")
    if bound["out"] is not None:
        raise MissingShardPatch(f"{name}: out= is not supported on ShardTensor")
    x = require_shard_input(func, bound["input"], why_partial="the clamp of a sum is not the sum of clamps")
    local = func(x.to_local(), bound["min"], bound["max"])
    return from_local_like(local, x)


@hookimpl
def shardext_requirements() -> Mapping[str, str]:
    """Versions this plugin was tested with; outside them it is skipped with a warning."""
    return {"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the clamp handler for the function and the method form."""
    patches.function(torch.clamp, clamp_on_local_shard)
    patches.function(torch.Tensor.clamp, clamp_on_local_shard)
