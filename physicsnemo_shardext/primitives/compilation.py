"""``torch.compile`` and handlers: a handler runs eagerly, behind a clean graph break.

Design decision: **handlers are not traced; Dynamo breaks the graph around them.**
The handlers of this package exchange rows and sums with in-place c10d
collectives inside ``torch.autograd.Function``s (see `reductions`), keep
``id()``-keyed records, build ShardTensor specs in Python and open profiler
ranges. None of that has a faithful FX representation. Left alone,
``torch.compile`` (``dynamic=False``) gets them wrong in two ways:

* ShardTensor is a traceable wrapper subclass, so Dynamo records
  ``F.group_norm(x)`` as one graph node and runs ``ShardTensor.__torch_function__``
  -- hence the handler -- on *fake* operands, first to propagate shapes, then
  again while AOTAutograd traces the graph. A collective issued on a fake tensor
  moves nothing and is not captured: the compiled graph computes the local
  statistics only (a sharded ``group_norm`` came out wrong by O(1)), without any
  error.
* When a graph break lands on a ShardTensor op anyway, the op runs eagerly, and
  Dynamo then tries to compile ``ShardTensor.__torch_function__`` itself as a new
  frame. It fails inside PhysicsNeMo's conversion guard (a ``delattr`` on a
  ``threading.local``) with ``InternalTorchDynamoError ...
  method_setattr_standard()``: the crash reported for ``F.pad``, the
  replicated-parameter add and ``rfft2``/``irfft2`` of FNO and AFNO.

`eager_handler` fixes both, for every first-party handler (and any third-party
handler that uses it):

1. Called on fake operands (a Dynamo or AOTAutograd trace, `is_tracing`), the
   handler does nothing and raises Dynamo's ``Unsupported`` (`refuse_tracing`).
   Dynamo turns that into a graph break at the user's call (``F.pad(x, ...)``,
   ``x + bias``, ``torch.fft.rfft2(x)``): the graph so far is compiled, the call
   runs eagerly, and tracing resumes after it. With ``fullgraph=True`` the same
   exception is an error that names the op, never a wrong graph.
2. ``ShardTensor.__torch_function__`` and ``__torch_dispatch__`` are marked, once
   on import and again before every refusal (``torch._dynamo.reset()`` may clear
   the mark), so that Dynamo never compiles them as frames of their own: an
   eager op runs eagerly all the way down (`run_shard_tensor_dispatch_eagerly`).
   Dynamo never *inlines* these methods for ShardTensor operands (it records the
   torch call as a node instead), so the mark changes nothing else.

Everything between two such ops (ops without a first-party handler, plain-tensor
code, PhysicsNeMo's own traceable handlers) is still compiled. The price is one
graph break per sharded op that a first-party handler serves; the handlers keep
exactly their eager numbers and communication.

Examples:
    Outside a trace the decorated handler is the handler:

    >>> calls = []
    >>> @eager_handler
    ... def handler(func, types, args, kwargs):
    ...     calls.append(func)
    ...     return "eager"
    >>> handler(print, (), (1,), {}), calls == [print], handler.__wrapped__.__name__
    ('eager', True, 'handler')

    On fake operands it refuses, with Dynamo's graph-break exception:

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     fake = torch.ones(2)
    >>> is_tracing((fake,), {}), is_tracing((torch.ones(2),), {})
    (True, False)
    >>> try:
    ...     handler(torch.add, (), (fake, 1), {})
    ... except torch._dynamo.exc.Unsupported as e:
    ...     print("ShardTensor handler" in str(e), len(calls))
    True 1
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

from physicsnemo_shardext.targets import describe_target

__all__ = ["delegate_when_traced", "eager_handler", "is_tracing", "refuse_tracing", "run_shard_tensor_dispatch_eagerly"]

_H = TypeVar("_H", bound=Callable[..., Any])

#: Marks a handler wrapped by `eager_handler` (holds the handler it wraps).
_EAGER = "__shardext_eager__"
#: Marks a handler whose traced calls are delegated rather than refused (`delegate_when_traced`).
_TRACED_DELEGATES = "__shardext_delegate_when_traced__"


def is_tracing(args: Any, kwargs: Any = None) -> bool:
    """Whether any tensor among ``args``/``kwargs`` is fake: a Dynamo or AOTAutograd trace is running.

    ``torch.compiler.is_compiling()`` reads ``False`` inside ``__torch_function__``
    during Dynamo's fake propagation, so the operands are asked instead (as
    PhysicsNeMo's ShardTensor does). ``is_fake`` sees through ShardTensor, DTensor
    and functional wrappers.
    """
    for arg in args:
        if _holds_fake(arg):
            return True
    return bool(kwargs) and any(_holds_fake(value) for value in kwargs.values())


def _holds_fake(value: Any) -> bool:
    # Runs on every handler call: tensors and scalars (nearly all arguments) are
    # answered without flattening a pytree; containers take the general path.
    if isinstance(value, torch.Tensor):
        return is_fake(value)
    if isinstance(value, (list, tuple, dict)):
        return any(isinstance(leaf, torch.Tensor) and is_fake(leaf) for leaf in tree_leaves(value))
    return False


def _code_of(method: Any) -> Any:
    function = getattr(method, "__func__", method)
    return getattr(function, "__code__", None)


def run_shard_tensor_dispatch_eagerly() -> None:
    """Never let Dynamo compile ``ShardTensor.__torch_function__``/``__torch_dispatch__`` as frames of their own.

    Sets Dynamo's frame strategy "skip, and skip every frame it calls" on the two
    methods' code objects: when an op on a ShardTensor runs eagerly inside a
    compiled function (after a graph break), the dispatch and the handler below it
    run as plain Python. Idempotent and cheap; a no-op where the private API is
    missing.
    """
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # type: ignore[attr-defined]  # private, not re-exported
    except ImportError:  # pragma: no cover - another torch
        return
    for name in ("__torch_function__", "__torch_dispatch__"):
        code = _code_of(vars(ShardTensor).get(name))
        if code is not None:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def refuse_tracing(func: Any, why: str = "") -> None:
    """Raise Dynamo's graph-break exception for ``func``: its ShardTensor handler runs eagerly, not traced.

    Inside ``torch.compile`` this is a graph break at the user's call; under
    ``fullgraph=True``, ``torch.export`` or a bare ``make_fx`` it is an error naming
    ``func``. Either way nothing is traced with the handler's collectives missing.
    """
    from torch._dynamo.exc import unimplemented

    run_shard_tensor_dispatch_eagerly()
    target = describe_target(func)
    unimplemented(
        gb_type="ShardTensor handler runs eagerly",
        context=f"physicsnemo-shardext handler for {target}",
        explanation=f"The physicsnemo-shardext ShardTensor handler for {target} is written for eager "
        "execution (c10d collectives, Python-side shard bookkeeping) and is not traced; it runs eagerly "
        "between compiled graphs." + (f" {why}" if why else ""),
        hints=[
            "This graph break is expected: the ops around it are still compiled.",
            "Use fullgraph=False (the default) to compile a model on ShardTensor inputs.",
        ],
    )


def delegate_when_traced(handler: _H) -> _H:
    """Mark a layout-only handler whose traced calls go to the handler it replaced instead of breaking the graph.

    AOTAutograd itself calls a few layout ops on fake ShardTensors while it builds
    the joint graph (``.contiguous()`` of the tangents), after Dynamo has chosen
    the graph: a graph break is no longer possible there, and refusing fails the
    compile. For a handler that moves no data and only keeps the shard sizes
    (``contiguous``, ``clone``), PhysicsNeMo's traceable path gives the same
    result, so traced calls are delegated to it. Apply it under `eager_handler`.

    Examples:
        >>> @eager_handler
        ... @delegate_when_traced
        ... def clone_handler(func, types, args, kwargs):
        ...     return func(*args, **kwargs)
        >>> clone_handler(torch.clone, (), (torch.ones(2),), {})
        tensor([1., 1.])
    """
    setattr(handler, _TRACED_DELEGATES, True)
    return handler


def eager_handler(handler: _H) -> _H:
    """Wrap a ``handler(func, types, args, kwargs)`` so that it runs eagerly under ``torch.compile``.

    Outside a trace the wrapper calls ``handler`` unchanged (one scan of the
    operands for fake tensors). On fake operands it calls `refuse_tracing`
    before the handler runs, so no side effect of a traced call (records,
    collectives) ever happens. Wrapping twice is a no-op; ``__wrapped__`` is the
    handler.
    """
    if getattr(handler, _EAGER, None) is not None:
        return handler

    @functools.wraps(handler)
    def eager(func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_tracing(args, kwargs):
            if getattr(handler, _TRACED_DELEGATES, False):
                from physicsnemo_shardext.primitives.delegation import delegate

                return delegate(func, types, args, kwargs or {})
            refuse_tracing(func)
        return handler(func, types, args, kwargs)

    setattr(eager, _EAGER, handler)
    return eager  # type: ignore[return-value]


run_shard_tensor_dispatch_eagerly()
