"""The attention family's ring: a query block attends K/V blocks that travel once around the ranks, chunk by chunk.

`ring_attention_local` is the kernel under sequence-sharded
``F.scaled_dot_product_attention`` (the package's ``sdpa`` module routes to it) and
under ``nn.MultiheadAttention`` with sharded keys and values (its ``mha`` module). It
works on local blocks: each rank passes its own query rows (and their global
positions), its own K/V block and the K/V split, and gets its query rows' output.

The K/V blocks travel around the ring in chunks of about ``_CHUNK_BYTES`` (a few
hundred KiB): each hop is one `ring_shift` (a named exchange of
``physicsnemo_shardext.primitives``) of a buffer packed with `pack_bytes`, so exactly
``(N-1)/N`` of the global K and V leave each rank forward. Chunks are combined with an
online (log-sum-exp) softmax; query rows are attended in chunks too (torch's fused CPU
kernel where it applies), so a rank never holds a ``(L/N) x (L/N)`` score block: memory
``O(L/N)``. The backward (`_RingAttention`, a ``torch.autograd.Function``) runs the ring
again, recomputing scores from the saved log-sum-exp: dQ accumulates locally, and a
chunk's dK/dV partial travels with it and reaches its owner inside the next round's
first hop (``2(N-1)/N`` of the global K and V in all, the minimum). Causal attention
skips blocks entirely in the future; a mask (boolean or additive, differentiable) is
read per chunk; GQA K/V travel with their own, fewer heads. Float16/bfloat16 are
computed in float32 and rounded once. What the family routes here, delegates and
refuses is in the package (``physicsnemo_shardext.patches.attention``).

Examples:
    On 2 ranks, a causal self-attention over 9 positions split 5/4, on the local blocks:

    >>> import torch.nn.functional as F
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.primitives import dim_layout
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> g = torch.Generator().manual_seed(4)
    >>> q, k, v = (torch.randn(2, 9, 4, generator=g) for _ in range(3))
    >>> qs, ks, vs = (shard_tensor(t, mesh, [Shard(1)], [5, 4]) for t in (q, k, v))
    >>> layout = dim_layout(qs, 1)
    >>> out = ring_attention_local(
    ...     qs.to_local(), ks.to_local(), vs.to_local(), layout, (layout.start, layout.stop), is_causal=True
    ... )
    >>> expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, layout.start : layout.stop]
    >>> tuple(out.shape) == [(2, 5, 4), (2, 4, 4)][rank], torch.allclose(out, expected, atol=1e-6)
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from physicsnemo_shardext.primitives import (
    DimLayout,
    pack_bytes,
    packed_nbytes,
    refuse_higher_order,
    ring_shift,
    unpack_bytes,
)

__all__ = ["ring_attention_local"]


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


def _block_spec(t: torch.Tensor, rows: int, dtype: torch.dtype | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a block of ``rows`` rows shaped like ``t`` (its sequence dim ``-2``)."""
    return (*t.shape[:-2], rows, t.shape[-1]), dtype or t.dtype


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
                    specs = [_block_spec(k, n), _block_spec(v, n)]
                    send = buffer if buffer is not None else pack_bytes([kb, vb])
                    kb = vb = buffer = None  # type: ignore[assignment]
                    buffer = ring_shift(send, layout, packed_nbytes(specs))
                    del send
                    kb, vb = unpack_bytes(buffer, specs)
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

        def contribute(
            kb: torch.Tensor, vb: torch.Tensor, offset: int, dk_into: torch.Tensor, dv_into: torch.Tensor
        ) -> None:
            """Add this rank's dK/dV of a K/V chunk into ``dk_into``/``dv_into``; dQ (and dMask) accumulate here."""
            size = kb.shape[-2]
            if _skip_block(plan, offset, size):
                return
            kx, vx = (_as_4d(_expand_heads(x.to(work), rep)) for x in (kb, vb))
            for a, b in _query_chunks(plan, offset, chunks.q_rows):
                bias = _block_scores(plan, mask, (a, b), offset, size, q4, q.shape[:-2])
                dq_c, dk_c, dv_c, dscores = _chunk_grads(
                    dout4[..., a:b, :],
                    q4[..., a:b, :],
                    kx,
                    vx,
                    out4[..., a:b, :],
                    lse[..., a:b],
                    bias,
                    plan.scale,
                    fused,
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
            grads = [_block_spec(k, n_grad, work), _block_spec(v, n_grad, work)]
            return [*grads, _block_spec(k, n_kv), _block_spec(v, n_kv)]

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
                        send = pack_bytes([own_k, own_v])
                    elif carry_rows == own_k.shape[-2]:
                        send = carry
                        slots = unpack_bytes(send, travelling(carry_rows, carry_rows))[2:]
                        for slot, own in zip(slots, (own_k, own_v)):
                            slot.copy_(own)
                    else:
                        send = pack_bytes([*unpack_bytes(carry, travelling(carry_rows, 0))[:2], own_k, own_v])
                else:
                    send, recv = buffer, travelling(n, n)
                carry = buffer = None
                received = ring_shift(send, layout, packed_nbytes(recv))
                del send
                dkp, dvp, kb, vb = unpack_bytes(received, recv)
                if step == 1:
                    if home:
                        _chunk(dk, t - 1, rows).add_(dkp)
                        _chunk(dv, t - 1, rows).add_(dvp)
                    if home != n:  # round 0, or uneven chunks: a buffer with room for the partial
                        fresh = received.new_empty(packed_nbytes(travelling(n, n)))
                        dkp, dvp, new_k, new_v = unpack_bytes(fresh, travelling(n, n))
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
            finished = carry[: packed_nbytes(travelling(carry_rows, 0))]
            grads = ring_shift(finished, layout, packed_nbytes(travelling(home, 0)))
            home_dk, home_dv = unpack_bytes(grads, travelling(home, 0))[:2]
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
