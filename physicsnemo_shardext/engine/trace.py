"""Which handlers ShardTensor calls: opt-in trace logging, and call recording for tests.

Tracing is off by default, so ShardTensor calls a plugin's own handler with no
wrapper on the hot path. Turn it on with ``SHARDEXT_TRACE=1`` or
``physicsnemo_shardext.get_registry().set_trace(True)``; decisions are logged
at INFO level on the ``physicsnemo_shardext.engine.trace`` logger.

`HandlerRecorder` is the test-time counterpart: while it records, every
handler in ShardTensor's registries is wrapped so that each call (and what it
returned or raised) is noted; the conformance check uses it to name the
handler, and so the plugin, behind a wrong result.

Examples:
    >>> import logging
    >>> def handler(func, types, args, kwargs):
    ...     return "done"
    >>> traced = traced_handler(handler, target="torch.roll", plugin="demo (demo==1.0)")
    >>> traced(None, (), (), {})
    'done'
    >>> traced.__wrapped__ is handler and untraced(traced) is handler
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext.shard_registries import REGISTRY_ATTRIBUTES, PatchLevel
from physicsnemo_shardext.targets import describe_handler

__all__ = ["TRACE_LOGGER", "HandlerCall", "HandlerRecorder", "traced_handler", "untraced"]

TRACE_LOGGER = logging.getLogger("physicsnemo_shardext.engine.trace")

# Marks a trace wrapper (and holds what it wraps); functools.wraps' __wrapped__ alone
# cannot tell our wrapper from a plugin's own decorated handler.
_TRACED = "__shardext_traced__"

_TABLE_LEVELS: dict[str, PatchLevel] = dict(
    zip(REGISTRY_ATTRIBUTES, (PatchLevel.FUNCTION, PatchLevel.NAMED, PatchLevel.DISPATCH, PatchLevel.DISPATCH))
)


def traced_handler(handler: Callable, *, target: str, plugin: str) -> Callable:
    """Wrap ``handler`` so each call logs which plugin handled which op."""
    handler_name = describe_handler(handler)

    @functools.wraps(handler)
    def traced(*args: Any, **kwargs: Any) -> Any:
        TRACE_LOGGER.info("%s -> %s -> %s", target, handler_name, plugin)
        return handler(*args, **kwargs)

    setattr(traced, _TRACED, handler)
    return traced


def untraced(handler: Any) -> Any:
    """The handler inside a trace wrapper; any other object unchanged.

    Examples:
        >>> untraced(print) is print
        True
    """
    # Read __dict__, not getattr: a handler object with a lenient __getattr__ must not look traced.
    own = getattr(handler, "__dict__", None)
    return own[_TRACED] if isinstance(own, dict) and _TRACED in own else handler


@dataclass(frozen=True)
class HandlerCall:
    """One call ShardTensor made to a registered handler while a `HandlerRecorder` recorded.

    Attributes:
        level: the registry level of the slot.
        target: the slot's key (callable, op name or ``OpOverload``).
        handler: the handler that ran (trace wrappers removed).
        phase: the label given to `HandlerRecorder.recording` (``"forward"``, ``"backward"``).
        result_ids: ``id()`` of every tensor it returned (to find who produced a given output).
        error: ``"Type: message"`` of what it raised, else ``None``.
    """

    level: PatchLevel
    target: Any
    handler: Any
    phase: str
    result_ids: frozenset[int] = frozenset()
    error: str | None = None


class HandlerRecorder:
    """Record every call ShardTensor makes to a registered handler, phase by phase.

    Calls are appended when they end, so a handler called from inside another one
    comes first, and the first call with an ``error`` is where an exception started.

    Examples:
        >>> import torch
        >>> recorder = HandlerRecorder()
        >>> with recorder.recording("forward"):
        ...     _ = torch.ones(2) + 1          # plain tensors never reach ShardTensor's handlers
        >>> recorder.calls
        []
    """

    def __init__(self) -> None:
        self.calls: list[HandlerCall] = []

    @contextlib.contextmanager
    def recording(self, phase: str) -> Iterator[HandlerRecorder]:
        """Wrap every registered handler for the block; each slot gets its own handler back after."""
        wrapped = self._wrap_all(phase)
        try:
            yield self
        finally:
            _unwrap(wrapped)

    def _wrap_all(self, phase: str) -> list[tuple[dict, Any, Callable, Callable]]:
        wrapped = []
        for name, level in _TABLE_LEVELS.items():
            table = getattr(ShardTensor, name, None)
            if not isinstance(table, dict):
                continue  # a rebound or deleted registry: nothing ShardTensor can call there
            for key, handler in list(table.items()):
                wrapper = self._recording_wrapper(level, key, handler, phase)
                table[key] = wrapper
                wrapped.append((table, key, wrapper, handler))
        return wrapped

    def _recording_wrapper(self, level: PatchLevel, key: Any, handler: Callable, phase: str) -> Callable:
        inner = untraced(handler)

        def recording(*args: Any, **kwargs: Any) -> Any:
            try:
                result = handler(*args, **kwargs)
            except BaseException as error:
                self.calls.append(HandlerCall(level, key, inner, phase, error=_describe(error)))
                raise
            self.calls.append(HandlerCall(level, key, inner, phase, _tensor_ids(result)))
            return result

        recording.__wrapped__ = handler  # type: ignore[attr-defined]
        return recording


def _unwrap(wrapped: list[tuple[dict, Any, Callable, Callable]]) -> None:
    for table, key, wrapper, handler in wrapped:
        # Leave a slot alone if something rewrote it meanwhile: that value is the newer truth.
        if table.get(key) is wrapper:
            table[key] = handler


def _tensor_ids(result: Any) -> frozenset[int]:
    import torch
    from torch.utils._pytree import tree_leaves

    try:
        return frozenset(id(leaf) for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor))
    except Exception:  # an exotic return value: just not attributable
        return frozenset()


def _describe(error: BaseException) -> str:
    try:
        message = str(error)
    except Exception:
        message = "<unprintable>"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
