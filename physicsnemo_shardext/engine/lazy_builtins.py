"""Make PhysicsNeMo's built-in shard patches present without importing what no call needs yet.

``register_custom_ops()`` imports every built-in patch module. Four of them
import ``physicsnemo.nn`` (and with it ``torch._inductor``, tensordict and warp
kernels), which doubles the time of ``import physicsnemo_shardext`` on a CPU
machine, for ops (kNN, radius search, signed distance fields, neighbourhood
attention) that a program can only call after importing ``physicsnemo.nn``
itself. So on a machine where PhysicsNeMo did not register its built-ins:

* every light module that ``register_custom_ops`` imports is imported as usual
  (the list is read from PhysicsNeMo's own source, so a new release's modules
  are not missed);
* the three heavy *named* handlers (keys are op names, known without imports)
  get a stand-in handler in their slot from the start, so ``shardext list``
  shows them; its first call imports the real module, keeps whatever the slot
  holds (a plugin may have replaced the stand-in) and runs the real handler.
  Whoever imports a heavy module (``register_custom_ops()`` called again, say),
  its own registration is undone right after, so the slot never changes behind
  the framework's back;
* the *function-level* neighbourhood-attention handlers are keyed by functions
  of ``physicsnemo.nn.functional.natten``: they are registered right after that
  module is imported, by whoever imports it (`call_after_import`), and reported
  to the caller so that they join the baseline.

On a CUDA machine PhysicsNeMo has imported everything itself; nothing is deferred.

Examples:
    >>> heavy = deferred_named_handlers()
    >>> heavy["physicsnemo.knn_cuml.default"].module
    'physicsnemo.domain_parallel.shard_utils.knn'
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from physicsnemo_shardext.engine.import_hooks import call_after_import

__all__ = ["DeferredHandler", "deferred_named_handlers", "light_modules", "register_builtins", "stand_in_for"]

_DOMAIN_PARALLEL = "physicsnemo.domain_parallel"
_SHARD_UTILS = f"{_DOMAIN_PARALLEL}.shard_utils"

LateSlots = Sequence[tuple[str, Any]]
"""``[(table, key), ...]``: registry entries a built-in module added after the baseline was taken."""


@dataclass(frozen=True)
class DeferredHandler:
    """A built-in named handler imported on first call: its module and attribute."""

    module: str
    attribute: str


_NAMED: dict[str, DeferredHandler] = {
    "physicsnemo.knn_cuml.default": DeferredHandler(f"{_SHARD_UTILS}.knn", "knn_sharded_wrapper"),
    "physicsnemo.radius_search_warp.default": DeferredHandler(
        f"{_SHARD_UTILS}.point_cloud_ops", "radius_search_wrapper"
    ),
    "physicsnemo.signed_distance_field.default": DeferredHandler(
        f"{_SHARD_UTILS}.mesh_ops", "sharded_signed_distance_field_wrapper"
    ),
}
#: Function-level built-ins registered once the module holding their targets is imported.
_AFTER_IMPORT: dict[str, str] = {"physicsnemo.nn.functional.natten": f"{_SHARD_UTILS}.natten_patches"}

#: Stand-ins by op name (one per process: the slot, the baseline and provenance all hold this object).
_stand_ins: dict[str, Callable[..., Any]] = {}
_lock = threading.RLock()


def deferred_named_handlers() -> dict[str, DeferredHandler]:
    """The named built-ins registered as stand-ins, by op name."""
    return dict(_NAMED)


def stand_in_for(op_name: str) -> Callable[..., Any] | None:
    """The stand-in registered for a deferred named built-in (``None``: not deferred in this process)."""
    return _stand_ins.get(op_name)


def light_modules() -> list[str]:
    """The modules ``register_custom_ops`` imports, minus the deferred ones (read from its source).

    A name imported from a package that is itself a submodule (``from .custom_ops
    import _tensor_ops``) is listed as that submodule.

    Examples:
        >>> modules = light_modules()
        >>> f"{_SHARD_UTILS}.conv_patches" in modules, f"{_SHARD_UTILS}.knn" in modules
        (True, False)
    """
    import physicsnemo.domain_parallel as domain_parallel
    from physicsnemo.domain_parallel import shard_utils

    found = _imported_by(domain_parallel, "register_custom_ops", _DOMAIN_PARALLEL)
    found += _imported_by(shard_utils, "register_shard_wrappers", _SHARD_UTILS)
    deferred = {handler.module for handler in _NAMED.values()} | set(_AFTER_IMPORT.values())
    return [name for name in dict.fromkeys(found) if name not in deferred]


def _imported_by(package: ModuleType, function: str, base: str) -> list[str]:
    """Modules a function of ``package`` imports with ``from ... import ...``, in order."""
    found: list[str] = []
    for node in ast.walk(ast.parse(inspect.getsource(package))):
        if not (isinstance(node, ast.FunctionDef) and node.name == function):
            continue
        for statement in ast.walk(node):
            if isinstance(statement, ast.ImportFrom) and statement.module:
                module = _absolute(statement.module, statement.level, base)
                found.append(module)
                found += [f"{module}.{alias.name}" for alias in statement.names if _is_submodule(module, alias.name)]
    return found


def _is_submodule(package: str, name: str) -> bool:
    """Whether ``package.name`` is a module file; found without running ``package`` or ``name``."""
    spec = importlib.util.find_spec(package)  # imports the parents of ``package`` only
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        return False  # a plain module: ``name`` is one of its attributes
    return importlib.machinery.PathFinder.find_spec(f"{package}.{name}", list(locations)) is not None


def _absolute(module: str, level: int, base: str) -> str:
    if level == 0:
        return module
    package = base.rsplit(".", level - 1)[0] if level > 1 else base
    return f"{package}.{module}"


def register_builtins(on_late_registration: Callable[[LateSlots], None]) -> None:
    """Register PhysicsNeMo's built-ins, deferring the heavy ones (see the module docstring).

    ``on_late_registration`` receives ``[(table, key), ...]`` when a deferred
    function-level module registers later, so the baseline can include them.
    """
    import physicsnemo.domain_parallel as domain_parallel
    import torch

    heavy = [handler.module for handler in _NAMED.values()] + list(_AFTER_IMPORT.values())
    if torch.cuda.is_available() or all(name in sys.modules for name in heavy):
        domain_parallel.register_custom_ops()  # PhysicsNeMo's own path (a no-op when it already ran)
        return
    for name in light_modules():
        importlib.import_module(name)
    from physicsnemo.domain_parallel import ShardTensor

    for key, handler in _NAMED.items():
        if handler.module in sys.modules:
            continue  # already registered itself
        _stand_ins[key] = ShardTensor._named_function_registry[key] = _stand_in(key, handler)
        call_after_import(handler.module, functools.partial(_undo_own_registration, key, handler))
    for watched, patch_module in _AFTER_IMPORT.items():
        call_after_import(watched, functools.partial(_register_late, patch_module, on_late_registration))


def _stand_in(key: str, deferred: DeferredHandler) -> Callable[..., Any]:
    real: list[Callable[..., Any]] = []

    def handler(*args: Any, **kwargs: Any) -> Any:
        if not real:
            real.append(_import_keeping_slot(key, deferred))
        return real[0](*args, **kwargs)

    # Reads as PhysicsNeMo's handler in listings and provenance (it is, once loaded).
    handler.__module__ = deferred.module
    handler.__name__ = handler.__qualname__ = deferred.attribute
    handler.__doc__ = f"PhysicsNeMo's {deferred.attribute}, imported from {deferred.module} on first call."
    return handler


def _import_keeping_slot(key: str, deferred: DeferredHandler) -> Callable[..., Any]:
    """Import the real module (it registers itself under ``key``) and put back what the slot held."""
    from physicsnemo.domain_parallel import ShardTensor

    table = ShardTensor._named_function_registry
    with _lock:
        held = table.get(key)
        module = importlib.import_module(deferred.module)
        if held is None:
            table.pop(key, None)
        else:
            table[key] = held
    real: Callable[..., Any] = getattr(module, deferred.attribute)
    return real


def _undo_own_registration(key: str, deferred: DeferredHandler) -> None:
    """A heavy module just ran and registered its handler over the stand-in: put the stand-in back.

    The stand-in forwards to that same handler, so nothing changes for a caller, and
    a plugin whose import triggered this is not seen writing into the registry.
    """
    from physicsnemo.domain_parallel import ShardTensor

    table = ShardTensor._named_function_registry
    real = getattr(sys.modules[deferred.module], deferred.attribute, None)
    if real is not None and table.get(key) is real:
        table[key] = _stand_ins[key]


def _register_late(patch_module: str, report: Callable[[LateSlots], None]) -> None:
    """Import a function-level patch module now that its targets exist; report the slots it added."""
    from physicsnemo_shardext import shard_registries

    before = shard_registries.snapshot()
    importlib.import_module(patch_module)
    added = [
        (change.table, change.key)
        for change in before.changes(shard_registries.snapshot())
        if change.before is None and change.key is not None
    ]
    report(added)
