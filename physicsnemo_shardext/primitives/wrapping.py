"""Unwrap a ShardTensor to its local block and wrap a local block back, with less host time per call.

Every handler unwraps its operands and wraps its result. PhysicsNeMo's
``to_local``/``from_local`` do this through autograd Functions that declare
``setup_context``, for which torch re-binds the arguments with
``inspect.signature`` on every call, and ``from_local`` builds a fresh spec each
time. On a small field that is most of a handler's host time (about 30 and 45 µs
on a 2-core CPU, several times that on a GPU host's CPU). The two functions here
give the same tensors and the same gradients:

* `local_of` returns ``_local_tensor`` itself where no gradient can flow
  (grad mode off, or the ShardTensor does not require grad), else a view
  through a Function whose backward builds what PhysicsNeMo's ``to_local``
  backward builds (the gradient in the input's layout, ``Partial`` read as
  ``Replicate``), with the cached spec;
* `wrap_local` builds the ShardTensor from a spec cached by
  (mesh, placements, sharding shapes, local shape, dtype), through a Function
  whose backward is PhysicsNeMo's own ``from_local`` backward.

Both backwards stay differentiable under ``create_graph=True`` (the gradient is
wrapped through `_Wrap` and unwrapped through `_LocalView` in turn, see
`wrap_gradient`), and a first-order gradient that is an expanded view (the
backward of a sum or mean) is copied once before it is wrapped, so it can be
accumulated into a leaf's ``.grad`` in place by the next backward.

Anything else (a DTensor, a plain tensor) goes to its own ``to_local``.

Examples:
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> x = shard_tensor(torch.arange(17.0), mesh, [Shard(0)], [10, 7])
    >>> local = local_of(x)
    >>> y = wrap_local(2 * local, mesh, (Shard(0),), {0: ((10,), (7,))})
    >>> torch.equal(y.full_tensor(), 2 * torch.arange(17.0))
    True
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from physicsnemo.domain_parallel._shard_tensor_spec import _infer_shard_tensor_spec_from_local_chunks
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate

from physicsnemo_shardext.primitives.higher_order import builds_graph, materialized

__all__ = ["local_of", "wrap_gradient", "wrap_local"]

_TO_LOCAL_BACKWARD = _shard_tensor_module._ToTorchTensor.backward
_FROM_LOCAL_BACKWARD = _shard_tensor_module._FromTorchTensor.backward

#: Specs are immutable once built with explicit sharding shapes; a model meets a few dozen distinct ones.
_SPEC_CACHE: dict[tuple[Any, ...], Any] = {}
_SPEC_CACHE_LIMIT = 4096
# The cached specs hold device meshes (and through them process groups): drop them while the
# interpreter is whole, not during its teardown, where a late process-group destructor can abort.
atexit.register(_SPEC_CACHE.clear)


class _LocalView(torch.autograd.Function):
    """``x.to_local()`` without ``setup_context`` (so torch does not re-bind the arguments)."""

    @staticmethod
    def forward(ctx: Any, x: ShardTensor) -> torch.Tensor:
        ctx.shard_tensor_spec = x._spec
        ctx.grad_placements = None
        local: torch.Tensor = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        spec = ctx.shard_tensor_spec
        if spec._sharding_shapes is None:  # PhysicsNeMo infers the shapes (a collective): its backward's spec
            grad_spec = _TO_LOCAL_BACKWARD(ctx, grad.detach())[0]._spec
        else:
            # What that backward builds (the input's layout, a pending sum read as complete), from the cache.
            placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
            grad_spec = _spec_for(grad, spec.mesh, placements, spec._sharding_shapes)
        return wrap_gradient(grad, grad_spec)


class _Wrap(torch.autograd.Function):
    """``ShardTensor.from_local(local, mesh, placements, sharding_shapes=...)`` with a cached spec."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: Any) -> ShardTensor:
        ctx.previous_placement = spec.placements
        ctx.previous_mesh = spec.mesh
        return ShardTensor(local, spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if type(grad) is ShardTensor and builds_graph(grad):
            # PhysicsNeMo's backward, with the unwrap through `_LocalView` so a graph is kept.
            target = tuple(Replicate() if p.is_partial() else p for p in ctx.previous_placement)
            if tuple(grad.placements) != target:
                grad = grad.redistribute(grad._spec.mesh, target)
            return local_of(grad), None
        return _FROM_LOCAL_BACKWARD(ctx, grad)[0], None


# Bound once, typed loosely: Function.apply is untyped before torch 2.14, and typing.cast would be
# two more calls on the hot path of every handler.
_wrap_apply: Callable[..., Any] = _Wrap.apply
_local_view_apply: Callable[..., Any] = _LocalView.apply


def wrap_gradient(local: torch.Tensor, spec: Any) -> ShardTensor:
    """A gradient's local block as a ShardTensor with ``spec``, for the inside of a ``backward``.

    Under ``create_graph=True`` (grad mode on and ``local`` in a graph) the wrap
    is differentiable (`_Wrap`); otherwise it is a plain wrapper, and an
    expanded ``local`` (stride 0: the backward of a sum or mean) is copied first,
    since a leaf's ``.grad`` may be that very tensor and the next backward adds
    into it in place.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.ones(6, 2), mesh, [Shard(0)], [4, 2])
        >>> g = wrap_gradient(torch.ones(1, 1).expand(x.to_local().shape), x._spec)
        >>> g._local_tensor.stride()
        (2, 1)
    """
    if builds_graph(local):
        wrapped: ShardTensor = _wrap_apply(local, spec)
        return wrapped
    return ShardTensor(materialized(local), spec, requires_grad=local.requires_grad)


def local_of(x: Any) -> torch.Tensor:
    """``x.to_local()``, cheaper for a ShardTensor (same tensor values, same gradient).

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.ones(6, 2), mesh, [Shard(0)], [4, 2], requires_grad=True)
        >>> local_of(x).sum().backward()
        >>> tuple(x.grad.to_local().shape) == ((4, 2), (2, 2))[rank]
        True
    """
    local: torch.Tensor
    if type(x) is not ShardTensor:
        local = x.to_local()
    elif not (x.requires_grad and torch.is_grad_enabled()):
        local = x._local_tensor
    else:
        local = _local_view_apply(x)
    return local


def _frozen(sharding_shapes: Mapping[int, Sequence[Sequence[int]]]) -> tuple[Any, ...]:
    return tuple(
        sorted((int(d), tuple(tuple(int(n) for n in s) for s in shapes)) for d, shapes in sharding_shapes.items())
    )


def wrap_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sharding_shapes: Mapping[int, Sequence[Sequence[int]]],
) -> ShardTensor:
    """``ShardTensor.from_local(local, mesh, placements, sharding_shapes=sharding_shapes)``, cheaper.

    ``placements`` must already name non-negative tensor dims and ``local`` be on the
    mesh's device type (what every handler passes); no communication.

    Examples:
        >>> from torch.distributed.tensor import Shard
        >>> local = torch.ones((10, 7)[rank], 3)
        >>> y = wrap_local(local, mesh, (Shard(0),), {0: ((10, 3), (7, 3))})
        >>> tuple(y.shape), y._spec.sharding_shapes()[0]
        ((17, 3), ((10, 3), (7, 3)))
    """
    wrapped: ShardTensor = _wrap_apply(local, _spec_for(local, mesh, tuple(placements), sharding_shapes))
    return wrapped


def _spec_for(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    sharding_shapes: Mapping[int, Sequence[Sequence[int]]],
) -> Any:
    """PhysicsNeMo's spec for ``local`` with explicit sharding shapes, built once per key."""
    frozen = _frozen(sharding_shapes)
    if is_fake(local):
        # A traced block's strides need not be an eager one's: never cache (or reuse) its spec.
        return _infer_shard_tensor_spec_from_local_chunks(local, mesh, placements, dict(frozen))
    key = (mesh, placements, frozen, tuple(local.shape), local.dtype)
    spec = _SPEC_CACHE.get(key)
    if spec is None:
        spec = _infer_shard_tensor_spec_from_local_chunks(local, mesh, placements, dict(frozen))
        if len(_SPEC_CACHE) >= _SPEC_CACHE_LIMIT:
            _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = spec
    return spec
