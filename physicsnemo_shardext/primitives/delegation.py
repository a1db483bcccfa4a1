"""Hand a call to whatever ShardTensor would have run without this handler.

The override rule: a first-party handler that replaces PhysicsNeMo's built-in or
the DTensor fallback handles the configurations it was written for and hands
every other one to what it replaced. `delegate` is that hand-over: the
baseline (pre-plugin) handler for ``func`` if PhysicsNeMo has one, else
PhysicsNeMo's DTensor fallback, looked up when called so that fixes installed on
the fallback (see the ``fallback_fix`` plugin) apply to delegated calls too.

``MissingShardPatch`` is for the configurations where the delegate, too, would
fail or be wrong; everything else delegates.

Examples:
    A handler hands the configurations it does not handle back
    (here ``handles`` stands for the handler's own test):

    ```python
    def my_handler(func, types, args, kwargs):
        x = args[0]
        if not handles(x):
            return delegate(func, types, args, kwargs)   # built-in or DTensor fallback
        ...
    ```

    On 2 ranks, an op without a built-in goes through the DTensor fallback:

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.arange(12.0).reshape(4, 3)
    >>> x = shard_tensor(full, mesh, [Shard(0)], [3, 1])
    >>> torch.equal(delegate(torch.neg, (), (x,), {}).full_tensor(), -full)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module

from physicsnemo_shardext.engine.baseline import builtin_handler
from physicsnemo_shardext.primitives.compilation import inside_traced_handler, refuse_tracing

__all__ = ["delegate", "fallback"]


def fallback(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """Run ``func`` through PhysicsNeMo's DTensor fallback (as ShardTensor does for an unpatched op).

    Examples:
        >>> import torch
        >>> from torch.distributed.tensor import Shard
        >>> from physicsnemo_shardext.testing import shard_tensor
        >>> full = torch.arange(12.0).reshape(4, 3)
        >>> x = shard_tensor(full, mesh, [Shard(0)], [2, 2])
        >>> torch.equal(fallback(torch.cat, ((x, x),), {"dim": 1}).full_tensor(), torch.cat((full, full), 1))
        True
    """
    # Looked up on the module at call time: a plugin may have corrected the fallback.
    return _shard_tensor_module._torch_function_fallback_via_dtensor(func, args, kwargs or {})


def delegate(
    func: Callable[..., Any], types: tuple[type, ...], args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Any:
    """Run the handler ``func`` had before any plugin (PhysicsNeMo's built-in), else the DTensor fallback.

    Examples:
        A handler that does not handle ``Partial`` inputs:

        ```python
        if is_partial(x):
            return delegate(func, types, args, kwargs)
        ```
    """
    kwargs = kwargs or {}
    builtin = builtin_handler(func)
    if builtin is not None:
        if inside_traced_handler():
            # PhysicsNeMo's handlers exchange with in-place c10d calls, which a trace does not capture.
            refuse_tracing(func, "The configuration is handed to PhysicsNeMo's built-in handler, which runs eagerly.")
        return builtin(func, types, args, kwargs)
    return fallback(func, args, kwargs)
