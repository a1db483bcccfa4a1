"""The attention family's routing of ``F.scaled_dot_product_attention``: ring, local, replicated query, batch/head.

`sharded_sdpa` takes every call of ``F.scaled_dot_product_attention`` with a
ShardTensor operand and picks, from the operands' layouts, one of four ways (the
package, ``physicsnemo_shardext.patches.attention``, lists what it delegates and refuses):

* query and K/V sharded on their sequence dim (``-2``) over the same mesh dim: the
  ring (`ring_attention_local`, in the package's ``ring`` module);
* query sharded on its sequence dim, K/V replicated: local attention of the query
  rows against the whole K/V, the K/V gradients summed over the shards;
* query replicated, K/V sharded on their sequence dim (FLARE's global queries):
  `replicated_query_attention`, the softmax over all keys assembled from per-rank
  partial sums (`max_over`, then ``sum_to_replicated``); no key or value moves;
* q, k, v (and a mask) split alike on the batch or head dim (`_batch_or_head_sdpa`):
  torch's kernel on the local blocks, no communication.

Masks are cut here to each rank's rows (`_local_mask`) and a causal mask built from
global positions (`_causal_mask`); the helpers that tell a batch/head split
(`_batch_or_head_split`, `_fused_mask_rows`) serve the CPU fused kernel's handlers too.

Examples:
    On 2 ranks, global queries against keys and values split 5/4 (a replicated result):

    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> g = torch.Generator().manual_seed(5)
    >>> q, k, v = (torch.randn(1, n, 8, generator=g) for n in (3, 9, 9))
    >>> ks, vs = (shard_tensor(t, mesh, [Shard(1)], [5, 4]) for t in (k, v))
    >>> out = F.scaled_dot_product_attention(q, ks, vs)
    >>> out.placements, torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v), atol=1e-6)
    ((Replicate(),), True)

    Heads split 1/1: each rank runs torch's kernel on its own heads:

    >>> q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    >>> qs, ks, vs = (shard_tensor(t, mesh, [Shard(1)], [1, 1]) for t in (q, k, v))
    >>> out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    >>> out.placements, torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    ((Shard(dim=1),), True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Replicate

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.attention.ring import _NEG_INF, _expand_heads, _work_dtype, ring_attention_local
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    build_shard_tensor,
    delegate,
    eager_handler,
    from_local_like,
    is_partial,
    is_replicated,
    local_of,
    max_over,
    mesh_of,
    replicated_local,
    sharded_dims,
    sum_grad_over,
    sum_to_replicated,
    tie_to_graph,
)

__all__ = ["replicated_query_attention", "sharded_sdpa"]

_NAME = "torch.nn.functional.scaled_dot_product_attention"


def _sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> None:
    """Mirror of ``F.scaled_dot_product_attention`` (a C builtin without a signature)."""


def _is_shard_tensor_like(x: Any) -> bool:
    return isinstance(x, (ShardTensor, DTensor))


def _replicated(x: Any) -> bool:
    """A plain tensor or a ShardTensor/DTensor replicated on every mesh dim."""
    return isinstance(x, torch.Tensor) and (not _is_shard_tensor_like(x) or is_replicated(x))


def _sequence_layout(x: Any) -> DimLayout | None:
    """The layout of ``x``'s sequence dim if that is its only sharded dim, else ``None``."""
    if not isinstance(x, ShardTensor) or is_partial(x):
        return None
    layouts = sharded_dims(x)
    if set(layouts) != {x.ndim - 2}:
        return None
    return layouts[x.ndim - 2]


def _shapes_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    """Same batch dims, matching feature and sequence sizes, heads equal (or divisible with GQA)."""
    if not (q.ndim == k.ndim == v.ndim >= 2) or not (q.dtype == k.dtype == v.dtype):
        return False
    if k.shape[-1] != q.shape[-1] or k.shape[-2] != v.shape[-2]:
        return False
    if q.ndim == 2:
        return True
    if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]) or k.shape[-3] != v.shape[-3]:
        return False
    if enable_gqa:
        return k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0
    return q.shape[-3] == k.shape[-3]


