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
  `ring_shift` per hop, an ``all_to_all_single``, so exactly ``(N-1)/N`` of the global K and V
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

The handlers live in three modules of this package, by job: ``ring`` (the ring
kernel `ring_attention_local` and its chunking), ``sdpa`` (the routing of
`sharded_sdpa`, `replicated_query_attention`, the batch/head split) and ``mha``
(`sharded_multi_head_attention` and the CPU fused kernel's handlers,
`local_fused_sdpa`); this package declares them and re-exports every public name.

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

    >>> import torch
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

import torch.nn.functional as F

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.patches.attention.mha import (
    _FLASH_CPU,
    _FLASH_CPU_BACKWARD,
    _MHA_NAME,
    _flash_cpu_backward_dispatch,
    _flash_cpu_forward_dispatch,
    local_fused_sdpa,
    sharded_multi_head_attention,
)
from physicsnemo_shardext.patches.attention.ring import ring_attention_local
from physicsnemo_shardext.patches.attention.sdpa import _NAME, replicated_query_attention, sharded_sdpa

__all__ = [
    "local_fused_sdpa",
    "replicated_query_attention",
    "ring_attention_local",
    "sharded_multi_head_attention",
    "sharded_sdpa",
]


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
