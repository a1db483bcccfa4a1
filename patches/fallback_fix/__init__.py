"""Correction of PhysicsNeMo's DTensor-fallback backward (version-detected).

Every op without a shard patch goes through PhysicsNeMo's DTensor fallback,
which converts ShardTensor inputs with the autograd Function
``_ShardTensorToDTensor``. In PhysicsNeMo 2.2.2 its ``backward`` rebuilds the
input spec with ``dataclasses.replace(cached_spec, placements=grad_placements)``.
On torch >= 2.10 a spec carries a ``shard_order`` derived from its placements,
which ``replace`` copies unchanged; when the gradient's placements differ from
the input's (the fallback replicated a sharded input: sort, topk, batch_norm,
softmax along the sharded dim...) torch rejects the stale ``shard_order``
("placement[0] doesn't have a matching shard in shard_order") and every such
backward crashes. Even where it did not crash, relabelling a Replicate
gradient as ``Shard`` would keep the full tensor as "local shard".

This plugin replaces that ``backward`` (``patches.replace_attribute``) with one
that returns the gradient in the *input's own* layout, placement by placement:

* grad ``Replicate`` where the input was ``Shard(d)``: keep the local slice
  given by the cached (possibly uneven) shard sizes, no communication;
* grad ``Partial`` where the input was ``Replicate``: stay ``Partial``, as
  PhysicsNeMo intends (the pending sum is resolved at the plain-tensor
  boundary, e.g. a replicated parameter);
* input ``Partial`` (a pending sum over the ranks): the gradient of each
  rank's summand is the whole gradient, so it stays ``Replicate`` (or ``Partial``
  if it came that way) instead of being redistributed to ``Partial``;
* any other mismatch (``Partial`` or a differently sharded grad where the input
  was ``Shard``, a sharded grad where it was ``Replicate``): redistribute to
  ``Replicate`` on that mesh dim, then take the local slice.

Detection: a behavioural probe (`fallback_backward_is_defective`) calls
the *original* PhysicsNeMo ``backward`` on a stub context whose spec is
``Shard(0)`` and a stub gradient whose placements are ``Replicate``; the
defect shows as torch's ``shard_order`` AssertionError raised while the spec
is rebuilt, before anything touches a tensor, a mesh or a process group. A
version check would be both too wide (a PhysicsNeMo 2.2.x with the fix) and
too narrow (the defect needs torch's ``shard_order`` too); the probe tests the
exact failing step with no side effect and runs in microseconds.

Second correction: the backward *entry points*. ``torch.Tensor.backward`` and
``torch.autograd.backward`` have no shard patch in PhysicsNeMo 2.2, so they go
through the DTensor fallback, which runs the whole backward pass inside its
conversion scope where ShardTensor dispatch is bypassed. Anything that runs
forward ops during backward (``torch.utils.checkpoint`` recomputation) then
runs them on ShardTensors with no shard patch (no halo): CheckpointError or
wrong values. ``torch.autograd.grad`` is already a PhysicsNeMo passthrough;
`backward_in_shard_space` does for ``backward`` what plain torch does,
running the autograd engine on the ShardTensors themselves. Declared per
entry point only where PhysicsNeMo neither passes it through nor handles it,
and only where torch has the private engine helpers it needs
(`backward_entry_status`).

Third correction: ``Partial(avg)`` results. The fallback's own function
(``_torch_function_fallback_via_dtensor``) is wrapped so that a result holding a
``Partial(avg)`` placement (a DTensor mean over a sharded dim: wrong value on
unequal shards, gradient scaled by the mesh size on torch 2.14) raises
``MissingShardPatch`` unless it is harmless (`refuse_partial_avg`).

Fourth: metadata reads. ``x.shape``, ``x.dim()``, ``x.dtype`` and the like also go
through the DTensor fallback (a conversion round trip per read) although the
ShardTensor wrapper holds the same global values; `METADATA_GETTERS` joins
ShardTensor's ``_autograd_passthrough_functions``, which PhysicsNeMo runs directly
on the wrapper.

The corrections live in modules of this package, by job: ``gradient_layout`` (the
probe and the fixed backward), ``backward_entry`` (the backward entry points),
``fallback_results`` (the guarded fallback call: ``Partial(avg)``, uneven results, in-place
updates, replicated operands), ``metadata`` (metadata reads) and ``second_order`` (the
backwards kept differentiable); this package declares them and re-exports every public name.

Refused (``MissingShardPatch``): a fallback result holding ``Partial(avg)`` unless
the shards are equal and no gradient is needed (its value or its gradient would be
wrong); and, in the backward entry points, a single plain tensor passed as
``gradient=``/``grad_tensors=``/``inputs=`` next to a ShardTensor (PhysicsNeMo has
already promoted it to a DTensor copy, so it is no longer the caller's tensor).

Examples:
    A sort along a dim split 5 + 2 takes the fallback, which replicates that dim; the
    gradient comes back in the input's own layout:

    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.linspace(-1, 1, 14).reshape(2, 7), mesh, [Shard(1)], [5, 2], requires_grad=True)
    >>> torch.sort(x, dim=1).values.sum().backward()
    >>> x.grad.placements, x.grad.to_local().shape[1] == [5, 2][rank]
    ((Shard(dim=1),), True)

    What ``shardext list --plugin fallback_fix`` shows on an affected install:

    ```python
    physicsnemo.domain_parallel.shard_tensor._ShardTensorToDTensor.backward  attribute  ...
    torch.Tensor.backward                                                    function   ...
    torch.autograd.backward                                                  function   ...
    ```
"""

