"""``torch.compile`` and handlers: a handler is traced into the graph, or breaks it cleanly.

Design decision: **a handler runs under the trace, with functional collectives.**
ShardTensor is a traceable wrapper subclass, so Dynamo records ``F.conv2d(x)`` as
one graph node and runs ``ShardTensor.__torch_function__`` -- hence the handler --
on *fake* operands, first to propagate shapes, then again while AOTAutograd
traces the graph (forward, and the backward of every ``autograd.Function`` the
handler applies). Every exchange of this package goes through the three
collectives of `collectives`, which on fake operands become
``torch.distributed._functional_collectives`` ops: the trace records them, and
the compiled graph communicates exactly what the eager handler does. The
handler's Python (binding, planning, shard sizes) runs once, at trace time;
the shard sizes of its output become part of the compiled graph's guards
(compile with ``dynamic=False``).

`eager_handler` wraps every first-party handler (and any third-party handler
that uses it) so that a traced call is safe:

1. It runs the handler under a guard that refuses any *in-place* c10d
   collective (``c10d.allreduce_``, ``c10d.allgather_``, ...). On a fake tensor
   such a collective moves nothing and is not captured: a handler that issued
   one would compile to a graph that computes local statistics only (a sharded
   ``group_norm`` came out wrong by O(1)) without any error.
2. If the handler cannot be traced -- the guard fired, it handed the call to
   PhysicsNeMo's own handler (`delegate`, whose collectives are c10d calls), it
   reads a tensor's values, or anything else fails on fake operands -- it
   raises Dynamo's ``Unsupported`` instead (`refuse_tracing`). Dynamo turns that
   into a graph break at the user's call: the graph so far is compiled, the call
   runs eagerly, and tracing resumes after it. With ``fullgraph=True`` the same
   exception is an error that names the op, never a wrong graph.
   ``MissingShardPatch`` passes through unchanged: it is the eager answer too.
3. ``ShardTensor.__torch_function__`` and ``__torch_dispatch__`` are marked, once
   on import and again before every refusal (``torch._dynamo.reset()`` may clear
   the mark), so that Dynamo never compiles them as frames of their own: an
   eager op runs eagerly all the way down (`run_shard_tensor_dispatch_eagerly`).
   Left alone, Dynamo fails inside PhysicsNeMo's conversion guard (a ``delattr``
   on a ``threading.local``) with ``InternalTorchDynamoError``.

Tracing is **opt-in** for now: ``SHARDEXT_COMPILE_HANDLERS=1`` (or `handlers_traced`
``(True)``). By default every traced call of a first-party handler is a graph break
(the eager-only policy), because one test sequence (inductor-compiled traced handlers,
then further compiled models) left state that made a later eager layout chain wrong.

Examples:
    Outside a trace the decorated handler is the handler:

    >>> calls = []
    >>> @eager_handler
    ... def handler(func, types, args, kwargs):
    ...     calls.append(func)
    ...     return "eager"
    >>> handler(print, (), (1,), {}), calls == [print], handler.__wrapped__.__name__
    ('eager', True, 'handler')

    On fake operands it runs when tracing is on; off (the default) it refuses, with
    Dynamo's graph-break exception:

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     fake = torch.ones(2)
    >>> is_tracing((fake,), {}), is_tracing((torch.ones(2),), {})
    (True, False)
    >>> with handlers_traced(True):
    ...     handler(torch.add, (), (fake, 1), {})
    'eager'
    >>> with handlers_traced(False):
    ...     try:
    ...         handler(torch.add, (), (fake, 1), {})
    ...     except torch._dynamo.exc.Unsupported as e:
    ...         print("ShardTensor handler" in str(e), len(calls))
    True 2
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from physicsnemo_shardext.targets import describe_target

__all__ = [
    "delegate_when_traced",
    "eager_handler",
    "handlers_traced",
    "is_tracing",
    "outside_trace",
    "refuse_tracing",
    "run_shard_tensor_dispatch_eagerly",
    "traced_constants",
]

_H = TypeVar("_H", bound=Callable[..., Any])
_T = TypeVar("_T")

#: Marks a handler wrapped by `eager_handler` (holds the handler it wraps).
_EAGER = "__shardext_eager__"
#: Marks a handler whose traced calls are delegated rather than refused (`delegate_when_traced`).
_TRACED_DELEGATES = "__shardext_delegate_when_traced__"


#: Whether traced calls run the handler (True) or break the graph (False); `handlers_traced` sets it.
_TRACE_HANDLERS = [os.environ.get("SHARDEXT_COMPILE_HANDLERS", "0").strip().lower() in ("1", "true", "yes", "on")]


@contextlib.contextmanager
def handlers_traced(enabled: bool) -> Iterator[None]:
    """Within the block, traced calls of `eager_handler` handlers are traced (``True``) or refused (``False``).

    The default comes from ``SHARDEXT_COMPILE_HANDLERS`` (off unless ``1``: opt-in while a
    state leak seen after inductor-compiled traced handlers is open, see docs/training.md). Dynamo
    caches compiled code: call ``torch._dynamo.reset()`` when switching for a
    function already compiled.
    """
    previous = _TRACE_HANDLERS[0]
    _TRACE_HANDLERS[0] = enabled
    try:
        yield
    finally:
        _TRACE_HANDLERS[0] = previous


class UntraceableHandler(RuntimeError):
    """A traced handler did something that has no faithful graph (an in-place c10d collective)."""


class _NoInPlaceCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is unannotated
    """Refuses every ``c10d`` op (the in-place collectives) while a handler is traced."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "namespace", None) == "c10d":
            raise UntraceableHandler(f"{func} is an in-place c10d collective, which a trace does not capture")
        return func(*args, **(kwargs or {}))


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
            return _traced_call(handler, func, types, args, kwargs)
        return handler(func, types, args, kwargs)

    setattr(eager, _EAGER, handler)
    return eager  # type: ignore[return-value]