def _local_mask(mask: Any, q: ShardTensor, q_layout: DimLayout, kv_len: int) -> torch.Tensor | None:
    """This rank's query rows of ``attn_mask`` (all key columns), or refuse a layout that cannot give them."""
    if mask is None:
        return None
    if mask.ndim > q.ndim or (mask.ndim >= 1 and mask.shape[-1] not in (1, kv_len)):
        return None  # torch's own broadcasting error, raised by the caller
    if mask.ndim >= 2 and mask.shape[-2] not in (1, q_layout.total):
        return None
    if _replicated(mask):
        local = replicated_local(mask, f"{_NAME}: attn_mask")
        if local.requires_grad:  # each rank uses only its query rows: the gradient is summed over the shards
            local = sum_grad_over(local, q_layout.mesh, [q_layout.mesh_dim])
        if local.ndim >= 2 and local.shape[-2] != 1:
            local = local.narrow(-2, q_layout.start, q_layout.local_size)
        return local
    mask_layout = _sequence_layout(mask)
    if (
        mask_layout is not None
        and mask.shape[-2] == q_layout.total
        and mesh_of(mask) == mesh_of(q)
        and mask_layout.mesh_dim == q_layout.mesh_dim
        and mask_layout.sizes == q_layout.sizes
    ):
        return local_of(mask)
    raise MissingShardPatch(
        f"{_NAME}: attn_mask with placements {tuple(mask.placements)} and shape {tuple(mask.shape)}; "
        "a mask must be replicated or sharded on its query dim (-2) like the query"
    )


def _causal_mask(q_layout: DimLayout, kv_len: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(q_layout.start, q_layout.stop, device=device).unsqueeze(-1)
    return torch.arange(kv_len, device=device) <= rows


def replicated_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: DimLayout,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    gqa_repeat: int = 1,
) -> torch.Tensor:
    """Attention of a replicated query against key/value rows sharded over ``layout``: the same result on every rank.

    Each rank scores the whole query against its own key block; the softmax over all keys is
    assembled from per-rank partial sums: a detached running maximum (`max_over`, one
    all-reduce, only for range), then the numerator ``exp(s - m) @ v`` and the denominator
    ``sum(exp(s - m))`` summed over the ranks (``sum_to_replicated``: the output is replicated and
    its cotangent the same on every rank, so each rank's keys and values get their own rows'
    gradient unchanged). The query's gradient, partial per rank, is summed by the caller
    (``sum_grad_over``). Forward: three all-reduces of ``(..., L_q, 1)``, ``(..., L_q, E_v)`` and
    ``(..., L_q, 1)``; memory ``L_q x L_k / N`` scores per rank (FLARE: a few global queries).

    Examples:
        Four global queries against 9 keys split 5/4:

        >>> import torch.nn.functional as F
        >>> from physicsnemo_shardext.primitives import sharded_dims
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> from torch.distributed.tensor import Shard
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = torch.randn(1, 4, 8, generator=g), torch.randn(1, 9, 8, generator=g), torch.randn(1, 9, 3, generator=g)
        >>> ks, vs = (shard_tensor(t, mesh, [Shard(1)], [5, 4]) for t in (k, v))
        >>> out = replicated_query_attention(q, ks.to_local(), vs.to_local(), sharded_dims(ks)[1])
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6)
        True
    """
    work = _work_dtype(q.dtype)
    qf = q.to(work)
    kf, vf = _expand_heads(k.to(work), gqa_repeat), _expand_heads(v.to(work), gqa_repeat)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, _NEG_INF) if mask.dtype == torch.bool else scores + mask.to(work)
    if is_causal:
        rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(-1)
        keys = torch.arange(layout.start, layout.stop, device=q.device)
        scores = scores.masked_fill(keys > rows, _NEG_INF)
    with torch.no_grad():
        if scores.shape[-1]:
            peak = scores.amax(-1, keepdim=True)
        else:
            peak = scores.new_full((*scores.shape[:-1], 1), _NEG_INF)
        peak = max_over(peak, layout.mesh, [layout.mesh_dim])
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # rows masked everywhere
    weights = torch.exp(scores - peak)
    numerator = sum_to_replicated(torch.matmul(weights, vf), layout.mesh, [layout.mesh_dim])
    denominator = sum_to_replicated(weights.sum(-1, keepdim=True), layout.mesh, [layout.mesh_dim])
    return (numerator / denominator).to(q.dtype)


