"""The fallback's backward, fixed: each gradient in the layout of the ShardTensor it is the gradient of.

PhysicsNeMo 2.2's ``_ShardTensorToDTensor.backward`` rebuilds the input's spec with
``dataclasses.replace``, keeping a ``shard_order`` that torch >= 2.10 rejects once the
gradient's placements differ from the input's. `fallback_backward_is_defective` probes
the original for that defect (stubs only); `fixed_backward`, declared in its place by the
family, returns `grad_in_input_layout`: the input's placements and uneven shard sizes,
placement by placement (the rules are in the family's docstring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from physicsnemo_shardext import AttributeTarget, MissingShardPatch, original_attribute
from physicsnemo_shardext.primitives import builds_graph, has_internal_overlap, tensor_meta_of

__all__ = ["fallback_backward_is_defective", "fixed_backward", "grad_in_input_layout"]

_OWNER = _shard_tensor_module._ShardTensorToDTensor
_TARGET = AttributeTarget(_OWNER, "backward")


# -- detection ------------------------------------------------------------------------------
def fallback_backward_is_defective() -> bool:
    """Whether PhysicsNeMo's own ``_ShardTensorToDTensor.backward`` has the stale-``shard_order`` defect.

    Probes the original ``backward`` (the one PhysicsNeMo defined, even if this
    plugin already replaced it) with stubs; no tensor, mesh or process group is used.

    Examples:
        >>> fallback_backward_is_defective()  # PhysicsNeMo 2.2.2 with torch 2.14
        True
    """
    original = original_attribute(_TARGET)
    backward = original.__func__ if isinstance(original, staticmethod) else original
    spec_type = _shard_tensor_module.ShardTensorSpec
    try:
        cached = spec_type(mesh=None, placements=(Shard(0),), tensor_meta=None)
    except Exception:  # a spec type we do not know how to build: not the defect we fix
        return False
    grad = SimpleNamespace(_spec=SimpleNamespace(placements=(Replicate(),), tensor_meta=None))
    try:
        backward(SimpleNamespace(shard_tensor_spec=cached), grad)
    except AssertionError as error:
        return "shard_order" in str(error)
    except Exception:
        return False  # it got past rebuilding the spec: the step we fix works
    return False


# -- the fixed backward ---------------------------------------------------------------------
def _target_placements(
    input_placements: Sequence[Placement], grad_placements: Sequence[Placement]
) -> tuple[Placement, ...]:
    """Input placements, except a Partial gradient over a mesh dim where the input was Replicate stays Partial.

    Where the input itself was ``Partial`` (a pending sum, e.g. Transolver's slice tokens, a
    sum over the sharded points), each rank's summand gets the whole gradient: ``Replicate``
    (or the gradient's own ``Partial``), never a redistribution *to* ``Partial``.
    """
    return tuple(
        g
        if isinstance(g, Partial) and isinstance(p, (Replicate, Partial))
        else Replicate()
        if isinstance(p, Partial)
        else p
        for p, g in zip(input_placements, grad_placements)
    )


def _slice_to_input_shards(local: torch.Tensor, spec: Any, placements: Sequence[Placement]) -> torch.Tensor:
    """Cut a tensor replicated over every Shard mesh dim down to this rank's (uneven) shard."""
    shapes = spec.sharding_shapes()
    mesh = spec.mesh
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % local.dim()
        sizes = [s[dim] for s in shapes[mesh_dim]]
        coord = mesh.get_local_rank(mesh_dim)
        start = sum(sizes[:coord])
        local = local.narrow(dim, start, sizes[coord])
    return local


def grad_in_input_layout(grad_output: DTensor, spec: Any, op: str | None = None) -> ShardTensor:
    """Bring a fallback gradient into the layout of the ShardTensor it is the gradient of.

    Under ``create_graph=True`` the result stays in the graph where the layout is
    already the input's; where it would need a redistribution, ``MissingShardPatch``
    names ``op`` (a second-order gradient through it would be cut).

    Args:
        grad_output: the DTensor gradient DTensor's autograd produced for the input.
        spec: the input's cached ``ShardTensorSpec`` (placements and uneven sharding shapes).
        op: the op the fallback ran, for the refusal's message.

    Returns:
        A ShardTensor with the input's placements (Partial kept where the input
        was Replicate) and exactly the input's local shard shapes.
    """
    target = _target_placements(spec.placements, grad_output.placements)
    grad_placements = tuple(grad_output.placements)
    local = grad_output._local_tensor
    same_layout = grad_placements == target and tuple(local.shape) == tuple(spec.local_shape)
    if builds_graph(grad_output):  # create_graph=True: the result must stay differentiable
        if not same_layout:
            raise MissingShardPatch(
                f"{op or 'an op without a shard patch'} (DTensor fallback): second-order gradients "
                f"(create_graph=True) through a fallback that changed the layout ({grad_placements} -> "
                f"{target}) are not supported; give the op a shard patch or compute this term on plain tensors"
            )
        new_spec = dataclasses.replace(
            spec, placements=target, shard_order=None, tensor_meta=tensor_meta_of(grad_output)
        )
        return _shard_tensor_module._DTensorToShardTensor.apply(grad_output, new_spec)
    if same_layout:
        # Already the input's layout (the op ran locally): adopt the grad's own stride, as
        # PhysicsNeMo does, since grad memory may be laid out unlike the primal's. An expanded
        # grad (stride 0) is copied: it may become a leaf's .grad, added into in place later.
        local_grad, tensor_meta = local, tensor_meta_of(grad_output)
        if has_internal_overlap(local):
            local_grad = local.contiguous()
            tensor_meta = tensor_meta._replace(stride=_contiguous_stride(tensor_meta.shape))
    else:
        # Replicate every mesh dim the input is sharded on (and resolve other mismatches), then slice.
        staged = tuple(
            t if isinstance(t, Partial) or (t == g and not isinstance(t, Shard)) else Replicate()
            for t, g in zip(target, grad_placements)
        )
        if staged != grad_placements:
            local = grad_output.redistribute(grad_output.device_mesh, staged)._local_tensor
        local_grad = _slice_to_input_shards(local, spec, target).contiguous()
        meta = spec.tensor_meta
        tensor_meta = meta._replace(stride=_contiguous_stride(meta.shape), dtype=local_grad.dtype)  # a NamedTuple
    new_spec = dataclasses.replace(
        spec,
        placements=target,
        shard_order=None,  # re-derived from the new placements (keeping the stale one is the defect)
        tensor_meta=tensor_meta,
    )
    return ShardTensor.__new__(ShardTensor, local_tensor=local_grad, spec=new_spec, requires_grad=False)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def fixed_backward(ctx: Any, grad_output: DTensor) -> tuple[ShardTensor]:
    """Replacement for ``_ShardTensorToDTensor.backward``: the gradient in the input's own layout.

    Examples:
        Through any op that takes the fallback, on 2 ranks:

        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(14.0).reshape(2, 7), mesh, [Shard(1)], [5, 2], requires_grad=True)
        >>> y = torch.sort(x, dim=1).values           # the fallback replicates dim 1
        >>> y.sum().backward()                        # x.grad: Shard(1), x's uneven sizes
        >>> x.grad.placements, x.grad.to_local().shape[1] == [5, 2][rank]
        ((Shard(dim=1),), True)
    """
    return (grad_in_input_layout(grad_output, ctx.shard_tensor_spec, getattr(ctx, "shardext_op", None)),)
