"""Hand a call to whatever ShardTensor would have run without this handler.

The override rule: a first-party handler that replaces PhysicsNeMo's built-in or
the DTensor fallback handles the configurations it was written for and hands
every other one to what it replaced. :func:`delegate` is that hand-over: the
baseline (pre-plugin) handler for ``func`` if PhysicsNeMo has one, else
PhysicsNeMo's DTensor fallback, looked up when called so that fixes installed on
the fallback (see the ``fallback_fix`` plugin) apply to delegated calls too.

``MissingShardPatch`` is for the configurations where the delegate, too, would
fail or be wrong; everything else delegates.

Example::

    def my_handler(func, types, args, kwargs):
        x = args[0]
        if not handles(x):
            return delegate(func, types, args, kwargs)   # built-in or DTensor fallback
        ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module

from physicsnemo_shardext.builtins import builtin_handler

__all__ = ["delegate", "fallback"]


def fallback(func: Callable, args: tuple, kwargs: dict | None = None) -> Any:
    """Run ``func`` through PhysicsNeMo's DTensor fallback (as ShardTensor does for an unpatched op).

    Example::

        out = fallback(torch.cat, (tensors,), {"dim": 1})
    """
    # Looked up on the module at call time: a plugin may have corrected the fallback.
    return _shard_tensor_module._torch_function_fallback_via_dtensor(func, args, kwargs or {})


def delegate(func: Callable, types: tuple, args: tuple, kwargs: dict | None) -> Any:
    """Run the handler ``func`` had before any plugin (PhysicsNeMo's built-in), else the DTensor fallback.

    Example::

        if any(p.is_partial() for p in x._spec.placements):
            return delegate(func, types, args, kwargs)
    """
    kwargs = kwargs or {}
    builtin = builtin_handler(func)
    if builtin is not None:
        return builtin(func, types, args, kwargs)
    return fallback(func, args, kwargs)