def _replicated_query_sdpa(bound: dict[str, Any]) -> Any:
    """A replicated query against sequence-sharded key/value (FLARE's global queries), or ``None`` to delegate."""
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    is_causal, enable_gqa = bool(bound["is_causal"]), bool(bound["enable_gqa"])
    k_layout, v_layout = _sequence_layout(k), _sequence_layout(v)
    if (
        k_layout is None
        or v_layout is None
        or mesh_of(k) != mesh_of(v)
        or (k_layout.mesh_dim, k_layout.sizes) != (v_layout.mesh_dim, v_layout.sizes)
        or bound["dropout_p"]
        or not _shapes_supported(q, k, v, enable_gqa)
    ):
        return None  # PhysicsNeMo's handler, as before (dropout included)
    if q.device.type == "cuda" and not (is_causal or enable_gqa or mask is not None):
        return None  # PhysicsNeMo's ReplicatedQSDPA and its CUDA kernel
    if is_causal and mask is not None:
        raise RuntimeError(f"{_NAME}: explicit attn_mask should not be set when is_causal=True (as torch says)")
    mesh, mesh_dims = mesh_of(k), [k_layout.mesh_dim]
    local_mask = None
    if mask is not None:
        if mask.ndim > q.ndim or mask.shape[-1] not in (1, k_layout.total):
            return None  # torch's own broadcasting error
        if _replicated(mask):
            local_mask = replicated_local(mask, f"{_NAME}: attn_mask")
            if local_mask.requires_grad:  # each rank reads its own key columns: the gradient is summed
                local_mask = sum_grad_over(local_mask, mesh, mesh_dims)
            if local_mask.shape[-1] != 1:
                local_mask = local_mask.narrow(-1, k_layout.start, k_layout.local_size)
        else:
            mask_layouts = sharded_dims(mask) if isinstance(mask, ShardTensor) else {}
            own = mask_layouts.get(mask.ndim - 1)
            if (
                len(mask_layouts) != 1
                or own is None
                or (own.mesh_dim, own.sizes) != (k_layout.mesh_dim, k_layout.sizes)
            ):
                return None
            local_mask = local_of(mask)
    # The query is used against each rank's keys only: its gradient is the sum over the ranks.
    q_local = sum_grad_over(replicated_local(q, f"{_NAME}: query"), mesh, mesh_dims)
    gqa_repeat = q.shape[-3] // k.shape[-3] if enable_gqa and q.ndim >= 3 else 1
    out = replicated_query_attention(
        q_local,
        local_of(k),
        local_of(v),
        k_layout,
        mask=local_mask,
        scale=bound["scale"],
        is_causal=is_causal,
        gqa_repeat=gqa_repeat,
    )
    return build_shard_tensor(out, mesh, [Replicate()] * mesh.ndim, {})


def _batch_or_head_sdpa(func: Callable[..., Any], bound: dict[str, Any]) -> Any:
    """q, k, v (and mask) split alike on the batch or head dim of ``(B, H, L, E)``: local SDPA, or ``None``."""
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    if q.ndim != 4:
        return None
    split = _batch_or_head_split([q, k, v])
    if split is None:
        return None
    dim, layout = split
    if mask is not None and _replicated(mask):
        local_mask = replicated_local(mask, f"{_NAME}: attn_mask")
        if local_mask.requires_grad:  # each rank reads its own rows: summed over the ranks, before the cut
            local_mask = sum_grad_over(local_mask, layout.mesh, [layout.mesh_dim])
        own_dim = dim - (q.ndim - local_mask.ndim)  # broadcast from the right
        if own_dim >= 0 and local_mask.shape[own_dim] != 1:
            local_mask = local_mask.narrow(own_dim, layout.start, layout.local_size)
    else:
        handled, local_mask = _fused_mask_rows(mask, dim, layout)
        if not handled:
            return None
    out = func(
        local_of(q),
        local_of(k),
        local_of(v),
        attn_mask=local_mask,
        dropout_p=bound["dropout_p"],
        is_causal=bool(bound["is_causal"]),
        scale=bound["scale"],
        enable_gqa=bool(bound["enable_gqa"]),
    )
    if layout.local_size == 0 and local_mask is not None and local_mask.requires_grad:
        # An empty block: the kernel leaves the mask without a gradient, and its sum_grad_over
        # all-reduce would then run on the other ranks only.
        out = tie_to_graph(out, local_mask)
    return from_local_like(out, q)


