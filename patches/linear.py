"""``F.linear`` on row-sharded inputs with parameter gradients reduced and ``Replicate``.

A linear layer acts on the last (feature) dimension only, so for an input
sharded on any other dimension each rank applies the weight to its own rows and
the output keeps the input's placements and uneven split, with no forward
communication. PhysicsNeMo 2.2's built-in does the same forward, but when the
parameters are distributed (``distribute_module``) it hands back weight and
bias gradients as ``Partial`` DTensors, leaving the reduction to whoever reads
them. Every other first-party patch (convolution, normalization) returns
reduced ``Replicate`` gradients, which is what an optimizer step on replicated
parameters and ``check_conformance`` expect. This override reduces them in the
backward pass: one all-reduce of the weight (and one of the bias) gradient per
mesh dimension that shards the input.

Delegated to the built-in (`delegate`):
calls whose input is not a ShardTensor, and inputs sharded on the feature dimension
(a contraction over a sharded dim, which the built-in routes to DTensor).
Inputs with a ``Partial`` placement (GALE's attention projection) are summed
first (one all-reduce, as the built-in's DTensor path does), then handled like
any other, so the weight gradient is reduced and ``Replicate`` where the built-in
leaves it ``Partial``.

``F.embedding`` (``nn.Embedding``) of sharded token ids: each rank looks up its own ids
in the replicated table; the output keeps the ids' placements and split (the embedding
dim is appended) and the table's gradient is summed over the mesh dims that shard the
ids (the fallback hands it back ``Partial`` and fails on uneven splits). Delegated:
ids that are not a ShardTensor or are ``Partial``, and ``max_norm`` (renormalises rows of
the table in place from each rank's own ids), ``scale_grad_by_freq`` (needs global id
counts) and ``sparse`` gradients, which keep the path they had before this plugin.

Refused (``MissingShardPatch``): sharded (non-``Replicate``) weights or biases,
and one tensor dim sharded over several mesh dims (what PhysicsNeMo's own ``view`` gives
when flattening an H- and W-sharded grid into points, and cannot reshape back;
with the ``layout_ops`` plugin that reshape gathers W first, so FNO's decoder
gets points sharded over one mesh dim).

Examples:
    On 2 ranks (``mesh``, ``rank``), rows split 9/8; the weight gradient is summed over both ranks:

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(-1, 1, 17 * 8).reshape(1, 17, 8)
    >>> w = torch.linspace(-1, 1, 3 * 8).reshape(3, 8).requires_grad_()
    >>> y = F.linear(shard_tensor(full, mesh, [Shard(1)], [9, 8]), w)
    >>> tuple(y.to_local().shape) == [(1, 9, 3), (1, 8, 3)][rank]
    True
    >>> torch.allclose(y.full_tensor(), F.linear(full, w), atol=1e-6)
    True
    >>> y.to_local().sum().backward()
    >>> torch.allclose(w.grad, full.sum((0, 1)).expand(3, 8), atol=1e-5)   # both ranks' rows
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Replicate

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    bind_arguments,
    delegate,
    eager_handler,
    from_local_like,
    is_partial,
    local_of,
    mesh_of,
    placements_of,
    replicated_local,
    sharded_dims,
    sharding_mesh_dims,
    sum_grad_over,
)

__all__ = ["sharded_embedding", "sharded_linear"]


def _linear(input: Any, weight: Any, bias: Any = None) -> None:
    """The parameters of ``F.linear`` (a C builtin without an introspectable signature)."""


@eager_handler
def sharded_linear(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Local ``F.linear`` on each rank's rows; weight/bias gradients summed over the sharded mesh dims.

    Declared with ``patches.function(torch.nn.functional.linear, sharded_linear, override=True)``.
    """
    a = bind_arguments(_linear, args, kwargs)
    x, weight, bias = a["input"], a["weight"], a["bias"]
    if not isinstance(x, ShardTensor):
        return delegate(func, types, args, kwargs)
    if is_partial(x):
        # The sum first (one all-reduce, as the built-in does inside DTensor), so that the
        # weight gradient comes back reduced and Replicate like every other call's.
        x = x.redistribute(mesh_of(x), [Replicate() if p.is_partial() else p for p in placements_of(x)])
    if (x.ndim - 1) in sharded_dims(x):  # raises MissingShardPatch for nested sharding of one dim
        return delegate(func, types, args, kwargs)  # contraction over the sharded feature dim
    mesh, mesh_dims = mesh_of(x), sharding_mesh_dims(x)
    weight = sum_grad_over(replicated_local(weight, "torch.nn.functional.linear: weight"), mesh, mesh_dims)
    if bias is not None:
        bias = sum_grad_over(replicated_local(bias, "torch.nn.functional.linear: bias"), mesh, mesh_dims)
    return from_local_like(F.linear(local_of(x), weight, bias), x)


def _embedding(
    input: Any,
    weight: Any,
    padding_idx: Any = None,
    max_norm: Any = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> None:
    """The parameters of ``F.embedding``."""


@eager_handler
def sharded_embedding(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``F.embedding`` of sharded ids: a local lookup; the table's gradient summed over the sharding mesh dims.

    Examples:
        Token ids split 3/2 on 2 ranks:

        >>> import torch
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> ids = shard_tensor(torch.tensor([[0, 3, 1, 3, 2]]), mesh, [Shard(1)], [3, 2])
        >>> table = torch.linspace(-1, 1, 8).reshape(4, 2).requires_grad_()
        >>> vectors = F.embedding(ids, table)
        >>> vectors.placements, tuple(vectors.to_local().shape) == [(1, 3, 2), (1, 2, 2)][rank]
        ((Shard(dim=1),), True)
        >>> vectors.to_local().sum().backward()
        >>> table.grad[:, 0]                      # id 3 appears twice, once on each rank
        tensor([1., 1., 1., 2.])
    """
    a = bind_arguments(_embedding, args, kwargs)
    ids, weight = a["input"], a["weight"]
    if (
        not isinstance(ids, ShardTensor)
        or is_partial(ids)
        or a["max_norm"] is not None
        or a["scale_grad_by_freq"]
        or a["sparse"]
    ):
        return delegate(func, types, args, kwargs)
    mesh, mesh_dims = mesh_of(ids), sharding_mesh_dims(ids)
    table = sum_grad_over(replicated_local(weight, "torch.nn.functional.embedding: weight"), mesh, mesh_dims)
    local = F.embedding(local_of(ids), table, a["padding_idx"])
    return from_local_like(local, ids)


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Override the built-in ``F.linear`` handler (it delegates back for what it does not change)."""
    patches.function(
        F.linear,
        sharded_linear,
        override=True,
        description="F.linear on row shards; weight/bias gradients reduced to Replicate",
    )
    patches.function(
        F.embedding,
        sharded_embedding,
        description="F.embedding of sharded ids: local lookup; table gradient reduced to Replicate",
    )
