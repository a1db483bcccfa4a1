"""Scaled-dot-product attention on a sequence-sharded query: a ring that runs on any backend (gloo CPU ranks too).

PhysicsNeMo 2.2's handler for ``F.scaled_dot_product_attention`` (its ring
attention) uses CUDA streams, so on CPU ranks a sequence-sharded call fails
("Found no NVIDIA driver"); it also refuses ``is_causal`` and ``enable_gqa``, and
cuts a plain ``attn_mask`` wrongly. This family overrides it for a query
``(..., H, L, E)`` sharded on its sequence dim (``-2``) over one mesh dim, any
(uneven, empty) split:

* **k/v sharded** on their sequence dim over the same mesh dim (any split of their
  own, cross-attention included): ring attention. Each rank keeps its query block;
  the K/V blocks travel once around the ring in chunks of a few hundred KiB (one
  ``all_to_all_single`` per hop, so exactly ``(N-1)/N`` of the global K and V
  leave each rank forward), combined with an online (log-sum-exp) softmax; query
  rows are attended in chunks too (torch's fused CPU kernel where it applies), so
  a rank holds its own blocks plus a few chunks, never a ``(L/N) x (L/N)`` score
  block: memory ``O(L/N)``. The backward (a ``torch.autograd.Function``) runs the
  ring again, recomputing scores from the saved log-sum-exp: dQ accumulates
  locally, the owner keeps its own chunk's dK/dV contribution, and a chunk's
  partial starts at its first visitor, travels with it and reaches its owner
  inside the next round's first hop: K/V and dK/dV each cross ``N-1`` hops,
  ``2(N-1)/N`` of the global K and V in all, the minimum.
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

Two more layouts run without a ring:

* a **replicated query** (plain or ``Replicate``: FLARE's learned global queries,
  a cross-attention from global tokens) against K/V sharded on their sequence
  dim (`replicated_query_attention`): each rank scores the whole query against
  its own keys, and the softmax over all keys is assembled from per-rank partial
  sums (three all-reduces of ``(..., L_q, E_v)`` size; no key or value moves);
  the result is ``Replicate``. PhysicsNeMo computes this with a CUDA-only kernel;
  on CUDA its handler is kept for the cases it supports (no ``is_causal``, GQA
  or mask);
* q, k and v (and a mask) **split alike on the batch or head dim** (Swin's
  windows, heads): torch's kernel on the local blocks, no communication
  (PhysicsNeMo refuses it: "q may only be sharded on the sequence dim").

``nn.MultiheadAttention`` / ``F.multi_head_attention_forward``
(`sharded_multi_head_attention`), with the query sharded on its token dim (dim 0 of
``(L, N, E)`` or ``(L, E)``; ``batch_first`` inputs arrive transposed): each rank
projects its own tokens (parameter gradients summed over the ring), then attends
with the ring above for sharded K/V (the projected blocks travel), locally for
replicated K/V, or, with ``need_weights=True``, against all-gathered K/V with an
explicit softmax of its rows (the ``L x S`` weights come back with their rows
sharded like the query). Masks, ``is_causal``, ``add_bias_kv`` and
``add_zero_attn`` behave as in torch. A query, key and value sharded alike on the
batch dim run torch's own function on the local batch elements. The CPU fused
kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward on
ShardTensors sharded alike on a batch or head dim run on the local blocks
(`local_fused_sdpa`, at function and dispatch level).

Delegated (`delegate`, to PhysicsNeMo's ``sdpa_wrapper``): a replicated query
with ``dropout_p > 0`` or K/V sharded other than on their sequence dim alike; a
query sharded on another dim (other than the batch/head case above) or
``Partial``; any ``Partial`` operand; k and v with different
placements or splits, or sharded differently from the query; shapes that rely on
batch broadcasting or mixed dtypes; ``dropout_p > 0`` with replicated K/V (local
attention with dropout, as PhysicsNeMo does it); and, on CUDA tensors, every
configuration PhysicsNeMo's CUDA ring handles (no ``is_causal``, no GQA, no
replicated mask): its stream-overlapped ring is kept on GPUs. Multi-head attention
(to the DTensor fallback, there being no built-in): a query sharded neither on its
token dim nor, with key and value alike, on its batch dim; key/value sharded other
than on their token dim over the query's mesh dim, or split differently from each
other; sharded or ``Partial`` parameters; ``static_k``/``static_v``; masks sharded
other than as above; shapes torch rejects (its own error). The fused kernel with
any other layout: what ran before (DTensor's path).

Refused (``MissingShardPatch``):

* ``dropout_p > 0`` with K/V sharded: the random dropout mask of a block cannot be
  recomputed in the backward ring (PhysicsNeMo refuses it too); likewise multi-head
  attention in training with ``dropout > 0``, ``need_weights=False`` and K/V sharded
  (with replicated K/V, or ``need_weights=True``, dropout is applied to the local rows;
  with no gradient to compute, the call is delegated);
* an ``attn_mask`` sharded other than on its query dim with the query's split
  (PhysicsNeMo's ring is CUDA-only, and on CPU nothing else could take it).

``is_causal=True`` together with an ``attn_mask`` raises torch's own
``RuntimeError``, as single-process does; so does multi-head attention's
``is_causal=True`` without an ``attn_mask``.

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
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from physicsnemo_shardext import MissingShardPatch, PatchSet, builtin_handler, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import (
    DimLayout,
    bind_arguments,
    build_shard_tensor,
    delegate,
    eager_handler,
    from_local_like,
    gather_full,
    is_partial,
    is_replicated,
    is_tracing,
    local_of,
    refuse_higher_order,
    replicated_local,
    sharded_dims,
    sum_grad_over,
    sum_to_replicated,
    tie_to_graph,
)

__all__ = [
    "local_fused_sdpa", "replicated_query_attention", "ring_attention_local", "sharded_multi_head_attention",
    "sharded_sdpa",
]

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


# A rank holds, beyond its own blocks and their gradients, one travelling K/V chunk, the one
# arriving, and the fused kernel's outputs for one query chunk against it: K/V travel in chunks
# of about this many bytes (work dtype, heads expanded), and query rows are attended in chunks of
# about this size, so a ring step never materializes a (L/N) x (L/N) score block. Measured on CPU
# (B=1, H=8, E=64, 4096 tokens, 4 ranks): 256 KiB keeps a rank's peak within 1.1/N of
# single-process attention; twice that costs about 2.5 MiB more per rank and runs ~20% faster.
_CHUNK_BYTES = 1 << 18

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Chunking:
    """How the ring cuts K/V blocks (``kv_rows`` per travelling chunk, ``rounds`` of them) and query rows."""

    kv_rows: int
    q_rows: int
    rounds: int


def _chunking(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _RingPlan, fused: bool) -> _Chunking:
    """Chunk sizes from shapes every rank shares (never from a rank's own block length).

    The math path (not ``fused``) also keeps one chunk of scores within ``_CHUNK_BYTES``.
    """
    itemsize = _work_dtype(q.dtype).itemsize
    lead = math.prod(q.shape[:-2])  # batch x query heads (GQA K/V heads are expanded to these)
    kv_rows = max(1, _CHUNK_BYTES // max(1, lead * (k.shape[-1] + v.shape[-1]) * itemsize))
    q_rows = max(1, _CHUNK_BYTES // max(1, lead * max(q.shape[-1], v.shape[-1]) * itemsize))
    if not fused:
        q_rows = max(1, min(q_rows, _CHUNK_BYTES // max(1, lead * kv_rows * itemsize)))
    longest = max(plan.kv.sizes, default=0)
    return _Chunking(kv_rows, q_rows, -(-longest // kv_rows))


def _chunk(t: torch.Tensor, index: int, rows: int) -> torch.Tensor:
    """Chunk ``index`` of ``t``'s sequence dim (``-2``) cut in pieces of ``rows`` (empty past the end): a view."""
    start = min(index * rows, t.shape[-2])
    return t.narrow(-2, start, min(rows, t.shape[-2] - start))


def _chunk_size(layout: DimLayout, coord: int, index: int, rows: int) -> int:
    """Rows of chunk ``index`` of the block held by ``coord``."""
    return max(0, min(rows, layout.sizes[coord] - index * rows))


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """``(..., L, E)`` as ``(B, H, L, E)``, leading dims flattened or added (the fused kernel's layout)."""
    if t.ndim < 4:
        return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
    return t.flatten(0, t.ndim - 4) if t.ndim > 4 else t


def _skip_block(plan: _RingPlan, key_offset: int, size: int) -> bool:
    """Nothing to compute: no query rows, an empty K/V chunk, or (causal) a chunk entirely in the future."""
    return plan.q_stop == plan.q_start or size == 0 or (plan.causal and key_offset >= plan.q_stop)


def _query_chunks(plan: _RingPlan, key_offset: int, rows: int) -> list[tuple[int, int]]:
    """Local query rows ``[a, b)``, ``rows`` at a time, that may attend keys from ``key_offset`` on.

    Causal: the rows before ``key_offset`` see none of them and are left out.
    """
    q_len = plan.q_stop - plan.q_start
    first = min(q_len, max(0, key_offset - plan.q_start)) if plan.causal else 0
    return [(a, min(a + rows, q_len)) for a in range(first, q_len, rows)]


def _block_scores(
    plan: _RingPlan,
    mask: torch.Tensor | None,
    rows: tuple[int, int],
    key_offset: int,
    size: int,
    q4: torch.Tensor,
    batch_shape: Sequence[int],
) -> torch.Tensor | None:
    """The additive mask (4-D, work dtype) of local query ``rows`` against keys ``key_offset + [0, size)``.

    ``None`` when every score counts. A boolean mask becomes ``0``/``-inf``; ``batch_shape`` is the
    query's shape before its last two dims (the mask broadcasts against it).
    """
    a, b = rows
    if mask is not None:
        m = mask
        if m.ndim >= 2 and m.shape[-2] != 1:
            m = m[..., a:b, :]
        if m.shape[-1] != 1:
            m = m.narrow(-1, key_offset, size)
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=q4.dtype, device=q4.device).masked_fill_(~m, _NEG_INF)
        else:
            m = m.to(q4.dtype)
        m = m.expand(*m.shape[:-2], b - a, size) if m.ndim >= 2 else m.expand(b - a, size)
        m = m.reshape((1,) * (len(batch_shape) + 2 - m.ndim) + tuple(m.shape))
        if m.ndim > 4:
            m = m.expand(*batch_shape, b - a, size)
        return _as_4d(m)
    if plan.causal and key_offset + size - 1 > plan.q_start + a:
        query_rows = torch.arange(plan.q_start + a, plan.q_start + b, device=q4.device).unsqueeze(-1)
        keys = torch.arange(key_offset, key_offset + size, device=q4.device)
        causal = torch.zeros(b - a, size, dtype=q4.dtype, device=q4.device).masked_fill_(keys > query_rows, _NEG_INF)
        return causal.view(1, 1, b - a, size)
    return None


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU attention kernels (forward with log-sum-exp, backward from it) can take the chunks."""
    return q.device.type == "cpu" and q.shape[-1] == k.shape[-1] == v.shape[-1]


def _dense(*tensors: torch.Tensor | None) -> list[Any]:
    """The tensors made contiguous (chunk-sized copies where they are not).

    Why: torch's fused CPU kernels read their operands as if the last dim had unit stride;
    a transposed view (tokens made by ``x.flatten(2).transpose(1, 2)``) gave outputs of
    1e35 (torch 2.14). ``F.scaled_dot_product_attention`` checks strides before choosing
    that kernel; the ring calls it directly, so it must check too.
    """
    return [t if t is None or t.is_contiguous() else t.contiguous() for t in tensors]


def _attend_chunk(
    qc: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, bias: torch.Tensor | None, scale: float, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query chunk ``qc`` over one K/V chunk: the output and its log-sum-exp (``-inf``: no key)."""
    if fused:
        qc, kx, vx, bias = _dense(qc, kx, vx, bias)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qc, kx, vx, attn_mask=bias, scale=scale)
        if bias is not None:  # the kernel reports 0 for a fully masked row (and a zero output)
            lse = lse.masked_fill((bias == _NEG_INF).all(-1), _NEG_INF)
        return out, lse
    scores = torch.matmul(qc, kx.transpose(-2, -1)).mul_(scale)
    if bias is not None:
        scores = scores.add_(bias)
    lse = torch.logsumexp(scores, -1)
    probs = scores.sub_(lse.masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1)).exp_()
    return torch.matmul(probs, vx), lse


