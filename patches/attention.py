"""Scaled-dot-product attention on a sequence-sharded query: a ring that runs on any backend (gloo CPU ranks too).

PhysicsNeMo 2.2's handler for ``F.scaled_dot_product_attention`` (its ring
attention) uses CUDA streams, so on CPU ranks a sequence-sharded call fails
("Found no NVIDIA driver"); it also refuses ``is_causal`` and ``enable_gqa``, and
cuts a plain ``attn_mask`` wrongly. This family overrides it for a query
``(..., H, L, E)`` sharded on its sequence dim (``-2``) over one mesh dim, any
(uneven, empty) split:

* **k/v sharded** on their sequence dim over the same mesh dim (any split of their
  own, cross-attention included): ring attention. Each rank keeps its query block;
  the K/V blocks travel once around the ring (one ``all_to_all_single`` per step
  carrying one K block and one V block, so ``(N-1)/N`` of the global K and V cross
  each rank forward and memory stays ``O(L/N)``), combined with an online
  (log-sum-exp) softmax. The backward (a ``torch.autograd.Function``) runs the ring
  again, recomputing each block's scores from the saved log-sum-exp: dQ
  accumulates locally, the dK/dV partials travel with their blocks and one last
  step returns them to their owners.
* **k/v replicated** (plain or ``Replicate``): local attention of the query block
  against the whole K/V, no forward communication; the K/V gradients (partial
  sums over the query shards) are summed with ``sum_grad_over``.

Both support ``is_causal`` (torch's top-left alignment, from global positions;
blocks entirely in the future are skipped), ``attn_mask`` boolean or additive
(replicated and broadcast over ``(L_q, L_k)``, or sharded on its ``L_q`` dim like
the query; an additive mask that requires grad gets its gradient), ``scale`` and
``enable_gqa`` (K/V blocks travel with their own, fewer heads and are expanded
locally). The output has the query's placements and split. Float16/bfloat16 are
computed in float32 and rounded once.

Delegated (`delegate`, to PhysicsNeMo's ``sdpa_wrapper``): a query that is
replicated or plain (PhysicsNeMo folds sharded K/V against it), sharded on
another dim or ``Partial``; any ``Partial`` operand; k and v with different
placements or splits, or sharded differently from the query; shapes that rely on
batch broadcasting or mixed dtypes; ``dropout_p > 0`` with replicated K/V (local
attention with dropout, as PhysicsNeMo does it); and, on CUDA tensors, every
configuration PhysicsNeMo's CUDA ring handles (no ``is_causal``, no GQA, no
replicated mask): its stream-overlapped ring is kept on GPUs.

Refused (``MissingShardPatch``):

* ``dropout_p > 0`` with K/V sharded: the random dropout mask of a block cannot be
  recomputed in the backward ring (PhysicsNeMo refuses it too);
* an ``attn_mask`` sharded other than on its query dim with the query's split
  (PhysicsNeMo's ring is CUDA-only, and on CPU nothing else could take it).

``is_causal=True`` together with an ``attn_mask`` raises torch's own
``RuntimeError``, as single-process does.

Examples:
    On 2 ranks, a causal self-attention with the sequence split 5/4:

    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    >>> qs, ks, vs = (shard_tensor(t, mesh, [Shard(2)], [5, 4]) for t in (q, k, v))
    >>> out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    >>> out.placements, tuple(out.to_local().shape) == [(1, 2, 5, 8), (1, 2, 4, 8)][rank]
    ((Shard(dim=2),), True)
    >>> torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    delegate,
    eager_handler,
    from_local_like,
    is_partial,
    is_replicated,
    replicated_local,
    sharded_dims,
    sum_grad_over,
)

__all__ = ["ring_attention_local", "sharded_sdpa"]

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


@dataclass(frozen=True)
class _RingPlan:
    """What the ring needs besides tensors: the query rows, the K/V split and the options."""

    q_start: int
    q_stop: int
    kv: DimLayout
    scale: float
    causal: bool
    gqa_repeat: int


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _expand_heads(t: torch.Tensor, repeat: int) -> torch.Tensor:
    return t if repeat == 1 else t.repeat_interleave(repeat, dim=-3)


def _fold_heads(t: torch.Tensor, repeat: int) -> torch.Tensor:
    return t if repeat == 1 else t.unflatten(-3, (t.shape[-3] // repeat, repeat)).sum(-3)


def _reduce_to(grad: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Sum ``grad`` over the dims a tensor of ``shape`` was broadcast along."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(tuple(range(extra)))
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and grad.shape[d] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


def _skip_block(plan: _RingPlan, src: int) -> bool:
    """Nothing to compute: no query rows, an empty K/V block, or (causal) a block entirely in the future."""
    size, offset = plan.kv.sizes[src], plan.kv.offsets[src]
    return plan.q_stop == plan.q_start or size == 0 or (plan.causal and offset >= plan.q_stop)


def _block_scores(
    q: torch.Tensor, kb: torch.Tensor, mask: torch.Tensor | None, plan: _RingPlan, src: int
) -> torch.Tensor:
    """Scaled scores of the query block against K/V block ``src``, masked (``-inf`` where not attended)."""
    scores = torch.matmul(q, kb.transpose(-2, -1)) * plan.scale
    offset, size = plan.kv.offsets[src], plan.kv.sizes[src]
    if mask is not None:
        cols = mask if mask.shape[-1] == 1 else mask.narrow(-1, offset, size)
        if cols.dtype == torch.bool:
            scores = scores.masked_fill(~cols, float("-inf"))
        else:
            scores = scores + cols.to(scores.dtype)
    if plan.causal:
        rows = torch.arange(plan.q_start, plan.q_stop, device=q.device).unsqueeze(-1)
        keys = torch.arange(offset, offset + size, device=q.device)
        scores = scores.masked_fill(keys > rows, float("-inf"))
    return scores


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One buffer of rows (the sequence dim first) holding every tensor's block side by side."""
    rows = tensors[0].shape[-2]
    flat = [t.movedim(-2, 0).reshape(rows, math.prod(t.shape[:-2]) * t.shape[-1]) for t in tensors]
    return torch.cat(flat, dim=1).contiguous()