def _updates_in_place(func: Any) -> bool:
    """``add_``, ``mul_``, ``__iadd__``, ... : the ops that write into their first operand."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _traced_call(handler: Callable[..., Any], func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """``handler`` on fake operands: traced with functional collectives, or a clean graph break."""
    from physicsnemo.domain_parallel.shard_utils.patch_core import MissingShardPatch
    from torch._dynamo.exc import Unsupported

    from physicsnemo_shardext.primitives.delegation import delegate

    if getattr(handler, _TRACED_DELEGATES, False):
        return delegate(func, types, args, kwargs or {})
    if not _TRACE_HANDLERS[0]:
        refuse_tracing(func)
    if _updates_in_place(func):
        # Functionalization turns the update into a copy whose backward loses the replicated
        # operand's sum over ranks (SongUNet's ``x.add_(params)`` gave a Partial weight gradient).
        refuse_tracing(func, "In-place updates of a ShardTensor run eagerly.")
    try:
        with _NoInPlaceCollectives(), _tracing_scope():  # type: ignore[no-untyped-call]
            return handler(func, types, args, kwargs)
    except (MissingShardPatch, Unsupported):
        raise
    except Exception as error:  # noqa: BLE001 - any failure on fake operands becomes a graph break
        refuse_tracing(func, f"Tracing it failed ({type(error).__name__}: {str(error)[:300]}).")


#: Depth of traced handler calls in progress (`delegate` refuses PhysicsNeMo's handlers inside one).
_TRACED_DEPTH = [0]


@contextlib.contextmanager
def _tracing_scope() -> Iterator[None]:
    _TRACED_DEPTH[0] += 1
    try:
        yield
    finally:
        _TRACED_DEPTH[0] -= 1


@contextlib.contextmanager
def outside_trace() -> Iterator[None]:
    """Run a plan's own tensor arithmetic on real tensors, even inside a trace.

    A plan (row indices, interpolation weights) depends on shapes only, is cached,
    and reads its tensors' values (``tolist``); under a trace those tensors would be
    fake. Within the block every dispatch mode (fake, proxy, functionalization) is
    off. Hand the plan's tensors to the traced computation through `traced_constants`.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def traced_constants(value: _T, like: torch.Tensor) -> _T:
    """``value`` with every real tensor in it re-made as a constant of the trace ``like`` belongs to.

    Eagerly (``like`` is real) ``value`` comes back as it is. Tensors nested in
    tuples, lists, dicts and named tuples are found.

    Examples:
        >>> traced_constants((torch.tensor([1, 2]), 3), torch.ones(1))
        (tensor([1, 2]), 3)
    """
    if not is_fake(like):
        return value

    def remake(t: torch.Tensor) -> torch.Tensor:
        if is_fake(t):
            return t
        # Made inside the running modes: fake for Dynamo's propagation, a recorded constant for AOTAutograd.
        return torch.tensor(t.tolist(), dtype=t.dtype, device=like.device).reshape(t.shape)

    return tree_map_only(torch.Tensor, remake, value)  # type: ignore[no-any-return]


def inside_traced_handler() -> bool:
    """Whether a handler is being traced right now (`delegate` hands nothing to c10d-based handlers then)."""
    return _TRACED_DEPTH[0] > 0


run_shard_tensor_dispatch_eagerly()
