"""Run a function right after a module is imported, whoever imports it.

`call_after_import` runs the callback at once when the module is already in
``sys.modules``; otherwise a finder at the front of ``sys.meta_path`` waits for
the module's import, and the callback runs once, right after the module's code
finished executing (before ``import`` returns to whoever imported it). The
finder leaves ``sys.meta_path`` when nothing is awaited any more.

What a callback raises never breaks the import that triggered it: it becomes a
`ShardextWarning` (a real Ctrl-C still interrupts). An import that fails keeps
its callbacks waiting for a later, successful import.

Used for what only matters once a heavy module is loaded: PhysicsNeMo's
neighbourhood-attention built-ins (`physicsnemo_shardext.engine.lazy_builtins`) and
plugins that declare ``shardext_import_after`` (`physicsnemo_shardext.engine.loader`).

Examples:
    >>> import sys
    >>> seen = []
    >>> call_after_import("json", lambda: seen.append("json"))   # imported already: runs now
    >>> seen
    ['json']
    >>> call_after_import("shardext_demo_never_imported", lambda: seen.append("demo"))
    >>> "shardext_demo_never_imported" in awaited_modules()
    True
    >>> cancel_all("shardext_demo_never_imported")
    >>> "shardext_demo_never_imported" in awaited_modules()
    False
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from physicsnemo_shardext.errors import ShardextWarning, is_user_interrupt

__all__ = ["awaited_modules", "call_after_import", "cancel_all"]

_lock = threading.RLock()
_callbacks: dict[str, list[Callable[[], Any]]] = {}


def call_after_import(module_name: str, callback: Callable[[], Any]) -> None:
    """Call ``callback()`` once ``module_name`` is imported: now if it is, else right after its import.

    A module that is in ``sys.modules`` counts as imported, even while its own
    code is still running (a callback registered from inside that import runs at once).
    """
    with _lock:
        if module_name not in sys.modules:
            _callbacks.setdefault(module_name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    _run(module_name, callback)


def awaited_modules() -> list[str]:
    """The modules callbacks are waiting for, sorted."""
    with _lock:
        return sorted(_callbacks)


def cancel_all(module_name: str) -> None:
    """Forget every callback waiting for ``module_name`` (for tests and teardown)."""
    with _lock:
        _callbacks.pop(module_name, None)
        _leave_meta_path_if_idle()


def _leave_meta_path_if_idle() -> None:
    if not _callbacks and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def _imported(module_name: str) -> None:
    """The module's code ran: take its callbacks (once) and run them."""
    with _lock:
        callbacks = _callbacks.pop(module_name, [])
        _leave_meta_path_if_idle()
    for callback in callbacks:
        _run(module_name, callback)


def _run(module_name: str, callback: Callable[[], Any]) -> None:
    try:
        callback()
    except BaseException as error:  # a callback never breaks the user's import
        if is_user_interrupt(error):
            raise
        function = getattr(callback, "func", callback)  # a functools.partial names its function
        name = getattr(function, "__qualname__", repr(callback))
        warnings.warn(
            f"{name}, run after importing {module_name}, failed: {type(error).__name__}: {error}",
            ShardextWarning,
            stacklevel=2,
        )


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for an awaited module it asks the other finders and wraps the loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _ThenCallBack(spec.loader, fullname)
            return spec
        return None


class _ThenCallBack(importlib.abc.Loader):
    """The module's own loader, then the callbacks; the module only ever sees its own loader."""

    def __init__(self, loader: Any, module_name: str) -> None:
        self.loader, self.module_name = loader, module_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Tools read __loader__ / __spec__.loader (resources, source): put the real one back first.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _imported(self.module_name)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... asked before exec
        return getattr(self.loader, name)


_FINDER = _AfterImportFinder()