@eager_handler
def sharded_sdpa(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``F.scaled_dot_product_attention`` of a query sharded on its sequence dim: ring or local attention.

    Examples:
        Replicated keys and values: local attention, no forward communication:

        >>> import torch.nn.functional as F
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> g = torch.Generator().manual_seed(2)
        >>> q, k, v = torch.randn(2, 7, 4, generator=g), torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
        >>> out = F.scaled_dot_product_attention(shard_tensor(q, mesh, [Shard(1)], [7, 0]), k, v)
        >>> torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v), atol=1e-6)
        True
    """
    bound = bind_arguments(_sdpa, args, kwargs)
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    dropout_p, is_causal, enable_gqa = bound["dropout_p"], bool(bound["is_causal"]), bool(bound["enable_gqa"])
    if any(is_partial(t) for t in (q, k, v, mask)):
        return delegate(func, types, args, kwargs)
    q_layout = _sequence_layout(q)
    if q_layout is None and all(isinstance(t, torch.Tensor) for t in (k, v)):
        # Not sequence-sharded: a replicated query (global queries against sharded tokens), or
        # everything split alike on the batch or head dim (windows, heads): both purely local.
        out = _replicated_query_sdpa(bound) if _replicated(q) else _batch_or_head_sdpa(func, bound)
        if out is not None:
            return out
    if q_layout is None or not all(isinstance(t, torch.Tensor) for t in (k, v)):
        return delegate(func, types, args, kwargs)
    if not _shapes_supported(q, k, v, enable_gqa):
        return delegate(func, types, args, kwargs)
    plain_mask = mask is not None and _replicated(mask)
    if q.device.type == "cuda" and not (is_causal or enable_gqa or plain_mask):
        return delegate(func, types, args, kwargs)  # PhysicsNeMo's stream-overlapped CUDA ring
    if is_causal and mask is not None:
        raise RuntimeError(f"{_NAME}: explicit attn_mask should not be set when is_causal=True (as torch says)")
    scale = bound["scale"]
    kv_len = k.shape[-2]
    gqa_repeat = q.shape[-3] // k.shape[-3] if enable_gqa and q.ndim >= 3 else 1

    if _replicated(k) and _replicated(v):
        if dropout_p:
            return delegate(func, types, args, kwargs)  # local attention with dropout, as PhysicsNeMo does it
        local_mask = _local_mask(mask, q, q_layout, kv_len)
        if mask is not None and local_mask is None:
            return delegate(func, types, args, kwargs)
        if is_causal:
            local_mask = _causal_mask(q_layout, kv_len, q.device)
        mesh_dims = [q_layout.mesh_dim]
        k_local = sum_grad_over(replicated_local(k, f"{_NAME}: key"), q_layout.mesh, mesh_dims)
        v_local = sum_grad_over(replicated_local(v, f"{_NAME}: value"), q_layout.mesh, mesh_dims)
        out = func(local_of(q), k_local, v_local, attn_mask=local_mask, scale=scale, enable_gqa=enable_gqa)
        return from_local_like(out.contiguous(), q)

    k_layout, v_layout = _sequence_layout(k), _sequence_layout(v)
    if (
        k_layout is None
        or v_layout is None
        or k_layout.sizes != v_layout.sizes
        or mesh_of(k) != mesh_of(q)
        or mesh_of(v) != mesh_of(q)
        or k_layout.mesh_dim != q_layout.mesh_dim
        or v_layout.mesh_dim != q_layout.mesh_dim
    ):
        return delegate(func, types, args, kwargs)
    if dropout_p:
        raise MissingShardPatch(
            f"{_NAME}: dropout_p={dropout_p} with query and key/value sharded on the sequence dim "
            "(a block's random dropout mask cannot be recomputed in the backward ring); use dropout_p=0 "
            "or replicate key and value"
        )
    local_mask = _local_mask(mask, q, q_layout, kv_len)
    if mask is not None and local_mask is None:
        return delegate(func, types, args, kwargs)
    out = ring_attention_local(
        local_of(q),
        local_of(k),
        local_of(v),
        k_layout,
        (q_layout.start, q_layout.stop),
        mask=local_mask,
        scale=scale,
        is_causal=is_causal,
        gqa_repeat=gqa_repeat,
    )
    return from_local_like(out, q)


# -- operands split alike on a batch or head dim (also read by the CPU fused kernel's handlers, in mha) --


def _batch_or_head_split(tensors: Sequence[Any]) -> tuple[int, DimLayout] | None:
    """``(dim, split)`` if every tensor is a ShardTensor sharded on one and the same dim 0 or 1 alike, else ``None``."""
    found: tuple[int, DimLayout] | None = None
    for t in tensors:
        if not isinstance(t, ShardTensor) or is_partial(t):
            return None
        layouts = sharded_dims(t)
        if len(layouts) != 1:
            return None
        ((dim, layout),) = layouts.items()
        if dim > 1:
            return None
        if found is None:
            found = (dim, layout)
        elif (dim, layout.mesh, layout.mesh_dim, layout.sizes) != (
            found[0],
            found[1].mesh,
            found[1].mesh_dim,
            found[1].sizes,
        ):
            return None
    return found


def _fused_mask_rows(mask: Any, dim: int, layout: DimLayout) -> tuple[bool, Any]:
    """(handled, this rank's block of ``attn_mask``) for operands split as ``layout`` on ``dim`` of ``(B, H, L, S)``."""
    if mask is None:
        return True, None
    own_dim = dim - (4 - mask.ndim)  # broadcast from the right against (B, H, L, S)
    if _replicated(mask):
        local = replicated_local(mask, "aten._scaled_dot_product_flash_attention_for_cpu: attn_mask")
        if own_dim < 0 or local.shape[own_dim] == 1:
            return True, local
        return True, local.narrow(own_dim, layout.start, layout.local_size)
    split = _batch_or_head_split([mask])
    if split is not None and mask.ndim == 4 and split[0] == own_dim:
        mask_layout = split[1]
        if (mask_layout.mesh, mask_layout.mesh_dim, mask_layout.sizes) == (layout.mesh, layout.mesh_dim, layout.sizes):
            return True, local_of(mask)
    return False, None
