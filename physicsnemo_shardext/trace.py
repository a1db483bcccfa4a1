"""Opt-in tracing of handler decisions: "op -> handler -> plugin".

Off by default, so ShardTensor calls a plugin's own handler with no wrapper on
the hot path. Turn it on with ``SHARDEXT_TRACE=1`` or
``physicsnemo_shardext.get_registry().set_trace(True)``; decisions are logged
at INFO level on the ``physicsnemo_shardext.trace`` logger.

Example:
    >>> import logging
    >>> def handler(func, types, args, kwargs):
    ...     return "done"
    >>> traced = traced_handler(handler, target="torch.roll", plugin="demo (demo==1.0)")
    >>> traced(None, (), (), {})
    'done'
    >>> traced.__wrapped__ is handler
    True
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from physicsnemo_shardext.targets import describe_handler

__all__ = ["TRACE_LOGGER", "traced_handler"]

TRACE_LOGGER = logging.getLogger("physicsnemo_shardext.trace")


def traced_handler(handler: Callable, *, target: str, plugin: str) -> Callable:
    """Wrap ``handler`` so each call logs which plugin handled which op."""
    handler_name = describe_handler(handler)

    @functools.wraps(handler)
    def traced(*args: Any, **kwargs: Any) -> Any:
        TRACE_LOGGER.info("%s -> %s -> %s", target, handler_name, plugin)
        return handler(*args, **kwargs)

    return traced
