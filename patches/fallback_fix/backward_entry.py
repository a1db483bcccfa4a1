"""The backward entry points on ShardTensors: the autograd engine run directly, as plain torch does.

``torch.Tensor.backward`` and ``torch.autograd.backward`` have no shard patch in
PhysicsNeMo 2.2: the DTensor fallback runs the whole backward pass inside its conversion
scope, where ops that run during backward (``torch.utils.checkpoint`` recomputation) meet
no shard patch. `backward_in_shard_space` takes the steps of ``torch.autograd.backward``
after its ``__torch_function__`` check with ShardTensor dispatch left active;
`backward_entry_status` says where it is not needed or not possible.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Shard  # noqa: F401 - Shard: the examples' placements
from torch.overrides import is_tensor_like

from physicsnemo_shardext import MissingShardPatch, builtin_handler

__all__ = ["BACKWARD_ENTRY_POINTS", "backward_entry_status", "backward_in_shard_space"]

#: Entry points that start a backward pass; PhysicsNeMo 2.2 sends both through the DTensor fallback.
BACKWARD_ENTRY_POINTS: tuple[Callable, ...] = (torch.Tensor.backward, torch.autograd.backward)

# Private torch helpers torch.autograd.backward itself uses after its __torch_function__ check;
# calling them (rather than torch.autograd.backward) is what keeps the backward out of
# __torch_function__ without disabling subclass dispatch for the ops autograd runs.
_ENGINE_HELPERS = (
    (torch.autograd, "_make_grads"),
    (torch.autograd, "_tensor_or_tensors_to_tuple"),
    (torch.autograd.graph, "_engine_run_backward"),
)


def _missing_engine_helpers() -> list[str]:
    return [f"{mod.__name__}.{name}" for mod, name in _ENGINE_HELPERS if not callable(getattr(mod, name, None))]


def backward_entry_status(entry: Callable) -> str | None:
    """Why ``entry`` (``torch.Tensor.backward`` or ``torch.autograd.backward``) needs no handler here, or None.

    None means: PhysicsNeMo routes it through the DTensor fallback (neither an
    autograd passthrough nor a built-in handler) and torch has the engine
    helpers `backward_in_shard_space` needs, so the handler is declared.

    Examples:
        >>> backward_entry_status(torch.autograd.backward) is None  # PhysicsNeMo 2.2.2, torch 2.14
        True
    """
    if entry in getattr(ShardTensor, "_autograd_passthrough_functions", ()):
        return "PhysicsNeMo already runs it directly on ShardTensors (autograd passthrough)"
    if builtin_handler(entry) is not None:
        return "PhysicsNeMo has its own handler for it"
    missing = _missing_engine_helpers()
    if missing:
        return f"this torch lacks the private autograd helpers the handler needs: {', '.join(missing)}"
    return None


def _inputs_tuple(value: Any) -> tuple[Any, ...]:
    """``inputs`` as torch.autograd.backward normalizes it (a dict gives its values)."""
    if is_tensor_like(value) or isinstance(value, torch.autograd.graph.GradientEdge):
        return (value,)
    if type(value) is dict:
        return tuple(value.values())
    if isinstance(value, Mapping):
        raise TypeError(
            f"`inputs` argument to `backward()` must be a dict, not {type(value).__name__}. "
            "Other Mapping types are not supported."
        )
    return tuple(value)


def _refuse_promoted(func: Callable, name: str, value: Any) -> None:
    """A bare DTensor here is a plain tensor PhysicsNeMo promoted before the handler ran: no longer the caller's."""
    if isinstance(value, DTensor) and not isinstance(value, ShardTensor):
        hint = "pass it in a list (inputs=[t])" if name == "inputs" else "pass a ShardTensor in the output's layout"
        raise MissingShardPatch(
            f"{getattr(func, '__qualname__', func)}: a single non-ShardTensor tensor as `{name}=` next to a "
            f"ShardTensor (PhysicsNeMo promotes it to a Replicate DTensor copy before any handler runs); {hint}"
        )


def backward_in_shard_space(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Run ``Tensor.backward`` / ``torch.autograd.backward`` on ShardTensors as plain torch does.

    Function-level handler for both entry points: the same steps as
    ``torch.autograd.backward`` after its ``__torch_function__`` check (the
    ``grad_variables`` merge, ``inputs`` normalization, ``retain_graph``
    defaulting to ``create_graph``, ``_make_grads``, one engine run), with
    ShardTensor dispatch left active, so ops autograd runs during backward
    (checkpoint recomputation) use their shard patches.

    Examples:
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> x = shard_tensor(torch.arange(14.0).reshape(2, 7), mesh, [Shard(1)], [5, 2], requires_grad=True)
        >>> y = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)
        >>> torch.autograd.backward([y.sum()])      # recomputation runs sin on the ShardTensor
        >>> torch.allclose(x.grad.to_local(), torch.cos(x.to_local()))
        True

        With a convolution (the ``convolution`` family, not run here):

        ```python
        y = torch.utils.checkpoint.checkpoint(conv, x_sharded, use_reentrant=False)
        y.sum().backward()        # recomputation runs conv with its halo exchange
        ```
    """
    if func is torch.Tensor.backward:
        bound = inspect.signature(torch.Tensor.backward).bind(*args, **kwargs)
        opts = dict(bound.arguments)
        tensors, grad_tensors, grad_variables = opts.pop("self"), opts.get("gradient"), None
        _refuse_promoted(func, "gradient", grad_tensors)
    else:
        bound = inspect.signature(torch.autograd.backward).bind(*args, **kwargs)
        opts = dict(bound.arguments)
        tensors, grad_tensors, grad_variables = opts["tensors"], opts.get("grad_tensors"), opts.get("grad_variables")
        _refuse_promoted(func, "grad_tensors", grad_tensors)
    inputs = opts.get("inputs")
    if func is torch.Tensor.backward:
        _refuse_promoted(func, "inputs", inputs)
    retain_graph, create_graph = opts.get("retain_graph"), opts.get("create_graph", False)

    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            "backward() called inside a functorch transform. This is not supported, please use "
            "functorch.grad or functorch.vjp instead or call backward() outside of functorch transforms."
        )
    if grad_variables is not None:  # torch.autograd.backward merged it before dispatching; kept for direct calls
        warnings.warn("`grad_variables` is deprecated. Use `grad_tensors` instead.", FutureWarning, stacklevel=2)
        if grad_tensors is not None:
            raise RuntimeError(
                "`grad_tensors` and `grad_variables` (deprecated) arguments both passed to `backward()`. "
                "Please only use `grad_tensors`."
            )
        grad_tensors = grad_variables
    inputs_tuple = () if inputs is None else _inputs_tuple(inputs)
    if inputs is not None and len(inputs_tuple) == 0:
        raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    if is_tensor_like(tensors) or isinstance(tensors, torch.autograd.graph.GradientEdge):
        tensors = (tensors,)
    else:
        tensors = tuple(tensors)

    grads = torch.autograd._tensor_or_tensors_to_tuple(grad_tensors, len(tensors))
    grads = torch.autograd._make_grads(tensors, grads, is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    torch.autograd.graph._engine_run_backward(
        tensors, grads, retain_graph, create_graph, inputs_tuple, allow_unreachable=True, accumulate_grad=True
    )