def _merge_chunk(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, chunk_lse: torch.Tensor) -> None:
    """Fold a chunk's normalized output into the running one, in place (online softmax by log-sum-exp)."""
    total = torch.logaddexp(lse, chunk_lse)
    shift = total.masked_fill(total == _NEG_INF, 0.0)  # nothing attended yet: no nan
    acc.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(out.mul_(torch.exp(chunk_lse - shift).unsqueeze(-1)))
    lse.copy_(total)


def _chunk_grads(
    dout: torch.Tensor,
    qc: torch.Tensor,
    kx: torch.Tensor,
    vx: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dQ, dK, dV of one (query chunk, K/V chunk) pair from the final output and log-sum-exp; dScores unless fused.

    ``lse`` is ``+inf`` on a row that attends nothing (its probabilities are 0).
    """
    if fused:
        dout, qc, kx, vx, out, lse, bias = _dense(dout, qc, kx, vx, out, lse, bias)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, qc, kx, vx, out, lse, 0.0, False, attn_mask=bias, scale=scale
        )
        return dq, dk, dv, None
    scores = torch.matmul(qc, kx.transpose(-2, -1)).mul_(scale)
    if bias is not None:
        scores = scores.add_(bias)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    delta = (dout * out).sum(-1, keepdim=True)
    dscores = torch.matmul(dout, vx.transpose(-2, -1)).sub_(delta).mul_(probs)
    dq = torch.matmul(dscores, kx).mul_(scale)
    dk = torch.matmul(dscores.transpose(-2, -1), qc).mul_(scale)
    return dq, dk, dv, dscores


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat byte buffer holding every tensor's elements in turn (put wider dtypes first: views stay aligned)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _spec(t: torch.Tensor, rows: int, dtype: torch.dtype | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a block of ``rows`` rows shaped like ``t`` (its sequence dim ``-2``)."""
    return (*t.shape[:-2], rows, t.shape[-1]), dtype or t.dtype


def _nbytes(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)


def _unpack(buffer: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Inverse of `_pack`: views of ``buffer`` with these shapes and dtypes."""
    out, start = [], 0
    for shape, dtype in specs:
        stop = start + math.prod(shape) * dtype.itemsize
        out.append(buffer[start:stop].view(dtype).view(shape))
        start = stop
    return out


def _pass_on(send: torch.Tensor, layout: DimLayout, recv_bytes: int) -> torch.Tensor:
    """Send this byte buffer to the next coordinate of the ring and receive ``recv_bytes`` from the previous one."""
    parts = layout.parts
    received = send.new_empty(recv_bytes)
    in_splits, out_splits = [0] * parts, [0] * parts
    in_splits[layout.group_ranks[(layout.coord + 1) % parts]] = send.numel()
    out_splits[layout.group_ranks[(layout.coord - 1) % parts]] = recv_bytes
    dist.all_to_all_single(received, send, out_splits, in_splits, group=layout.group)
    return received


class _RingAttention(torch.autograd.Function):
    """Ring attention of the local query block; K/V chunks (and in backward their gradient partials) travel around.

    K/V blocks travel in chunks (`_chunking`): round ``t`` sends chunk ``t`` of every block once around
    the ring (``N - 1`` hops), so a rank holds one foreign chunk and the one arriving, never a whole
    block. Backward: the owner adds its own chunk's dK/dV locally; a chunk's partial starts at its first
    visitor and travels with it; the last visitor sends it home inside the next round's first hop (one
    more hop after the last round). K/V and their gradients thus each cross ``N - 1`` hops.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, plan: _RingPlan
    ) -> torch.Tensor:
        work = _work_dtype(q.dtype)
        layout, parts, coord = plan.kv, plan.kv.parts, plan.kv.coord
        fused = _fused(q, k, v)
        chunks = _chunking(q, k, v, plan, fused)
        rows = chunks.kv_rows
        q4 = _as_4d(q.to(work))
        acc = q4.new_zeros((*q4.shape[:-1], v.shape[-1]))
        lse = q4.new_full(q4.shape[:-1], _NEG_INF)
        for t in range(chunks.rounds):
            kb, vb, buffer = _chunk(k, t, rows), _chunk(v, t, rows), None
            for step in range(parts):
                src = (coord - step) % parts
                offset, size = layout.offsets[src] + t * rows, kb.shape[-2]
                if not _skip_block(plan, offset, size):
                    kx, vx = (_as_4d(_expand_heads(x.to(work), plan.gqa_repeat)) for x in (kb, vb))
                    for a, b in _query_chunks(plan, offset, chunks.q_rows):
                        bias = _block_scores(plan, mask, (a, b), offset, size, q4, q.shape[:-2])
                        out_c, lse_c = _attend_chunk(q4[..., a:b, :], kx, vx, bias, plan.scale, fused)
                        _merge_chunk(acc[..., a:b, :], lse[..., a:b], out_c, lse_c)
                    del kx, vx
                if step < parts - 1:
                    n = _chunk_size(layout, (src - 1) % parts, t, rows)
                    specs = [_spec(k, n), _spec(v, n)]
                    send = buffer if buffer is not None else _pack([kb, vb])
                    kb = vb = buffer = None  # type: ignore[assignment]
                    buffer = _pass_on(send, layout, _nbytes(specs))
                    del send
                    kb, vb = _unpack(buffer, specs)
        out = acc.view(*q.shape[:-1], v.shape[-1])
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, mask, out, lse.masked_fill_(lse == _NEG_INF, float("inf")))
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # Hand-written and not itself differentiable: a second-order gradient through it is refused.
        refuse_higher_order("scaled_dot_product_attention (ring)", grad_out, *ctx.saved_tensors)
        q, k, v, mask, out, lse = ctx.saved_tensors
        plan: _RingPlan = ctx.plan
        layout, parts, coord, rep = plan.kv, plan.kv.parts, plan.kv.coord, plan.gqa_repeat
        work = _work_dtype(q.dtype)
        dmask = torch.zeros_like(mask, dtype=work) if mask is not None and ctx.needs_input_grad[3] else None
        fused = _fused(q, k, v) and dmask is None  # the fused kernel gives no score gradient
        chunks = _chunking(q, k, v, plan, fused)  # K/V chunks as in the forward (only q_rows depends on fused)
        rows = chunks.kv_rows
        q4, dout4, out4 = _as_4d(q.to(work)), _as_4d(grad_out.to(work)), _as_4d(out)
        dq4 = torch.zeros_like(q4)
        dk, dv = torch.zeros_like(k, dtype=work), torch.zeros_like(v, dtype=work)

        def contribute(kb: torch.Tensor, vb: torch.Tensor, offset: int, dk_into: torch.Tensor, dv_into: torch.Tensor) -> None:
            """Add this rank's dK/dV of a K/V chunk into ``dk_into``/``dv_into``; dQ (and dMask) accumulate here."""
            size = kb.shape[-2]
            if _skip_block(plan, offset, size):
                return
            kx, vx = (_as_4d(_expand_heads(x.to(work), rep)) for x in (kb, vb))
            for a, b in _query_chunks(plan, offset, chunks.q_rows):
                bias = _block_scores(plan, mask, (a, b), offset, size, q4, q.shape[:-2])
                dq_c, dk_c, dv_c, dscores = _chunk_grads(
                    dout4[..., a:b, :], q4[..., a:b, :], kx, vx, out4[..., a:b, :], lse[..., a:b], bias, plan.scale, fused
                )
                dq4[..., a:b, :].add_(dq_c)
                dk_into.add_(_fold_heads(dk_c, rep).reshape(dk_into.shape))
                dv_into.add_(_fold_heads(dv_c, rep).reshape(dv_into.shape))
                if dmask is not None and dscores is not None:
                    region = dmask[..., a:b, :] if dmask.ndim >= 2 and dmask.shape[-2] != 1 else dmask
                    region = region if region.shape[-1] == 1 else region.narrow(-1, offset, size)
                    region += _reduce_to(dscores.view(*q.shape[:-2], b - a, size), region.shape)

        def travelling(n_grad: int, n_kv: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
            """The layout of a travelling buffer: dK/dV partials of ``n_grad`` rows, then K/V of ``n_kv`` rows."""
            return [_spec(k, n_grad, work), _spec(v, n_grad, work), _spec(k, n_kv), _spec(v, n_kv)]

        # The chunk in hand travels as one buffer [dK, dV, K, V] whose partial is updated in place. Round t's
        # first hop carries the own chunk t and, in the slots of last round's buffer, the finished partial of
        # the next coordinate's chunk t-1; what arrives holds this rank's finished partial of chunk t-1, whose
        # slots (emptied) then take the partial of the chunk that came with it.
        carry: torch.Tensor | None = None  # last round's buffer: its partial is finished, for the next coordinate
        carry_rows = 0
        for t in range(chunks.rounds):
            own_k, own_v = _chunk(k, t, rows), _chunk(v, t, rows)
            contribute(own_k, own_v, layout.start + t * rows, _chunk(dk, t, rows), _chunk(dv, t, rows))
            buffer: torch.Tensor | None = None
            for step in range(1, parts):
                src = (coord - step) % parts
                n = _chunk_size(layout, src, t, rows)
                if step == 1:
                    home = _chunk_size(layout, coord, t - 1, rows) if t else 0
                    recv = travelling(home, n)
                    if carry is None:
                        send = _pack([own_k, own_v])
                    elif carry_rows == own_k.shape[-2]:
                        send = carry
                        for slot, own in zip(_unpack(send, travelling(carry_rows, carry_rows))[2:], (own_k, own_v)):
                            slot.copy_(own)
                    else:
                        send = _pack([*_unpack(carry, travelling(carry_rows, 0))[:2], own_k, own_v])
                else:
                    send, recv = buffer, travelling(n, n)
                carry = buffer = None
                received = _pass_on(send, layout, _nbytes(recv))
                del send
                dkp, dvp, kb, vb = _unpack(received, recv)
                if step == 1:
                    if home:
                        _chunk(dk, t - 1, rows).add_(dkp)
                        _chunk(dv, t - 1, rows).add_(dvp)
                    if home != n:  # round 0, or uneven chunks: a buffer with room for the partial
                        fresh = received.new_empty(_nbytes(travelling(n, n)))
                        dkp, dvp, new_k, new_v = _unpack(fresh, travelling(n, n))
                        new_k.copy_(kb)
                        new_v.copy_(vb)
                        kb, vb, received = new_k, new_v, fresh
                    dkp.zero_()
                    dvp.zero_()
                buffer = received
                del received
                contribute(kb, vb, layout.offsets[src] + t * rows, dkp, dvp)
                del dkp, dvp, kb, vb
                carry_rows = n
            carry = buffer
        if carry is not None:  # the last round's finished partials: one hop home, without K/V
            home = _chunk_size(layout, coord, chunks.rounds - 1, rows)
            grads = _pass_on(carry[: _nbytes(travelling(carry_rows, 0))], layout, _nbytes(travelling(home, 0)))
            home_dk, home_dv = _unpack(grads, travelling(home, 0))[:2]
            _chunk(dk, chunks.rounds - 1, rows).add_(home_dk)
            _chunk(dv, chunks.rounds - 1, rows).add_(home_dv)
        grad_mask = dmask.to(mask.dtype) if dmask is not None else None
        return dq4.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grad_mask, None


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
    assembled from per-rank partial sums: a detached running maximum (one all-reduce ``MAX``,
    only for range), then the numerator ``exp(s - m) @ v`` and the denominator
    ``sum(exp(s - m))`` summed over the ranks (``sum_to_replicated``: the output is replicated and
    its cotangent the same on every rank, so each rank's keys and values get their own rows'
    gradient unchanged). The query's gradient, partial per rank, is summed by the caller
    (``sum_grad_over``). Forward: three all-reduces of ``(..., L_q, 1)``, ``(..., L_q, E_v)`` and
    ``(..., L_q, 1)``; memory ``L_q x L_k / N`` scores per rank (FLARE: a few global queries).

    Examples:
        Four global queries against 9 keys split 5/4:

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
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=layout.group)
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
        or k._spec.mesh != v._spec.mesh
        or (k_layout.mesh_dim, k_layout.sizes) != (v_layout.mesh_dim, v_layout.sizes)
        or bound["dropout_p"]
        or not _shapes_supported(q, k, v, enable_gqa)
    ):
        return None  # PhysicsNeMo's handler, as before (dropout included)
    if q.device.type == "cuda" and not (is_causal or enable_gqa or mask is not None):
        return None  # PhysicsNeMo's ReplicatedQSDPA and its CUDA kernel
    if is_causal and mask is not None:
        raise RuntimeError(f"{_NAME}: explicit attn_mask should not be set when is_causal=True (as torch says)")
    mesh, mesh_dims = k._spec.mesh, [k_layout.mesh_dim]
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
            if len(mask_layouts) != 1 or own is None or (own.mesh_dim, own.sizes) != (k_layout.mesh_dim, k_layout.sizes):
                return None
            local_mask = local_of(mask)
    # The query is used against each rank's keys only: its gradient is the sum over the ranks.
    q_local = sum_grad_over(replicated_local(q, f"{_NAME}: query"), mesh, mesh_dims)
    gqa_repeat = q.shape[-3] // k.shape[-3] if enable_gqa and q.ndim >= 3 else 1
    out = replicated_query_attention(
        q_local, local_of(k), local_of(v), k_layout,
        mask=local_mask, scale=bound["scale"], is_causal=is_causal, gqa_repeat=gqa_repeat,
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
        local_of(q), local_of(k), local_of(v), attn_mask=local_mask, dropout_p=bound["dropout_p"],
        is_causal=bool(bound["is_causal"]), scale=bound["scale"], enable_gqa=bool(bound["enable_gqa"]),
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


# -- nn.MultiheadAttention: F.multi_head_attention_forward on token-sharded inputs ---------------

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
    placements = list(query._spec.placements)
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
    placements = list(query._spec.placements)
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
    placements = query._spec.placements
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


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Declare the sharded attention handlers: SDPA, multi-head attention, the CPU fused kernel."""
    patches.function(
        F.scaled_dot_product_attention,
        sharded_sdpa,
        override=True,
        description=f"{_NAME}: ring attention over sequence-sharded K/V (any backend), local with replicated K/V",
    )
    patches.function(
        F.multi_head_attention_forward,
        sharded_multi_head_attention,
        description=f"{_MHA_NAME}: token-sharded query, local projections, ring (or gathered K/V for the weights)",
    )
    for op in (_FLASH_CPU, _FLASH_CPU_BACKWARD):
        patches.function(
            op, local_fused_sdpa, description=f"{op}: local on batch/head-sharded operands (a direct call of the op)"
        )
    patches.dispatch(
        _FLASH_CPU,
        _flash_cpu_forward_dispatch,
        description="aten._scaled_dot_product_flash_attention_for_cpu: local on batch/head-sharded operands",
    )
    patches.dispatch(
        _FLASH_CPU_BACKWARD,
        _flash_cpu_backward_dispatch,
        description="aten._scaled_dot_product_flash_attention_for_cpu_backward: local on batch/head-sharded operands",
    )
