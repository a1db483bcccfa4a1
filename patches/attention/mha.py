"""The attention family's ``nn.MultiheadAttention`` and the CPU fused SDPA kernel on ShardTensors.

`sharded_multi_head_attention` handles ``F.multi_head_attention_forward`` (what
``nn.MultiheadAttention`` calls) with the query sharded on its token dim: each rank
projects its own tokens (parameter gradients summed over the ranks), then attends with
the family's ring (`ring_attention_local`, in the package's ``ring`` module) for sharded
K/V, locally for replicated K/V, or, with ``need_weights=True``, against all-gathered K/V
with an explicit softmax of its rows. Query, key and value sharded alike on the batch
dim run torch's own function on the local batch elements (`_mha_on_local_batches`).

`local_fused_sdpa` and the two dispatch-level handlers run
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward on the local
blocks of operands sharded alike on a batch or head dim (the split is read with the
``sdpa`` module's `_batch_or_head_split`); anything else goes to what ran before
(`_dispatch_delegate`). What the family delegates and refuses is in the package
(``physicsnemo_shardext.patches.attention``).

Examples:
    On 2 ranks, cross-attention: 7 query tokens split 4/3 against 6 key/value tokens split 2/4 (the ring):

    >>> import torch.nn as nn
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> _ = torch.manual_seed(1)
    >>> mha = nn.MultiheadAttention(8, 2)
    >>> x, y = torch.randn(7, 2, 8), torch.randn(6, 2, 8)
    >>> xs, ys = shard_tensor(x, mesh, [Shard(0)], [4, 3]), shard_tensor(y, mesh, [Shard(0)], [2, 4])
    >>> out, _ = mha(xs, ys, ys, need_weights=False)
    >>> out.placements, tuple(out.to_local().shape) == [(4, 2, 8), (3, 2, 8)][rank]
    ((Shard(dim=0),), True)
    >>> torch.allclose(out.full_tensor(), mha(x, y, y, need_weights=False)[0], atol=1e-6)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from torch.distributed.tensor import Placement, Replicate, Shard

from physicsnemo_shardext import MissingShardPatch, builtin_handler
from physicsnemo_shardext.patches.attention.ring import _dense, ring_attention_local
from physicsnemo_shardext.patches.attention.sdpa import (
    _batch_or_head_split,
    _causal_mask,
    _fused_mask_rows,
    _replicated,
)
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    build_shard_tensor,
    delegate,
    eager_handler,
    from_local_like,
    gather_full,
    is_partial,
    is_tracing,
    local_of,
    placements_of,
    replicated_local,
    sharded_dims,
    sum_grad_over,
    tie_to_graph,
)

__all__ = ["local_fused_sdpa", "sharded_multi_head_attention"]

_MHA_NAME = "torch.nn.functional.multi_head_attention_forward"

#: The replicated parameters of a call (``None`` where absent); each one's gradient is summed over the ring.
_MHA_PARAMETERS = (
    "in_proj_weight",
    "in_proj_bias",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "bias_k",
    "bias_v",
    "out_proj_weight",
    "out_proj_bias",
)


def _token_layout(x: Any) -> DimLayout | None:
    """The split of ``x``'s dim 0 (tokens, in F.multi_head_attention_forward's layout) if that is all it shards."""
    if not isinstance(x, ShardTensor) or is_partial(x):
        return None
    layouts = sharded_dims(x)
    return layouts[0] if set(layouts) == {0} else None


def _only_sharded_dim(x: Any, dim: int, like: DimLayout) -> DimLayout | None:
    """The layout of ``x``'s ``dim`` if that is its only sharded dim, over ``like``'s mesh dim, else ``None``."""
    if not isinstance(x, ShardTensor) or is_partial(x):
        return None
    layouts = sharded_dims(x)
    layout = layouts.get(dim) if set(layouts) == {dim} else None
    if layout is None or layout.mesh != like.mesh or layout.mesh_dim != like.mesh_dim:
        return None
    return layout


def _mha_shapes_supported(bound: dict[str, Any]) -> bool:
    """Shapes and dtypes torch accepts, checked here so that anything else reaches torch's own error (delegated)."""
    query, key, value = bound["query"], bound["key"], bound["value"]
    if not all(isinstance(t, torch.Tensor) for t in (key, value)):
        return False
    if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
        return False
    heads, embed = bound["num_heads"], query.shape[-1]
    if not isinstance(heads, int) or heads <= 0 or embed % heads or embed != bound["embed_dim_to_check"]:
        return False
    if key.shape[0] != value.shape[0] or not (query.shape[1:-1] == key.shape[1:-1] == value.shape[1:-1]):
        return False
    if bound["use_separate_proj_weight"]:
        if any(bound[f"{n}_proj_weight"] is None for n in "qkv"):
            return False
    elif bound["in_proj_weight"] is None or key.shape != value.shape:
        return False
    bias_k, bias_v = bound["bias_k"], bound["bias_v"]
    if (bias_k is None) != (bias_v is None):
        return False
    if bias_k is not None and not (tuple(bias_k.shape) == tuple(bias_v.shape) == (1, 1, embed)):
        return False
    if bound["static_k"] is not None or bound["static_v"] is not None:
        return False
    batch = query.shape[1] if query.ndim == 3 else 1
    attn_mask, padding = bound["attn_mask"], bound["key_padding_mask"]
    masks_ok = all(
        m is None or (isinstance(m, torch.Tensor) and (m.dtype == torch.bool or m.dtype.is_floating_point))
        for m in (attn_mask, padding)
    )
    if not masks_ok:
        return False
    length, kv_len = query.shape[0], key.shape[0]
    if attn_mask is not None and tuple(attn_mask.shape) not in ((length, kv_len), (batch * heads, length, kv_len)):
        return False
    return padding is None or tuple(padding.shape) == ((batch, kv_len) if query.ndim == 3 else (kv_len,))


