"""Tests of physicsnemo_shardext.engine.import_hooks: callbacks run right after a module's import."""

from __future__ import annotations

import importlib
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from physicsnemo_shardext import ShardextWarning
from physicsnemo_shardext.engine import import_hooks
from physicsnemo_shardext.engine.import_hooks import awaited_modules, call_after_import, cancel_all


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Write a fresh module (unique name) into a folder on ``sys.path``; returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(source: str = "VALUE = 1\n", package: bool = False) -> str:
        name = f"hooked_{uuid.uuid4().hex[:8]}"
        if package:
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text("")
            (tmp_path / name / "sub.py").write_text(source)
            made.append(f"{name}.sub")
        else:
            (tmp_path / f"{name}.py").write_text(source)
        made.append(name)
        importlib.invalidate_caches()
        return name

    yield make
    for name in made:
        cancel_all(name)
        sys.modules.pop(name, None)


def test_runs_at_once_when_already_imported():
    seen = []
    call_after_import("json", lambda: seen.append(1))
    assert seen == [1]


def test_runs_once_right_after_the_module_ran(make_module):
    name = make_module("VALUE = 41\n")
    seen = []
    call_after_import(name, lambda: seen.append(sys.modules[name].VALUE + 1))
    assert seen == [] and name in awaited_modules()
    module = importlib.import_module(name)
    assert seen == [42]  # before import returned, with the module's code fully run
    assert name not in awaited_modules()
    importlib.reload(module)
    sys.modules.pop(name)
    importlib.import_module(name)
    assert seen == [42]  # once


def test_the_finder_leaves_sys_meta_path_when_nothing_is_awaited(make_module, monkeypatch):
    # Start from nothing awaited (this process may await PhysicsNeMo modules already).
    monkeypatch.setattr(import_hooks, "_callbacks", {})
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not import_hooks._FINDER])
    name = make_module()
    before = list(sys.meta_path)
    call_after_import(name, lambda: None)
    assert sys.meta_path == [import_hooks._FINDER, *before]
    importlib.import_module(name)
    assert sys.meta_path == before


def test_the_module_keeps_its_own_loader(make_module):
    name = make_module()
    call_after_import(name, lambda: None)
    module = importlib.import_module(name)
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert module.__spec__.loader is module.__loader__


def test_a_submodule_imported_from_its_package(make_module):
    package = make_module("VALUE = 3\n", package=True)
    seen = []
    call_after_import(f"{package}.sub", lambda: seen.append("sub"))
    exec(f"from {package} import sub", {})
    assert seen == ["sub"]


def test_a_failing_callback_warns_and_the_import_goes_on(make_module):
    name = make_module()
    seen = []

    def broken():
        raise RuntimeError("boom")

    call_after_import(name, broken)
    call_after_import(name, lambda: seen.append("next"))
    with pytest.warns(ShardextWarning, match=rf"broken, run after importing {name}, failed: RuntimeError: boom"):
        module = importlib.import_module(name)
    assert module.VALUE == 1 and seen == ["next"]


def test_system_exit_in_a_callback_is_contained(make_module):
    name = make_module()
    call_after_import(name, lambda: sys.exit(3))
    with pytest.warns(ShardextWarning, match="SystemExit: 3"):
        importlib.import_module(name)


def test_a_real_ctrl_c_still_interrupts(make_module):
    name = make_module()

    def interrupted():
        raise KeyboardInterrupt

    call_after_import(name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        importlib.import_module(name)


def test_a_failed_import_keeps_its_callbacks_for_the_next_one(make_module, tmp_path):
    name = make_module("raise ImportError('not yet')\n")
    seen = []
    call_after_import(name, lambda: seen.append("ran"))
    with pytest.raises(ImportError, match="not yet"):
        importlib.import_module(name)
    assert seen == [] and name in awaited_modules()
    (tmp_path / f"{name}.py").write_text("VALUE = 2\n")
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    sys.path_importer_cache.clear()  # the bytecode cache must not hide the new source
    importlib.import_module(name)
    assert seen == ["ran"]


def test_registered_during_the_module_own_import_runs_at_once(make_module):
    seen: list[str] = []
    name = make_module(
        "import sys\n"
        "from physicsnemo_shardext.engine.import_hooks import call_after_import\n"
        "call_after_import(__name__, lambda: sys.modules['builtins'].__dict__.setdefault('_hook_seen', []).append(1))\n"
    )
    import builtins

    try:
        importlib.import_module(name)
        seen = builtins.__dict__.get("_hook_seen", [])
    finally:
        builtins.__dict__.pop("_hook_seen", None)
    assert seen == [1]


def test_thread_safe_registration_and_import(make_module):
    name = make_module("import time\ntime.sleep(0.05)\nVALUE = 1\n")
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def count(index: int) -> None:
        with lock:
            counts[index] = counts.get(index, 0) + 1

    registrations = [threading.Thread(target=call_after_import, args=(name, lambda i=i: count(i))) for i in range(16)]
    for thread in registrations:
        thread.start()
    for thread in registrations:
        thread.join()
    importers = [threading.Thread(target=importlib.import_module, args=(name,)) for _ in range(4)]
    for thread in importers:
        thread.start()
    for thread in importers:
        thread.join()
    assert counts == {i: 1 for i in range(16)}
    assert name not in awaited_modules()