def _unpack(buffer: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `_pack`, for blocks shaped like ``templates`` but with ``buffer``'s row count."""
    rows, out, col = buffer.shape[0], [], 0
    for t in templates:
        shape = (rows, *t.shape[:-2], t.shape[-1])
        width = math.prod(shape[1:])
        out.append(buffer[:, col : col + width].reshape(shape).movedim(0, -2))
        col += width
    return out


def _pass_on(tensors: Sequence[torch.Tensor], layout: DimLayout, recv_rows: int) -> list[torch.Tensor]:
    """Send these blocks to the next coordinate of the ring and receive the previous one's (``recv_rows`` rows)."""
    parts = layout.parts
    send = _pack(tensors)
    received = send.new_empty((recv_rows, send.shape[1]))
    in_splits, out_splits = [0] * parts, [0] * parts
    in_splits[layout.group_ranks[(layout.coord + 1) % parts]] = send.shape[0]
    out_splits[layout.group_ranks[(layout.coord - 1) % parts]] = recv_rows
    dist.all_to_all_single(received, send, out_splits, in_splits, group=layout.group)
    return _unpack(received, tensors)


class _RingAttention(torch.autograd.Function):
    """Ring attention of the local query block; K/V blocks (and in backward their gradients) travel around."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, plan: _RingPlan
    ) -> torch.Tensor:
        work = _work_dtype(q.dtype)
        qw = q.to(work)
        row_shape = (*q.shape[:-1], 1)
        running_max = q.new_full(row_shape, float("-inf"), dtype=work)
        total = q.new_zeros(row_shape, dtype=work)
        acc = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=work)
        layout, kb, vb = plan.kv, k, v
        for step in range(layout.parts):
            src = (layout.coord - step) % layout.parts
            if not _skip_block(plan, src):
                scores = _block_scores(qw, _expand_heads(kb.to(work), plan.gqa_repeat), mask, plan, src)
                new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
                shift = new_max.masked_fill(new_max == float("-inf"), 0.0)  # fully masked so far: no nan
                weights = torch.exp(scores - shift)
                rescale = torch.exp(running_max - shift)
                total = total * rescale + weights.sum(-1, keepdim=True)
                acc = acc * rescale + torch.matmul(weights, _expand_heads(vb.to(work), plan.gqa_repeat))
                running_max = new_max
            if step < layout.parts - 1:
                kb, vb = _pass_on((kb, vb), layout, layout.sizes[(src - 1) % layout.parts])
        attended = total > 0
        out = acc / torch.where(attended, total, torch.ones_like(total))  # a fully masked row is 0, as in torch
        lse = torch.where(attended, running_max + total.log(), torch.full_like(total, float("inf")))
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, mask, out, lse = ctx.saved_tensors
        plan: _RingPlan = ctx.plan
        layout, rep = plan.kv, plan.gqa_repeat
        work = _work_dtype(q.dtype)
        qw, dout = q.to(work), grad_out.to(work)
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qw)
        want_mask_grad = mask is not None and ctx.needs_input_grad[3]
        dmask = torch.zeros_like(mask, dtype=work) if want_mask_grad else None
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k, dtype=work), torch.zeros_like(v, dtype=work)
        for step in range(layout.parts):
            src = (layout.coord - step) % layout.parts
            if not _skip_block(plan, src):
                kx, vx = _expand_heads(kb.to(work), rep), _expand_heads(vb.to(work), rep)
                probs = torch.exp(_block_scores(qw, kx, mask, plan, src) - lse)  # lse = +inf: fully masked row
                dvb = dvb + _fold_heads(torch.matmul(probs.transpose(-2, -1), dout), rep)
                dscores = probs * (torch.matmul(dout, vx.transpose(-2, -1)) - delta)
                dq = dq + torch.matmul(dscores, kx) * plan.scale
                dkb = dkb + _fold_heads(torch.matmul(dscores.transpose(-2, -1), qw), rep) * plan.scale
                if dmask is not None:
                    if mask.shape[-1] == 1:
                        dmask = dmask + _reduce_to(dscores, mask.shape)
                    else:
                        cols = dmask.narrow(-1, layout.offsets[src], layout.sizes[src])
                        cols += _reduce_to(dscores, cols.shape)
            if step < layout.parts - 1:
                recv = layout.sizes[(src - 1) % layout.parts]
                kb, vb, dkb, dvb = _pass_on((kb, vb, dkb, dvb), layout, recv)
        if layout.parts > 1:
            # The block now here belongs to the next coordinate, its gradient complete: one step home.
            dkb, dvb = _pass_on((dkb, dvb), layout, layout.local_size)
        grad_mask = dmask.to(mask.dtype) if dmask is not None else None
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), grad_mask, None


def ring_attention_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: DimLayout,
    q_rows: tuple[int, int],
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    gqa_repeat: int = 1,
) -> torch.Tensor:
    """Attention of this rank's query block ``q`` (global rows ``q_rows``) over K/V blocks split as ``kv_layout``.

    ``k``/``v`` are this rank's K/V blocks (sequence dim ``-2``); ``mask`` (bool or additive)
    holds this rank's query rows (or broadcasts over them) and every key column (or
    broadcasts). Differentiable in ``q``, ``k``, ``v`` and an additive ``mask``; every rank
    of the layout's group must call it (the blocks travel around the ring).

    Examples:
        On 2 ranks, keys/values split 6/3, queries 4/4 (each rank passes its own blocks):

        >>> import torch.nn.functional as F
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.primitives import dim_layout
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> g = torch.Generator().manual_seed(1)
        >>> q, k, v = (torch.randn(3, n, 4, generator=g) for n in (8, 9, 9))
        >>> ks, vs = (shard_tensor(t, mesh, [Shard(1)], [6, 3]) for t in (k, v))
        >>> start, stop = 4 * rank, 4 * rank + 4
        >>> local = ring_attention_local(q[:, start:stop], ks.to_local(), vs.to_local(), dim_layout(ks, 1), (start, stop))
        >>> torch.allclose(local, F.scaled_dot_product_attention(q, k, v)[:, start:stop], atol=1e-6)
        True
    """
    plan = _RingPlan(
        q_start=q_rows[0],
        q_stop=q_rows[1],
        kv=kv_layout,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        causal=is_causal,
        gqa_repeat=gqa_repeat,
    )
    return _RingAttention.apply(q, k, v, mask, plan)


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
        and mask._spec.mesh == q._spec.mesh
        and mask_layout.mesh_dim == q_layout.mesh_dim
        and mask_layout.sizes == q_layout.sizes
    ):
        return mask.to_local()
    raise MissingShardPatch(
        f"{_NAME}: attn_mask with placements {tuple(mask.placements)} and shape {tuple(mask.shape)}; "
        "a mask must be replicated or sharded on its query dim (-2) like the query"
    )


def _causal_mask(q_layout: DimLayout, kv_len: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(q_layout.start, q_layout.stop, device=device).unsqueeze(-1)
    return torch.arange(kv_len, device=device) <= rows


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
        out = func(q.to_local(), k_local, v_local, attn_mask=local_mask, scale=scale, enable_gqa=enable_gqa)
        return from_local_like(out.contiguous(), q)

    k_layout, v_layout = _sequence_layout(k), _sequence_layout(v)
    if (
        k_layout is None
        or v_layout is None
        or k_layout.sizes != v_layout.sizes
        or k._spec.mesh != q._spec.mesh
        or v._spec.mesh != q._spec.mesh
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
        q.to_local(),
        k.to_local(),
        v.to_local(),
        k_layout,
        (q_layout.start, q_layout.stop),
        mask=local_mask,
        scale=scale,
        is_causal=is_causal,
        gqa_repeat=gqa_repeat,
    )
    return from_local_like(out, q)


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the sharded scaled-dot-product attention handler."""
    patches.function(
        F.scaled_dot_product_attention,
        sharded_sdpa,
        override=True,
        description=f"{_NAME}: ring attention over sequence-sharded K/V (any backend), local with replicated K/V",
    )
