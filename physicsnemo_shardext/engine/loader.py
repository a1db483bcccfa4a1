"""Discover plugins through entry points and load each one in isolation.

For every entry point in the ``physicsnemo_shardext`` group the loader:

1. applies the user's allow/deny lists (``SHARDEXT_ONLY``, ``SHARDEXT_DISABLE``);
2. checks the plugin's identity, (distribution, entry-point name), against every
   other plugin's (see *Names* below);
3. imports it and registers it with pluggy, then checks that its hooks can provide
   something (*hook check*, below);
4. asks its ``shardext_requirements`` hook and skips it if a range is not met;
5. asks its ``shardext_import_after`` hook: while a module named there is not
   imported, the plugin is *deferred* (below);
6. collects its ``shardext_declare_patches`` into a fresh
   `PatchSet`;
7. hands the whole set to the `PatchRegistry`.

**Deferred plugins.** A plugin waiting for a module gets a ``deferred`` report naming
it; right after that module's import (whoever imports it, see
`physicsnemo_shardext.engine.import_hooks`) steps 6-7 run for the same plugin, guarded the
same way, and its report becomes ``loaded`` or ``failed``. A blocked plugin is never
deferred. A deferred plugin is not loaded yet: ``remove_plugin`` does not know it,
``disabled(plugins=...)`` applies to it once it loads. One that loads inside
``sandbox()`` is undone with everything else when the sandbox exits (its report is
``deferred`` again; `resume_ready`, or the next ``load_plugins()``, loads it). A failure at that late
point is reported and warned about, in strict mode too: raising there would break
the import of an unrelated module.

**Failures.** Whatever a plugin raises during steps 3-7 -- any ``Exception``, and
also ``SystemExit``, ``GeneratorExit``, subclasses of ``KeyboardInterrupt`` and
any other ``BaseException`` -- unregisters the plugin, leaves the registries
exactly as they were before it, warns with the distribution, version and
exception (or raises `PluginLoadError` in
strict mode), and the next plugin loads as usual.

**Interrupts.** The one exception that is not contained is a real Ctrl-C. Python's
default SIGINT handler raises exactly ``KeyboardInterrupt``, in whatever code runs
at that moment (often a plugin's import), so the rule is: an exception whose type
*is* ``KeyboardInterrupt`` propagates (after the plugin being loaded is rolled
back); a subclass of it is a plugin's own exception and is contained. A plugin
that raises a bare ``KeyboardInterrupt`` itself cannot be told apart from the
user and interrupts too.

**Writes that bypass the hooks.** ShardTensor's four registries (and the attribute
slots the framework manages) are snapshotted before each plugin and compared
after its import and after each hook. Any difference is the plugin's own write
(``ShardTensor.register_function_handler(...)``, a direct dict write): it is
rolled back at once, so it never reaches the next plugin, and the plugin fails
with an `UndeclaredPatchError` that says
which ``patches.*`` declaration to use instead. Only the framework's install
(step 7) writes into the registries, apart from PhysicsNeMo's built-ins that arrive
when a plugin imports their module (`physicsnemo_shardext.engine.baseline.late_builtins`):
those are neither blamed on the plugin nor rolled back.

**Hooks that provide nothing.** pluggy calls only functions that carry ``@hookimpl``.
A function named like a hook (or a close misspelling starting with ``shardext_``)
without the marker is always a mistake, and so is a plugin with no hook at all, or
with hooks but no ``shardext_declare_patches``: each is warned about, naming the
plugin, its ``distribution==version`` and the function, and kept in the report's
``problems`` (`hook_problems`). A ``shardext_declare_patches`` that runs and declares
nothing on this setup is not a problem.

**Load time.** Each plugin's import and hooks are timed (``load_seconds`` in its
report's ``extra``, without the plugins loading nested inside it); past
``SHARDEXT_SLOW_PLUGIN_SECONDS`` a warning names the plugin and the seconds. Being
slow is never a failure.

**Nested loads.** While a plugin's import or hooks run, loading plugins
(``load_plugins()``, ``load_plugin()``, `PluginLoader.load_entry_points`) is refused:
it would install plugins in the middle of that plugin's isolated load, whose undo
then rolls them back while the registry keeps them. The nested call warns naming the
plugin and loads nothing (strict mode: raises `ReentrantLoadError`); the load in
progress goes on.

**Names.** A plugin is identified by (distribution, entry-point name); names are
compared like user selectors (case and ``-``/``_`` ignored). Entry-point names
declared by ``physicsnemo-shardext`` itself are reserved: another distribution
publishing one is refused, and the first-party plugin loads normally. Two other
distributions publishing one name are *both* refused (each report names both
distributions), and a name already held by a plugin loaded earlier refuses the
newcomer. None of this depends on the order entry points are discovered in.

**Strict mode** (``SHARDEXT_STRICT=1``) raises ``PluginLoadError`` on anything but a
clean load: a failure, a refused name, a bypassing write, a plugin skipped as
incompatible, hooks that provide nothing (`PluginHookError`, stage ``hook check``) and a
nested load (`ReentrantLoadError`, which fails the plugin whose code made the call). An unresolved equal-priority tie raises `PatchConflictError` itself
(the plugin whose install made the tie is reported ``failed``). Plugins the user
blocked are not failures.

Examples:
    >>> import types
    >>> from physicsnemo_shardext.engine.registry import PatchRegistry
    >>> from physicsnemo_shardext.settings import Settings
    >>> plugin = types.ModuleType("empty_plugin")  # a plugin with no hooks declares nothing
    >>> loader = PluginLoader(PatchRegistry(), Settings())
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:  # it loads, but is named as providing nothing
    ...     warnings.simplefilter("always")
    ...     report = loader.load_plugin(plugin, PluginInfo("empty"))
    >>> report.status.value, report.extra["problems"] == [str(caught[0].message).split("as written: ")[1]]
    ('loaded', True)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from physicsnemo_shardext import hookspecs, shard_registries
from physicsnemo_shardext.declarations import PatchSet
from physicsnemo_shardext.engine.baseline import is_late_builtin
from physicsnemo_shardext.engine.discovery import (
    ENTRY_POINT_GROUP,
    discover_entry_points,
    first_party_names,
    is_first_party,
    name_clashes,
    plugin_identity,
    plugin_info_for,
    plugin_name_key,
)
from physicsnemo_shardext.engine.hook_checks import (
    HOOK_NAMES,
    describe_change,
    hook_problems,
    undeclared_patch_error,
    unknown_selector_message,
    unmarked_hooks,
)
from physicsnemo_shardext.engine.import_hooks import call_after_import
from physicsnemo_shardext.engine.provenance import LoadStatus, PluginInfo, PluginReport
from physicsnemo_shardext.engine.registry import PatchRegistry
from physicsnemo_shardext.engine.requirements import incompatibility
from physicsnemo_shardext.errors import (
    IncompatiblePluginError,
    PatchConflictError,
    PluginHookError,
    PluginLoadError,
    ReentrantLoadError,
    ShardextWarning,
    UndeclaredPatchError,
    is_user_interrupt,
)
from physicsnemo_shardext.markers import PROJECT_NAME
from physicsnemo_shardext.settings import Settings
from physicsnemo_shardext.shard_registries import RegistryChange, RegistrySnapshot

__all__ = [
    "ENTRY_POINT_GROUP",
    "HOOK_NAMES",
    "PluginLoader",
    "describe_change",
    "discover_entry_points",
    "first_party_names",
    "hook_problems",
    "loading_now",
    "name_clashes",
    "plugin_info_for",
    "resume_ready",
    "unknown_selector_message",
    "unmarked_hooks",
]


#: Every deferral made in this process: (loader, its deferred report, plugin, modules); see `resume_ready`.
_deferrals: list[tuple[PluginLoader, PluginReport, Any, tuple[str, ...]]] = []
NAME_CHECK_STAGE = "name check"
IMPORT_AFTER_STAGE = "shardext_import_after"
HOOK_CHECK_STAGE = "hook check"
NESTED_LOAD_STAGE = "nested load"


def loading_now() -> PluginInfo | None:
    """The plugin whose import or hooks are running on this thread now (``None``: no plugin load in progress).

    Examples:
        >>> loading_now() is None
        True
    """
    return _loading.stack[-1].info if _loading.stack else None


def _caller_outside_package() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside the framework's own modules.

    Call it from the function that calls ``warnings.warn``. Frames of ``importlib``'s
    bootstrap are skipped without being counted, as ``warnings`` itself does.
    """
    # The framework is every module under the package's folder (engine/, the front door, testing/ ...).
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def internal(frame: Any) -> bool:
        return "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename

    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame = frame.f_back
        while frame is not None and internal(frame):
            frame = frame.f_back
        level += 1
    return level


