"""Make PhysicsNeMo's built-in shard patches present on every machine.

PhysicsNeMo registers its own patches at import time only when CUDA is
available. We register them unconditionally, before any plugin, so that the
registry ShardTensor ends up with is the same on a laptop CPU and on a GPU
node, whatever the import order.

The registry state right after the built-ins are present is the *baseline*:
every undo returns to it, and "overrides a built-in" means "replaces a
baseline handler".

Examples:
    >>> from physicsnemo_shardext.baseline import baseline, ensure_builtin_patches
    >>> ensure_builtin_patches()
    >>> len(baseline().as_dicts()["_function_registry"]) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.shard_registries import PatchLevel, RegistrySnapshot

__all__ = ["baseline", "builtin_handler", "ensure_builtin_patches", "handler_origin"]

_baseline: RegistrySnapshot | None = None


def ensure_builtin_patches() -> None:
    """Register PhysicsNeMo's built-in patches (idempotent) and record the baseline."""
    global _baseline
    if _baseline is not None:
        return
    import physicsnemo.domain_parallel as domain_parallel

    # Importing the patch modules registers them; Python's module cache makes
    # a second call (e.g. PhysicsNeMo's own, on GPU machines) a no-op.
    domain_parallel.register_custom_ops()
    _baseline = shard_registries.snapshot()


def baseline() -> RegistrySnapshot:
    """The registries as they were with the built-ins and before any plugin."""
    ensure_builtin_patches()
    assert _baseline is not None
    return _baseline


def builtin_handler(target: Any, level: PatchLevel | str = PatchLevel.FUNCTION) -> Callable | None:
    """Return the handler ShardTensor had for ``target`` before any plugin, or ``None``.

    An ``override`` patch uses this to delegate the cases the built-in handles well.

    Examples:
        >>> import torch.nn.functional as F
        >>> builtin_handler(F.interpolate).__name__
        'generic_interpolate_wrapper'
    """
    level = PatchLevel(level)
    if level is PatchLevel.ATTRIBUTE:
        # The value the owner held before any plugin replaced it (a staticmethod stays one).
        return shard_registries.original_attribute(target)
    return baseline().as_dicts()[shard_registries.table_name(level)].get(target)


def handler_origin(handler: Callable) -> str:
    """Name who provides a baseline handler: ``"physicsnemo"`` or its module.

    Examples:
        >>> from physicsnemo_shardext.baseline import handler_origin
        >>> handler_origin(print)
        'builtins'
    """
    module = getattr(handler, "__module__", None) or "unknown"
    if module == "physicsnemo" or module.startswith("physicsnemo."):
        return "physicsnemo"
    return module