from __future__ import annotations

import torch  # noqa: F401 - the examples' tensors
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from torch.distributed.tensor import Shard  # noqa: F401 - the examples' placements

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.patches.fallback_fix.backward_entry import (
    BACKWARD_ENTRY_POINTS,
    backward_entry_status,
    backward_in_shard_space,
)
from physicsnemo_shardext.patches.fallback_fix.fallback_results import (
    fallback_without_partial_avg,
    refusal_of_uneven_result,
    refuse_partial_avg,
    settle_replicated_operands,
)
from physicsnemo_shardext.patches.fallback_fix.gradient_layout import (
    _OWNER,
    fallback_backward_is_defective,
    fixed_backward,
    grad_in_input_layout,
)
from physicsnemo_shardext.patches.fallback_fix.metadata import (
    _PASSTHROUGH,
    METADATA_GETTERS,  # noqa: F401 - read as fallback_fix.METADATA_GETTERS
    PASSTHROUGH_WITH_METADATA,
    metadata_passthrough_applies,
)
from physicsnemo_shardext.patches.fallback_fix.second_order import SECOND_ORDER_BACKWARDS, setup_context_naming_op

__all__ = [
    "SECOND_ORDER_BACKWARDS",
    "backward_entry_status",
    "backward_in_shard_space",
    "fallback_backward_is_defective",
    "fallback_without_partial_avg",
    "refusal_of_uneven_result",
    "settle_replicated_operands",
    "fixed_backward",
    "grad_in_input_layout",
    "refuse_partial_avg",
]


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Replace the fallback backward where the probe finds the defect; handle the backward entry points."""
    patches.replace_attribute(
        _OWNER,
        "backward",
        staticmethod(fixed_backward),
        reason="PhysicsNeMo 2.2 fallback backward keeps a stale shard_order (torch>=2.10): "
        "return the gradient in the input's own layout",
        applies=fallback_backward_is_defective,
    )
    patches.replace_attribute(
        _shard_tensor_module,
        "_torch_function_fallback_via_dtensor",
        fallback_without_partial_avg,
        reason="DTensor's Partial(avg) results (a mean over a sharded dim) average local means, wrong on "
        "uneven shards, and their backward scales gradients by the mesh size: refuse them unless harmless",
    )
    patches.replace_attribute(
        ShardTensor,
        _PASSTHROUGH,
        PASSTHROUGH_WITH_METADATA,
        reason="metadata reads (x.shape, x.dim(), x.dtype...) go through the DTensor fallback, a conversion "
        "round trip of about 25 us each; the ShardTensor wrapper holds the same global values: read them directly",
        applies=metadata_passthrough_applies,
    )
    patches.replace_attribute(
        _OWNER,
        "setup_context",
        staticmethod(setup_context_naming_op),
        reason="record which fallback op converted the input, so a second-order refusal names it",
    )
    for owner, name, replacement, what in SECOND_ORDER_BACKWARDS:
        patches.replace_attribute(
            owner,
            name,
            staticmethod(replacement),
            reason=f"PhysicsNeMo 2.2's {what} backward re-wraps a raw local gradient, cutting the graph under "
            "create_graph=True (second-order gradients silently missing): keep it differentiable",
        )
    for entry in BACKWARD_ENTRY_POINTS:
        why_not = backward_entry_status(entry)
        if why_not is not None:
            patches.not_applicable.append((entry.__qualname__, why_not))
            continue
        patches.function(
            entry,
            backward_in_shard_space,
            description="backward on ShardTensors runs the autograd engine directly, not inside the DTensor "
            "fallback's conversion scope (so checkpoint recomputation keeps its shard patches)",
        )