def _mha_split(bound: dict[str, Any]) -> tuple[DimLayout, DimLayout | None] | None:
    """(query split, K/V split or ``None`` for replicated K/V) of a call this handler computes, else ``None``."""
    query, key, value = bound["query"], bound["key"], bound["value"]
    q_layout = _token_layout(query)
    if q_layout is None:
        return None
    if any(bound[n] is not None and not _replicated(bound[n]) for n in _MHA_PARAMETERS):
        return None
    attn_mask, padding = bound["attn_mask"], bound["key_padding_mask"]
    if attn_mask is not None and not _replicated(attn_mask):
        rows = _only_sharded_dim(attn_mask, attn_mask.ndim - 2, q_layout)
        if rows is None or rows.sizes != q_layout.sizes:
            return None
    if padding is not None and not _replicated(padding):
        if _only_sharded_dim(padding, padding.ndim - 1, q_layout) is None:
            return None
    if _replicated(key) and _replicated(value):
        return q_layout, None
    k_layout, v_layout = _only_sharded_dim(key, 0, q_layout), _only_sharded_dim(value, 0, q_layout)
    if k_layout is None or v_layout is None or k_layout.sizes != v_layout.sizes:
        return None
    return q_layout, k_layout


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask as F.multi_head_attention_forward reads it, as an additive float mask: boolean True is ``-inf``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def _to_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(rows, N, E)`` projected tokens as ``(N, heads, rows, E // heads)``."""
    return x.unflatten(-1, (heads, x.shape[-1] // heads)).permute(1, 2, 0, 3)


def _all_rows(local: torch.Tensor, layout: DimLayout) -> torch.Tensor:
    """Every rank's rows (dim ``-2``) of a tensor split as ``layout``: all-gathered.

    Used with this rank's query rows only, the gathered tensor's gradient is a partial
    sum: it is summed over the ring (`sum_grad_over`), and each rank keeps its own rows.
    """
    dim = local.ndim - 2
    placements: list[Placement] = [Replicate()] * layout.mesh.ndim
    placements[layout.mesh_dim] = Shard(dim)
    full = gather_full(build_shard_tensor(local, layout.mesh, placements, {dim: layout.sizes}))
    return sum_grad_over(full, layout.mesh, [layout.mesh_dim])


class _ReplicatedOperands:
    """Plain local views of the replicated operands of one call; each gradient summed over the query's ring."""

    def __init__(self, q_layout: DimLayout) -> None:
        self.mesh, self.mesh_dims = q_layout.mesh, [q_layout.mesh_dim]
        self.used: list[torch.Tensor] = []

    def __call__(self, value: Any, what: str) -> Any:
        if value is None:
            return None
        local = replicated_local(value, f"{_MHA_NAME}: {what}")
        if local.requires_grad:  # each rank uses it with its own query rows: a partial gradient
            local = sum_grad_over(local, self.mesh, self.mesh_dims)
            self.used.append(local)
        return local


def _mha_on_local_batches(func: Callable[..., Any], bound: dict[str, Any]) -> tuple[Any, Any] | None:
    """Query, key and value sharded alike on the batch dim (1): torch's own function on each rank's batch elements.

    Masks are replicated (cut to the local batch elements) or a padding mask sharded
    like the batch; parameters replicated, their gradients summed over the ring.
    ``None`` for any other layout.
    """
    query, key, value = bound["query"], bound["key"], bound["value"]
    if query.ndim != 3 or not isinstance(query, ShardTensor) or is_partial(query):
        return None
    layouts = sharded_dims(query)
    if set(layouts) != {1}:
        return None
    batch = layouts[1]
    for t in (key, value):
        other = _only_sharded_dim(t, 1, batch)
        if other is None or other.sizes != batch.sizes:
            return None
    if any(bound[n] is not None and not _replicated(bound[n]) for n in _MHA_PARAMETERS):
        return None
    attn_mask, padding = bound["attn_mask"], bound["key_padding_mask"]
    if attn_mask is not None and not _replicated(attn_mask):
        return None
    padding_layout = None if padding is None or _replicated(padding) else _only_sharded_dim(padding, 0, batch)
    padding_sharded_otherwise = padding_layout is None or padding_layout.sizes != batch.sizes
    if padding is not None and not _replicated(padding) and padding_sharded_otherwise:
        return None

    replicated = _ReplicatedOperands(batch)
    call = dict(bound)
    blocks = {id(t): local_of(t) for t in (query, key, value)}  # self-attention stays one tensor
    call["query"], call["key"], call["value"] = blocks[id(query)], blocks[id(key)], blocks[id(value)]
    for name in _MHA_PARAMETERS:
        call[name] = replicated(bound[name], name)
    if attn_mask is not None:
        call["attn_mask"] = replicated(attn_mask, "attn_mask")
        if attn_mask.ndim == 3:  # (N * heads, L, S): this rank's batch elements
            heads = bound["num_heads"]
            call["attn_mask"] = call["attn_mask"].narrow(0, batch.start * heads, batch.local_size * heads)
    if padding is not None:
        call["key_padding_mask"] = (
            local_of(padding)
            if padding_layout is not None
            else replicated(padding, "key_padding_mask").narrow(0, batch.start, batch.local_size)
        )
    if batch.local_size:
        out, weights = func(**call)
    else:  # torch's function cannot view an empty batch with masks: empty results, kept in the backward graph
        out = local_of(query).new_zeros((query.shape[0], 0, bound["out_proj_weight"].shape[0]))
        out = tie_to_graph(out, *blocks.values(), call["key_padding_mask"], call["attn_mask"])
        src_len = key.shape[0] + (bound["bias_k"] is not None) + bool(bound["add_zero_attn"])
        per_head = () if bound["average_attn_weights"] else (bound["num_heads"],)
        weights = out.new_zeros((0, *per_head, query.shape[0], src_len)) if bound["need_weights"] else None
    out = from_local_like(tie_to_graph(out, *replicated.used), query)
    if weights is None:
        return out, None
    placements = list(placements_of(query))
    placements[batch.mesh_dim] = Shard(0)
    return out, build_shard_tensor(tie_to_graph(weights, *replicated.used), batch.mesh, placements, {0: batch.sizes})


@eager_handler
def sharded_multi_head_attention(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) of a query sharded on its token dim.

    The query ``(L, N, E)`` (or unbatched ``(L, E)``; ``nn.MultiheadAttention`` with
    ``batch_first=True`` hands its ``Shard(1)`` input over transposed, as ``Shard(0)``)
    is sharded on dim 0 over one mesh dim, any split. Each rank projects its own
    tokens with the replicated in-projection, attends with its query rows and
    projects the result out; the output has the query's placements and split.
    Keys and values are sharded on their token dim over the same mesh dim (their
    own split: cross-attention, ``kdim``/``vdim`` too) or replicated (plain or
    ``Replicate``). Every parameter gradient is a partial sum over the ranks' tokens
    and is summed over the ring (`sum_grad_over`), as is a replicated key's or value's.

    With ``need_weights=False`` the attention is the family's ring
    (`ring_attention_local`: projected K/V blocks travel once around the ring) for
    sharded K/V, or local attention against the whole projected K/V for replicated
    K/V. With ``need_weights=True`` the ``(L, S)`` weights are returned with their
    rows sharded like the query (dim 1 of ``(N, L, S)``, dim 2 of ``(N, H, L, S)``
    with ``average_attn_weights=False``): each rank's rows need every key, so
    sharded K and V are **all-gathered** (their gradients all-reduced in backward)
    and the rows are computed locally, as torch does, with an explicit softmax.

    Masks follow torch (boolean ``True`` excludes a position, a float mask is
    added): ``attn_mask`` ``(L, S)`` or ``(N*H, L, S)`` replicated or sharded on
    its ``L`` dim like the query; ``key_padding_mask`` replicated, or sharded on
    its ``S`` dim (all-gathered: ``N x S`` values). ``is_causal`` is torch's hint:
    with ``need_weights=False`` and no padding mask the mask is dropped and the
    attention is causal from global positions; otherwise the mask is used.
    ``bias_k``/``bias_v`` (``add_bias_kv``) and ``add_zero_attn`` append their key
    and value rows after the last token, on the last rank of the ring. Dropout
    with sharded K/V and ``need_weights=False`` is refused (the ring cannot replay
    a block's dropout mask; delegated where no gradient is needed); with replicated
    or gathered K/V it is applied to the local rows.

    Query, key and value sharded alike on the batch dim (1) instead: torch's own
    function runs on each rank's batch elements (masks cut to them), no forward
    communication. Everything else is delegated (the DTensor fallback).

    Examples:
        On 2 ranks, self-attention over 9 tokens split 5/4, and the weights:

        >>> import torch.nn as nn
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> _ = torch.manual_seed(0)
        >>> mha = nn.MultiheadAttention(8, 2, batch_first=True)
        >>> x = torch.randn(2, 9, 8)
        >>> xs = shard_tensor(x, mesh, [Shard(1)], [5, 4])
        >>> out, _ = mha(xs, xs, xs, need_weights=False)
        >>> out.placements, torch.allclose(out.full_tensor(), mha(x, x, x)[0], atol=1e-6)
        ((Shard(dim=1),), True)
        >>> out, weights = mha(xs, xs, xs)
        >>> weights.placements, tuple(weights.to_local().shape) == [(2, 5, 9), (2, 4, 9)][rank]
        ((Shard(dim=1),), True)
        >>> torch.allclose(weights.full_tensor(), mha(x, x, x)[1], atol=1e-6)
        True
    """
    bound = bind_arguments(F.multi_head_attention_forward, args, kwargs)
    operands = [bound[n] for n in ("query", "key", "value", "attn_mask", "key_padding_mask", *_MHA_PARAMETERS)]
    if any(is_partial(t) for t in operands) or not _mha_shapes_supported(bound):
        return delegate(func, types, args, kwargs)
    split = _mha_split(bound)
    if split is None:
        local = _mha_on_local_batches(func, bound)
        return delegate(func, types, args, kwargs) if local is None else local
    q_layout, kv_layout = split
    query, key, value = bound["query"], bound["key"], bound["value"]
    attn_mask, padding = bound["attn_mask"], bound["key_padding_mask"]
    need_weights, is_causal = bool(bound["need_weights"]), bool(bound["is_causal"])
    if is_causal and attn_mask is None:
        raise RuntimeError(f"{_MHA_NAME}: need attn_mask if specifying the is_causal hint (as torch says)")
    dropout_p = float(bound["dropout_p"]) if bound["training"] else 0.0
    if dropout_p > 0 and kv_layout is not None and not need_weights:
        if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in operands)):
            return delegate(func, types, args, kwargs)  # no backward to fail: the fallback's forward, as before
        raise MissingShardPatch(
            f"{_MHA_NAME}: dropout_p={dropout_p} in training with query and key/value sharded on the token dim "
            "(need_weights=False runs ring attention, which cannot recompute a block's random dropout mask in "
            "backward); use dropout 0, model.eval(), need_weights=True, or replicate key and value"
        )
    # torch trusts the hint and drops the mask only where it would call SDPA without a padding mask.
    causal = is_causal and padding is None and not need_weights
    batched = query.ndim == 3
    batch, heads, embed = (query.shape[1] if batched else 1), bound["num_heads"], query.shape[-1]
    kv_len = key.shape[0]
    replicated = _ReplicatedOperands(q_layout)

    # Local tokens (unbatched: a batch of one, as torch does) and the in-projection.
    x_q = local_of(query)
    x_k = local_of(key) if kv_layout is not None else replicated(key, "key")
    x_v = x_k if value is key else (local_of(value) if kv_layout is not None else replicated(value, "value"))
    if not batched:
        x_q, x_k, x_v = x_q.unsqueeze(1), x_k.unsqueeze(1), x_v.unsqueeze(1)
    if bound["use_separate_proj_weight"]:
        w_q, w_k, w_v = (replicated(bound[f"{n}_proj_weight"], f"{n}_proj_weight") for n in "qkv")
    else:
        w_q, w_k, w_v = replicated(bound["in_proj_weight"], "in_proj_weight").chunk(3)
    b_in = replicated(bound["in_proj_bias"], "in_proj_bias")
    b_q, b_k, b_v = (None, None, None) if b_in is None else b_in.chunk(3)
    q = _to_heads(F.linear(x_q, w_q, b_q), heads)
    k = _to_heads(F.linear(x_k, w_k, b_k), heads)
    v = _to_heads(F.linear(x_v, w_v, b_v), heads)

    # Key/value rows after the last token: bias_k/bias_v, then a zero row.
    extra_k: list[torch.Tensor] = []
    extra_v: list[torch.Tensor] = []
    if bound["bias_k"] is not None:
        for name, extra in (("bias_k", extra_k), ("bias_v", extra_v)):
            extra.append(_to_heads(replicated(bound[name], name).expand(1, batch, embed), heads))
    if bound["add_zero_attn"]:
        extra_k.append(k.new_zeros((batch, heads, 1, k.shape[-1])))
        extra_v.append(v.new_zeros((batch, heads, 1, v.shape[-1])))
    n_extra = len(extra_k)

    # One additive mask of this rank's query rows and every key column (extra rows attended).
    mask: torch.Tensor | None = None
    if attn_mask is not None and not causal:
        rows = (
            replicated(attn_mask, "attn_mask").narrow(attn_mask.ndim - 2, q_layout.start, q_layout.local_size)
            if _replicated(attn_mask)
            else local_of(attn_mask)
        )
        rows = _additive(rows, q.dtype)
        mask = rows.unflatten(0, (batch, heads)) if rows.ndim == 3 else rows[None, None]
    if padding is not None:
        if _replicated(padding):
            full = replicated(padding, "key_padding_mask")
        else:  # N x S values: a fraction 1/E of K
            full = gather_full(padding)
            full = sum_grad_over(full, q_layout.mesh, [q_layout.mesh_dim]) if full.requires_grad else full
        columns = _additive(full, q.dtype).reshape(batch, 1, 1, kv_len)
        mask = columns if mask is None else mask + columns
    if mask is not None and n_extra:
        mask = F.pad(mask, (0, n_extra))

    weights: torch.Tensor | None = None
    if need_weights or kv_layout is None:
        if kv_layout is not None:
            k, v = _all_rows(k, kv_layout), _all_rows(v, kv_layout)
        if n_extra:
            k, v = torch.cat([k, *extra_k], dim=-2), torch.cat([v, *extra_v], dim=-2)
        if need_weights:
            scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1))
            probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            if dropout_p > 0:
                probs = F.dropout(probs, p=dropout_p)
            out = torch.matmul(probs, v)
            weights = probs.mean(dim=1) if bound["average_attn_weights"] else probs
            weights = weights if batched else weights.squeeze(0)
        else:
            if causal:
                mask = _causal_mask(q_layout, kv_len + n_extra, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    else:
        # The extra rows join the last block of the ring (every rank runs the same ops: a 0-row slice elsewhere).
        ring_sizes = kv_layout.sizes
        if n_extra:
            here = n_extra if kv_layout.coord == kv_layout.parts - 1 else 0
            k = torch.cat([k, torch.cat(extra_k, dim=-2).narrow(-2, 0, here)], dim=-2)
            v = torch.cat([v, torch.cat(extra_v, dim=-2).narrow(-2, 0, here)], dim=-2)
            ring_sizes = (*ring_sizes[:-1], ring_sizes[-1] + n_extra)
        ring = DimLayout(k.ndim - 2, kv_layout.mesh_dim, ring_sizes, kv_layout.coord, kv_layout.mesh)
        out = ring_attention_local(q, k, v, ring, (q_layout.start, q_layout.stop), mask=mask, is_causal=causal)

    out = out.permute(2, 0, 1, 3).flatten(2)  # (L_local, N, E)
    w_out = replicated(bound["out_proj_weight"], "out_proj_weight")
    out = F.linear(out, w_out, replicated(bound["out_proj_bias"], "out_proj_bias"))
    out = from_local_like(tie_to_graph(out if batched else out.squeeze(1), *replicated.used), query)
    if weights is None:
        return out, None
    rows_dim = weights.ndim - 2
    placements = list(placements_of(query))
    placements[q_layout.mesh_dim] = Shard(rows_dim)
    weights = tie_to_graph(weights, *replicated.used)
    return out, build_shard_tensor(weights, q_layout.mesh, placements, {rows_dim: q_layout.sizes})


# -- the CPU fused SDPA kernel at dispatch level, sharded on a batch or head dim -------------------

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _dispatch_delegate(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ShardTensor's dispatch ran for ``op`` before this family: PhysicsNeMo's handler, else its DTensor path."""
    builtin = builtin_handler(op, level="dispatch")
    if builtin is not None:
        return builtin(*args, **kwargs)
    # Looked up when called, like `delegate`: a plugin may have corrected the fallback.
    return _shard_tensor_module._dispatch_fallback_via_dtensor(op, args, kwargs)


def _fused_on_local_blocks(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The fused kernel ``func`` run on the local blocks and wrapped with the operands' split, or ``None``."""
    # The schema puts the tensor operands first: (query, key, value) or (grad_out, query, key, value, out, lse).
    n_tensors = 6 if func is _FLASH_CPU_BACKWARD else 3
    tensors, rest = args[:n_tensors], args[n_tensors:]
    query = tensors[1] if func is _FLASH_CPU_BACKWARD else tensors[0]
    split = _batch_or_head_split(tensors)
    if split is None or query.ndim != 4:
        return None
    dim, layout = split
    handled, local_mask = _fused_mask_rows(kwargs.get("attn_mask"), dim, layout)
    if not handled:
        return None
    local_kwargs = {**kwargs, "attn_mask": local_mask} if "attn_mask" in kwargs else kwargs
    results = func(*_dense(*(local_of(t) for t in tensors)), *rest, **local_kwargs)
    placements = placements_of(query)
    return tuple(build_shard_tensor(r, layout.mesh, placements, {dim: layout.sizes}) for r in results)


@eager_handler
def local_fused_sdpa(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The CPU fused SDPA kernel, forward or backward, on operands sharded alike on their batch or head dim.

    ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``,
    called on ShardTensors: with every tensor operand sharded on the same dim 0
    (batch) or 1 (heads) with the same split (an ``attn_mask`` too, or replicated),
    each batch element and head is independent, so the kernel runs on the local
    blocks and the results keep the split: no communication. Before, the forward
    went through DTensor (which gathered head-sharded operands) and the backward
    failed (DTensor has no strategy for it). This is the function-level handler
    (a direct call of the op); the same computation is installed at dispatch level,
    where code running with torch-function handling off (and autograd's backward of
    such a call) reaches the kernel. Every other configuration goes to what ran before.

    Examples:
        On 2 ranks, 3 batch elements split 2/1:

        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> g = torch.Generator().manual_seed(3)
        >>> q, k, v = (torch.randn(3, 2, 5, 4, generator=g) for _ in range(3))
        >>> qs, ks, vs = (shard_tensor(t, mesh, [Shard(0)], [2, 1]).requires_grad_() for t in (q, k, v))
        >>> out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(qs, ks, vs)
        >>> out.placements, torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v), atol=1e-6)
        ((Shard(dim=0),), True)
        >>> out.to_local().sum().backward()
        >>> qs.grad.placements, tuple(qs.grad.to_local().shape) == [(2, 2, 5, 4), (1, 2, 5, 4)][rank]
        ((Shard(dim=0),), True)
    """
    results = _fused_on_local_blocks(func, args, kwargs)
    return delegate(func, types, args, kwargs) if results is None else results


def _flash_cpu_forward_dispatch(*args: Any, **kwargs: Any) -> Any:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` at dispatch level: local blocks, else what ran before."""
    results = None if is_tracing(args, kwargs) else _fused_on_local_blocks(_FLASH_CPU, args, kwargs)
    return _dispatch_delegate(_FLASH_CPU, args, kwargs) if results is None else results


def _flash_cpu_backward_dispatch(*args: Any, **kwargs: Any) -> Any:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward`` at dispatch level: local blocks, else before."""
    results = None if is_tracing(args, kwargs) else _fused_on_local_blocks(_FLASH_CPU_BACKWARD, args, kwargs)
    return _dispatch_delegate(_FLASH_CPU_BACKWARD, args, kwargs) if results is None else results