_NOT_IMPORTED = object()


@dataclass(eq=False)  # compared by identity: nested loads are told apart in `_loading`
class _Attempt:
    """One plugin's load in progress: how far it got and what undoing it must put back."""

    info: PluginInfo
    before: RegistrySnapshot
    held_before: frozenset[str]
    stage: str = "import"
    plugin: Any = _NOT_IMPORTED
    was_registered: bool = True
    #: What `hook_problems` found (warned about once, carried into every report of the plugin).
    problems: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    #: Seconds spent on earlier passes (a deferred plugin's import) and in nested loads (not its own).
    carried: float = 0.0
    nested: float = 0.0

    def seconds(self) -> float:
        """This plugin's own load time so far: import and hooks, earlier passes included, nested loads not."""
        return self.carried + (time.perf_counter() - self.started) - self.nested


class PluginLoader:
    """Loads plugins into a `PatchRegistry`, one at a time, each in isolation."""

    def __init__(self, registry: PatchRegistry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        self.plugin_manager = pluggy.PluginManager(PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        # Deferred plugins whose import hook has not fired yet, by identity: their current report.
        self._waiting: dict[tuple[str, str], PluginReport] = {}

    def load_entry_points(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> list[PluginReport]:
        """Load the given entry points (default: all discovered ones); returns one report each.

        A plugin already loaded under the same identity is skipped without a report,
        so calling this twice is a no-op for what loaded the first time.

        Called while a plugin is being loaded (from its import or a hook), it is refused
        (see `ReentrantLoadError`): it warns and returns ``[]``, or raises in strict mode.
        """
        if self._refuse_nested("load_plugins()"):
            return []
        if entry_points is None:
            entry_points = discover_entry_points()
        entry_points = list(entry_points)
        self._warn_unknown_selectors(entry_points)
        reports: list[PluginReport] = []
        pending = self._pending(entry_points, reports)
        clashes = name_clashes(
            [info for _, info in pending],
            self.registry.plugins() + [r.plugin for r in self.registry.reports() if r.status is LoadStatus.DEFERRED],
            first_party_names() | {plugin_name_key(info.name) for _, info in pending if is_first_party(info)},
        )
        # Refusals first, in a fixed order, so strict mode stops on the same one whatever the discovery order.
        for info in sorted(clashes, key=lambda i: (i.name, i.distribution)):
            reports.append(self._fail(info, NAME_CHECK_STAGE, clashes[info]))
        for entry_point, info in pending:
            if info in clashes or plugin_identity(info) in {plugin_identity(p) for p in self.registry.plugins()}:
                continue  # refused, or a deferred plugin that an earlier one's import has just loaded
            reports.append(self._load(info, entry_point.load))
        return reports

    def load_plugin(self, plugin: Any, info: PluginInfo) -> PluginReport:
        """Register an already-imported plugin object (module, class or instance).

        Its hooks are guarded like an entry point's (any ``BaseException`` contained,
        registry writes rolled back); there is no name check, as it has no distribution.
        Called while another plugin is being loaded, it is refused like `load_entry_points`
        and returns a ``failed`` report (stage ``nested load``).
        """
        if self._refuse_nested(f"load_plugin(..., {info.name!r})"):
            reason = str(self._nested_error(f"load_plugin(..., {info.name!r})"))
            return self._report(PluginReport(info, LoadStatus.FAILED, reason, stage=NESTED_LOAD_STAGE))
        blocked = self._blocked_reason(info)
        if blocked is not None:
            return self._report(PluginReport(info, LoadStatus.BLOCKED, blocked))
        return self._load(info, None, plugin)

    def _warn_unknown_selectors(self, entry_points: Sequence[metadata.EntryPoint]) -> None:
        """Warn about a ``SHARDEXT_DISABLE``/``SHARDEXT_ONLY`` name that designates no plugin, naming close matches.

        A typo there would otherwise be silently ignored (``SHARDEXT_DISABLE``) or block
        everything (``SHARDEXT_ONLY``). Known names are the plugins and distributions of
        the entry points being loaded, of every installed entry point, and of plugins
        already loaded.
        """
        lists = [("SHARDEXT_DISABLE", self.settings.deny), ("SHARDEXT_ONLY", self.settings.allow or ())]
        if not any(selectors for _, selectors in lists):
            return
        known: list[PluginInfo] = [plugin_info_for(ep) for ep in entry_points] + list(self.registry.plugins())
        discovered = False
        for variable, selectors in lists:
            for selector in selectors:
                if not discovered and not any(info.matches(selector) for info in known):
                    known += [plugin_info_for(ep) for ep in discover_entry_points()]
                    discovered = True
                if any(info.matches(selector) for info in known):
                    continue
                warnings.warn(unknown_selector_message(variable, selector, known), ShardextWarning, stacklevel=4)

    @staticmethod
    def _nested_error(call: str) -> ReentrantLoadError:
        info, stage = _loading.stack[-1].info, _loading.stack[-1].stage
        return ReentrantLoadError(info.name, info.distribution, info.version, stage, call)

    def _refuse_nested(self, call: str) -> bool:
        """Whether a plugin's load is in progress on this thread, so ``call`` must not load anything.

        Loading inside a plugin's import or hook would install plugins in the middle of
        that plugin's isolated load (its undo would then roll them back while the
        registry keeps them). Warns naming the plugin, or raises `ReentrantLoadError`
        in strict mode.
        """
        if not _loading.stack:
            return False
        error = self._nested_error(call)
        if self.settings.strict:
            raise error
        warnings.warn(str(error), ShardextWarning, stacklevel=_caller_outside_package())
        return True

    # -- one plugin --------------------------------------------------------------------------
    def _pending(
        self, entry_points: Iterable[metadata.EntryPoint], reports: list[PluginReport]
    ) -> list[tuple[metadata.EntryPoint, PluginInfo]]:
        """Entry points still to load: not loaded already, not duplicated, not blocked (reported here)."""
        seen = {plugin_identity(info) for info in self.registry.plugins()}
        seen |= {identity for identity, report in self._waiting.items() if self._is_current(report)}
        pending = []
        for entry_point in entry_points:
            info = plugin_info_for(entry_point)
            if plugin_identity(info) in seen:
                continue  # loading twice (e.g. a second load_plugins() call) is a no-op; so is waiting
            seen.add(plugin_identity(info))
            blocked = self._blocked_reason(info)
            if blocked is not None:
                reports.append(self._report(PluginReport(info, LoadStatus.BLOCKED, blocked)))
                continue
            pending.append((entry_point, info))
        return pending

    def _load(self, info: PluginInfo, obtain: Callable[[], Any] | None, plugin: Any = _NOT_IMPORTED) -> PluginReport:
        """Run every stage for one plugin; on any failure put everything back and report it."""
        attempt = self._attempt(info, plugin)
        return self._guarded(attempt, lambda: self._run_stages(attempt, obtain))

    def _attempt(self, info: PluginInfo, plugin: Any) -> _Attempt:
        held = frozenset(p.name for p in self.registry.plugins())
        return _Attempt(info, shard_registries.snapshot(), held, plugin=plugin)

    def _guarded(self, attempt: _Attempt, stages: Callable[[], PluginReport], *, late: bool = False) -> PluginReport:
        """Run ``stages``; on any exception undo the attempt and report it (``late``: never raise).

        The time the stages take is the plugin's (``load_seconds`` in its report), less
        that of loads nested in it (a deferred plugin loading inside its import).
        """
        _loading.stack.append(attempt)
        try:
            report = stages()
        except BaseException as error:  # SystemExit & co. included: a plugin never ends the program
            stray = self._undo(attempt)
            if is_user_interrupt(error):
                raise
            report = self._fail(attempt.info, attempt.stage, error, stray, late=late, extra=self._extra(attempt))
        finally:
            _loading.stack.remove(attempt)
            if _loading.stack:
                _loading.stack[-1].nested += time.perf_counter() - attempt.started
        self._warn_if_slow(report, attempt)
        if report.status is LoadStatus.INCOMPATIBLE:
            self._skip_incompatible(report)
        return report

    def _extra(self, attempt: _Attempt, **more: Any) -> dict[str, Any]:
        """A report's ``extra``: ``more``, the load time so far, whether that is slow, and any hook problems."""
        seconds = attempt.seconds()
        threshold = self.settings.slow_plugin_seconds
        extra: dict[str, Any] = {**more, "load_seconds": seconds, "slow": threshold is not None and seconds > threshold}
        if attempt.problems:
            extra["problems"] = list(attempt.problems)
        return extra

    def _warn_if_slow(self, report: PluginReport, attempt: _Attempt) -> None:
        """Warn once when a plugin's load time crosses ``SHARDEXT_SLOW_PLUGIN_SECONDS`` (an earlier pass may have)."""
        threshold = self.settings.slow_plugin_seconds
        seconds = report.extra.get("load_seconds")
        if threshold is None or seconds is None or not report.extra.get("slow") or attempt.carried > threshold:
            return
        info = report.plugin
        warnings.warn(
            f"plugin {info.label} took {seconds:.1f} s to load (its import and hooks; "
            f"SHARDEXT_SLOW_PLUGIN_SECONDS={threshold:g}): the program waits that long on import physicsnemo_shardext "
            f"(or, for a deferred plugin, on the import it waits for). Skip it with SHARDEXT_DISABLE={info.name}, "
            "or move its heavy imports out of its module's top level (shardext_import_after)",
            ShardextWarning,
            stacklevel=_caller_outside_package(),
        )

    def _run_stages(self, attempt: _Attempt, obtain: Callable[[], Any] | None) -> PluginReport:
        info = attempt.info
        if obtain is not None:
            attempt.plugin = obtain()
            self._check_untouched(attempt)
        plugin = attempt.plugin
        attempt.stage = "register"
        attempt.was_registered = self.plugin_manager.is_registered(plugin)
        self.plugin_manager.register(plugin, name=info.name)
        self.plugin_manager.check_pending()
        attempt.stage = HOOK_CHECK_STAGE
        self._check_hooks(attempt)
        attempt.stage = "shardext_requirements"
        requirements = self._requirements(plugin)
        self._check_untouched(attempt)
        reason = incompatibility(requirements)
        if reason is not None:
            self._unregister(attempt)
            return self._report(
                PluginReport(info, LoadStatus.INCOMPATIBLE, reason, stage=attempt.stage, extra=self._extra(attempt))
            )
        attempt.stage = IMPORT_AFTER_STAGE
        modules = self._import_after(plugin)
        self._check_untouched(attempt)
        return self._declare_when_imported(attempt, modules)

    def _declare_when_imported(self, attempt: _Attempt, modules: Sequence[str]) -> PluginReport:
        """Declare and install now if every module is imported, else wait for the first missing one."""
        waiting = next((name for name in modules if name not in sys.modules), None)
        if waiting is None:
            return self._declare_and_install(attempt)
        info, plugin = attempt.info, attempt.plugin
        reason = f"loads once {waiting} is imported (shardext_import_after)"
        extra = self._extra(attempt)
        report = self._report(PluginReport(info, LoadStatus.DEFERRED, reason, stage=IMPORT_AFTER_STAGE, extra=extra))
        self._waiting[plugin_identity(info)] = report
        _deferrals.append((self, report, plugin, tuple(modules)))
        call_after_import(waiting, lambda: self._resume(report, plugin, modules))
        return report

    def _declare_and_install(self, attempt: _Attempt) -> PluginReport:
        info, plugin = attempt.info, attempt.plugin
        attempt.stage = "shardext_declare_patches"
        patches = PatchSet(plugin=info.name)
        self._hook_for(plugin, "shardext_declare_patches")(patches=patches)
        self._check_untouched(attempt)
        attempt.stage = "install"
        yielded = self.registry.add_plugin(info, list(patches))
        notes: dict[str, Any] = {}
        if patches.not_applicable:
            notes["not_applicable"] = list(patches.not_applicable)
        if yielded:
            notes["yielded_to_builtins"] = yielded
        extra = self._extra(attempt, **notes)
        return self._report(PluginReport(info, LoadStatus.LOADED, patches=len(patches) - len(yielded), extra=extra))

    def _resume(self, deferred: PluginReport, plugin: Any, modules: Sequence[str]) -> None:
        """A module a deferred plugin waits for was imported: run its remaining stages.

        Nothing happens when ``deferred`` is no longer the plugin's report (a sandbox
        that deferred it has exited, or a later ``load_plugins()`` took it over).
        """
        info = deferred.plugin
        if self._waiting.get(plugin_identity(info)) is deferred:
            del self._waiting[plugin_identity(info)]
        attempt = self._attempt(info, plugin)
        attempt.was_registered = False  # registered when it was deferred: a failure unregisters it
        attempt.carried = deferred.extra.get("load_seconds", 0.0)  # its import and first hooks
        attempt.problems = list(deferred.extra.get("problems", []))  # warned about when it was deferred
        if not self._is_current(deferred):
            self._unregister(attempt)
            return
        attempt.stage = IMPORT_AFTER_STAGE
        start = shard_registries.snapshot()
        try:
            self._guarded(attempt, lambda: self._declare_when_imported(attempt, modules), late=True)
        finally:
            # Imported while another plugin loads (it imported the module): what the framework
            # installed for this one is not that plugin's write, and its undo keeps it.
            installed = start.changes(shard_registries.snapshot())
            for outer in _loading.stack:
                outer.before = _with_changes(outer.before, installed)

    def _is_current(self, report: PluginReport) -> bool:
        """Whether ``report`` is still the registry's report for its plugin."""
        return any(each is report for each in self.registry.reports())

    def _check_hooks(self, attempt: _Attempt) -> None:
        """Find hooks that provide nothing (`hook_problems`): warn once, or raise `PluginHookError` in strict mode."""
        implemented = [caller.name for caller in self.plugin_manager.get_hookcallers(attempt.plugin) or ()]
        problems = hook_problems(attempt.plugin, implemented)
        if not problems:
            return
        if self.settings.strict:
            raise PluginHookError(problems)
        attempt.problems = problems
        info = attempt.info
        warnings.warn(
            f"plugin {info.label} provides nothing as written: {'; '.join(problems)}",
            ShardextWarning,
            stacklevel=_caller_outside_package(),
        )

    @staticmethod
    def _check_untouched(attempt: _Attempt) -> None:
        """Raise if the plugin wrote into ShardTensor's registries itself (rolled back by the caller)."""
        changes = _own_changes(attempt.before)
        if changes:
            raise undeclared_patch_error(changes)

    def _undo(self, attempt: _Attempt) -> list[str]:
        """Unregister, uninstall and restore the registries; returns the plugin's own writes undone."""
        self._unregister(attempt)
        if attempt.info.name not in attempt.held_before and attempt.info.name in {
            p.name for p in self.registry.plugins()
        }:
            self.registry.remove_plugin(attempt.info.name)  # interrupted or failed after the install
        stray = [] if attempt.stage == "install" else _own_changes(attempt.before)
        shard_registries.restore(attempt.before)  # late built-ins that arrived meanwhile are kept
        return [describe_change(change) for change in stray]

    def _unregister(self, attempt: _Attempt) -> None:
        if attempt.plugin is _NOT_IMPORTED or attempt.was_registered:
            return
        # Best effort: the plugin manager is private to this loader, and comparing a
        # plugin object may run its own (possibly broken) __eq__.
        with contextlib.suppress(Exception):
            if self.plugin_manager.is_registered(attempt.plugin):
                self.plugin_manager.unregister(attempt.plugin)

    def _skip_incompatible(self, report: PluginReport) -> None:
        info = report.plugin
        if self.settings.strict:
            cause = IncompatiblePluginError(report.reason)
            raise PluginLoadError(info.name, info.distribution, info.version, report.stage, cause)
        warnings.warn(f"skipping plugin {info.label}: it {report.reason}", ShardextWarning, stacklevel=4)

    # -- internals -------------------------------------------------------------------------
    def _hook_for(self, plugin: Any, hook_name: str) -> Any:
        """A hook caller that reaches only ``plugin``'s implementation."""
        others = [p for p in self.plugin_manager.get_plugins() if p is not plugin]
        return self.plugin_manager.subset_hook_caller(hook_name, remove_plugins=others)

    def _import_after(self, plugin: Any) -> list[str]:
        modules: list[str] = []
        for result in self._hook_for(plugin, "shardext_import_after")():
            if isinstance(result, str) or not isinstance(result, Iterable):
                raise ValueError(f"shardext_import_after must return a list of module names, got {result!r}")
            names = list(result)
            if not all(isinstance(name, str) and name for name in names):
                raise ValueError(f"shardext_import_after must return module names (strings), got {names!r}")
            modules += names
        return modules

    def _requirements(self, plugin: Any) -> Mapping[str, str]:
        merged: dict[str, str] = {}
        for result in self._hook_for(plugin, "shardext_requirements")():
            if not isinstance(result, Mapping):
                raise ValueError(f"shardext_requirements must return a mapping, got {type(result).__name__}")
            merged.update(result)
        return merged

    def _blocked_reason(self, info: PluginInfo) -> str | None:
        denied = [s for s in self.settings.deny if info.matches(s)]
        if denied:
            return f"denied by SHARDEXT_DISABLE ({', '.join(denied)})"
        if self.settings.allow is not None and not any(info.matches(s) for s in self.settings.allow):
            return "not in SHARDEXT_ONLY"
        return None

    def _report(self, report: PluginReport) -> PluginReport:
        self.registry.record_report(report)
        return report

    def _fail(
        self,
        info: PluginInfo,
        stage: str,
        error: BaseException,
        stray: Sequence[str] = (),
        *,
        late: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> PluginReport:
        """Record a failure; warn, or raise `PluginLoadError` in strict mode (never ``late``: in an import hook)."""
        detail = ""
        if stray and not isinstance(error, UndeclaredPatchError):
            detail = f"its writes into ShardTensor's registries outside the hooks were rolled back ({'; '.join(stray)})"
        failure = PluginLoadError(info.name, info.distribution, info.version, stage, error, detail=detail)
        report = self._report(PluginReport(info, LoadStatus.FAILED, str(failure), stage=stage, extra=extra or {}))
        if self.settings.strict and not late:
            if isinstance(error, PatchConflictError):
                # An unresolved tie is not the plugin's fault alone: raise what the docs promise.
                raise error
            raise failure from error
        when = " (it was deferred until a module's import)" if late else ""
        warnings.warn(f"{failure}; its patches were not installed{when}", ShardextWarning, stacklevel=4)
        return report


def resume_ready(registry: PatchRegistry) -> list[PluginReport]:
    """Load the plugins of ``registry`` still ``deferred`` although their modules are imported now.

    That happens when one loaded inside a ``sandbox()`` that has exited since (the
    import that triggered it will not happen again). Returns their new reports.

    Examples:
        >>> from physicsnemo_shardext.engine.registry import PatchRegistry
        >>> resume_ready(PatchRegistry())
        []
    """
    resumed = []
    for loader, report, plugin, modules in list(_deferrals):
        if loader.registry is not registry or not loader._is_current(report):
            continue
        if all(name in sys.modules for name in modules):
            _deferrals.remove((loader, report, plugin, modules))
            loader._resume(report, plugin, modules)
            resumed += [r for r in registry.reports() if r.plugin == report.plugin]
    return resumed


class _Loading(threading.local):
    """The plugin loads in progress on this thread, outermost first (a deferred load may nest in another)."""

    def __init__(self) -> None:
        self.stack: list[_Attempt] = []


_loading = _Loading()


def _with_changes(snap: RegistrySnapshot, changes: Sequence[RegistryChange]) -> RegistrySnapshot:
    """``snap`` with ``changes`` applied on top (a table rebinding is left as it was)."""
    tables = snap.as_dicts()
    for change in changes:
        if change.key is None:
            continue
        table = tables.setdefault(change.table, {})
        if change.after is None:
            table.pop(change.key, None)
        else:
            table[change.key] = change.after
    return RegistrySnapshot(
        tables=tuple((name, tuple(items.items())) for name, items in tables.items()), rebound=snap.rebound
    )


def _own_changes(before: RegistrySnapshot) -> list[RegistryChange]:
    """What changed in ShardTensor's registries since ``before``, minus built-ins that arrived late."""
    return [change for change in before.changes(shard_registries.snapshot()) if not is_late_builtin(change)]
