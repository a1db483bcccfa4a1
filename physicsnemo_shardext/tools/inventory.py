"""A flat, serialisable inventory of ShardTensor's handlers and the plugins behind them.

This is the data behind ``shardext list`` and ``shardext doctor``. It reads the
live registries the way ShardTensor does when it dispatches, so each row shows
the handler ShardTensor actually calls, next to what provenance recorded for
that slot (the plugin's declared handler, else PhysicsNeMo's built-in), and
flags the slot as ``drift`` when the two differ: something wrote into
ShardTensor's registries outside the framework (by hand, or a plugin bypassing
its hooks). The JSON layout is versioned by `SCHEMA_VERSION`.

Examples:
    >>> import physicsnemo_shardext
    >>> rows = handler_rows(physicsnemo_shardext.get_registry())
    >>> {row["provider"] for row in rows} >= {"physicsnemo"}
    True
    >>> gelu = next(r for r in rows if r["target"] == "torch.nn.functional.gelu")
    >>> gelu["handler"] == gelu["recorded_handler"], gelu["status"]
    (True, 'ok')
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.engine.baseline import baseline, handler_origin
from physicsnemo_shardext.engine.provenance import InstalledPatch, LoadStatus, PluginInfo
from physicsnemo_shardext.engine.registry import PatchRegistry, plugin_index, plugin_of
from physicsnemo_shardext.engine.requirements import installed_version
from physicsnemo_shardext.engine.trace import untraced
from physicsnemo_shardext.settings import Settings
from physicsnemo_shardext.shard_registries import PatchLevel
from physicsnemo_shardext.targets import describe_handler, describe_target
from physicsnemo_shardext.torch_support import support_report

__all__ = [
    "SCHEMA_VERSION",
    "LiveSlot",
    "Runner",
    "called_handler",
    "doctor_report",
    "handler_rows",
    "live_slots",
    "plugin_index",
    "plugin_of",
    "plugin_rows",
]

#: Version of the JSON written by ``shardext list --json`` / ``doctor --json``.
#: 1: unversioned ``{"handlers", "plugins"}``; 2: adds ``schema_version``, ``errors``, and per
#: row ``recorded_handler``, ``live_provider``, ``table``, ``status``, ``drift``, ``drift_reason``;
#: 3: adds per row ``claimants`` and the ``status`` value ``unresolved``, and a row for every slot
#: that plugins tie on at equal priority with nothing resolving it (even when ShardTensor has no
#: handler there: then ``handler`` is ``null`` and ``provider`` is ``null``); within 3, the plugin
#: ``status`` value ``deferred`` was added (a plugin waiting for a module, named in ``reason``), and then
#: per plugin row ``problems`` (hooks that provide nothing), ``load_seconds`` and ``slow``.
SCHEMA_VERSION = 3

T = TypeVar("T")

Runner = Callable[[str, Callable[[], Any], Any], Any]
"""``run(stage, thunk, default)``: how each piece of the inventory is computed.

The default calls ``thunk()``; ``shardext`` passes one that contains and reports
what a plugin's object raises while being inspected, and returns ``default``.
"""

_TABLE_OF_LEVEL = {
    PatchLevel.FUNCTION: "_function_registry",
    PatchLevel.NAMED: "_named_function_registry",
    PatchLevel.DISPATCH: "_dispatch_registry",
}
_BY_NAME = "_dispatch_registry_by_name"


def _direct(stage: str, thunk: Callable[[], T], default: T) -> T:
    return thunk()


@dataclass(frozen=True)
class LiveSlot:
    """A slot ShardTensor consults: its key and what it holds, read where ShardTensor reads it."""

    level: PatchLevel
    target: Any
    handler: Any
    table: str


def _live_table(name: str) -> dict[Any, Any]:
    """One of ShardTensor's registries as it is now (a rebound or deleted one reads as what it holds)."""
    table = getattr(ShardTensor, name, None)
    return table if isinstance(table, dict) else {}


def called_handler(level: PatchLevel, target: Any) -> tuple[Any, str | None]:
    """``(handler, table)`` ShardTensor would call for a slot now, mirroring its own lookup.

    Dispatch consults ``_dispatch_registry`` first, then ``_dispatch_registry_by_name``.

    Examples:
        >>> import torch.nn.functional as F
        >>> called_handler(PatchLevel.FUNCTION, F.interpolate)[1]
        '_function_registry'
    """
    level = PatchLevel(level)
    if level is PatchLevel.ATTRIBUTE:
        return target.own_value(), "attribute"
    main = _live_table(_TABLE_OF_LEVEL[level])
    if target in main:
        return main[target], _TABLE_OF_LEVEL[level]
    if level is PatchLevel.DISPATCH and str(target) in _live_table(_BY_NAME):
        return _live_table(_BY_NAME)[str(target)], _BY_NAME
    return None, None


def live_slots() -> list[LiveSlot]:
    """Every slot ShardTensor can dispatch to now, including by-name-only dispatch entries."""
    slots = [
        LiveSlot(level, target, handler, name)
        for level, name in _TABLE_OF_LEVEL.items()
        for target, handler in list(_live_table(name).items())
    ]
    reachable = {str(target) for target in _live_table(_TABLE_OF_LEVEL[PatchLevel.DISPATCH])}
    slots += [
        LiveSlot(PatchLevel.DISPATCH, name, handler, _BY_NAME)
        for name, handler in list(_live_table(_BY_NAME).items())
        if name not in reachable  # otherwise ShardTensor never reads it
    ]
    slots += [
        LiveSlot(PatchLevel.ATTRIBUTE, target, value, "attribute")
        for level, target, value in shard_registries.iter_handlers()
        if level is PatchLevel.ATTRIBUTE
    ]
    return slots


def _live_provider(handler: Any, index: dict[int, PluginInfo]) -> str | None:
    """Who provides a live handler: a plugin name, ``"physicsnemo"`` or ``"external"``."""
    if handler is None:
        return None
    plugin = index.get(id(untraced(handler)))
    if plugin is not None:
        return plugin.name
    return "physicsnemo" if handler_origin(untraced(handler)) == "physicsnemo" else "external"


def _baseline_handler(slot: LiveSlot, tables: dict[str, dict[Any, Any]]) -> Any:
    """What the slot held with PhysicsNeMo's built-ins and before any plugin (``None``: nothing).

    ``tables`` is ``baseline().as_dicts()``, read once per listing.
    """
    if slot.level is PatchLevel.ATTRIBUTE:
        return shard_registries.original_attribute(slot.target)
    return tables.get(slot.table, {}).get(slot.target)


def _describe(handler: Any) -> str | None:
    return None if handler is None else describe_handler(untraced(handler))


def _plugin_fields(patch: InstalledPatch) -> dict[str, Any]:
    return {
        "provider": patch.plugin.name,
        "distribution": f"{patch.plugin.distribution}=={patch.plugin.version or '?'}",
        "priority": patch.declaration.priority,
        "overrides_builtin": patch.overrides_builtin,
        "shadowed": list(patch.shadowed),
        "replaced": describe_handler(patch.replaced) if patch.replaced is not None else None,
        "description": patch.declaration.description,
    }


def _unrecorded_fields(handler: Any) -> dict[str, Any]:
    origin = handler_origin(untraced(handler)) if handler is not None else "unknown"
    physicsnemo_version = installed_version("nvidia-physicsnemo") or "?"
    return {
        "provider": origin if origin == "physicsnemo" else "external",
        "distribution": f"nvidia-physicsnemo=={physicsnemo_version}" if origin == "physicsnemo" else origin,
        "priority": None,
        "overrides_builtin": False,
        "shadowed": [],
        "replaced": None,
        "description": "",
    }


def _drift_reason(slot: LiveSlot, recorded: Any, patch: InstalledPatch | None) -> str:
    """Why ``slot`` is flagged (the live and recorded handlers are in their own fields)."""
    if patch is not None:
        if slot.handler is None:
            return f"removed from ShardTensor's registry outside the framework; provenance records plugin {patch.plugin.label}"
        return (
            "written into ShardTensor's registry outside the framework after the plugin was installed (by hand, "
            f"or a plugin bypassing its hooks); provenance records plugin {patch.plugin.label}"
        )
    if recorded is not None:
        return "PhysicsNeMo built-in replaced outside the framework"
    return "registered outside the framework: no provenance (no plugin declared it, and PhysicsNeMo has no built-in for it)"


def _slot_row(
    slot: LiveSlot, patch: InstalledPatch | None, index: dict[int, PluginInfo], tables: dict[str, dict[Any, Any]]
) -> dict[str, Any]:
    """One row: the live handler, what provenance recorded, and whether they differ."""
    recorded = patch.declaration.handler if patch is not None else _baseline_handler(slot, tables)
    drift = untraced(slot.handler) is not recorded
    live_provider = _live_provider(slot.handler, index)
    fields = _plugin_fields(patch) if patch is not None else _unrecorded_fields(slot.handler)
    return {
        "target": describe_target(slot.target),
        "level": slot.level.value,
        **fields,
        "handler": _describe(slot.handler),
        "recorded_handler": _describe(recorded),
        "live_provider": live_provider,
        "table": slot.table if slot.handler is not None else None,
        "status": "drift" if drift else "ok",
        "drift": drift,
        "drift_reason": _drift_reason(slot, recorded, patch) if drift else None,
        "claimants": [],
    }


def _mark_unresolved(rows: list[dict[str, Any]], conflicts: list[Any]) -> None:
    """Flag each slot plugins tie on (``winner`` is ``None``) with its claimants; add a row if none shows it.

    Neither claimant's handler is installed there, so ShardTensor calls what it had
    before (PhysicsNeMo's built-in, or nothing: the slow fallback).
    """
    by_slot = {(row["target"], row["level"]): row for row in rows}
    for conflict in conflicts:
        if conflict.winner is not None:
            continue
        row = by_slot.get((conflict.target, conflict.level))
        if row is None:
            row = {
                "target": conflict.target,
                "level": conflict.level,
                "provider": None,
                "distribution": None,
                "priority": conflict.priority,
                "overrides_builtin": False,
                "shadowed": [],
                "replaced": None,
                "description": "",
                "handler": None,
                "recorded_handler": None,
                "live_provider": None,
                "table": None,
                "drift": False,
                "drift_reason": None,
            }
            rows.append(row)
        row["status"] = "unresolved" if not row["drift"] else row["status"]
        row["claimants"] = list(conflict.providers)
        row["priority"] = conflict.priority if row["provider"] is None else row["priority"]


def _recorded_but_missing(registry: PatchRegistry, seen: set[tuple[PatchLevel, Any]]) -> list[LiveSlot]:
    """Plugin slots whose handler ShardTensor no longer has at all."""
    missing = []
    for patch in registry.installed():
        level, target = patch.declaration.key
        if (level, target) in seen:
            continue
        handler, table = called_handler(level, target)
        missing.append(LiveSlot(level, target, handler, table or _TABLE_OF_LEVEL.get(level, "attribute")))
    return missing


def _slot_stage(slot: LiveSlot) -> str:
    """The step name for a slot in error messages (a target's own repr may raise: it is a plugin's object)."""
    try:
        name = describe_target(slot.target)
    except Exception:
        name = f"<{type(slot.target).__name__}>"
    return f"inspecting {slot.level.value} slot {name[:80]}"


def handler_rows(registry: PatchRegistry, run: Runner = _direct) -> list[dict[str, Any]]:
    """One row per slot ShardTensor would consult (and per recorded slot it lost), with provenance.

    ``handler`` is what ShardTensor calls; ``recorded_handler`` what provenance
    recorded; ``drift`` is true when they differ (see ``drift_reason``).
    """
    installed = {p.declaration.key: p for p in run("read provenance", registry.installed, [])}
    slots = run("read ShardTensor's registries", live_slots, [])
    seen = {(s.level, s.target) for s in slots}
    slots += run("read provenance", lambda: _recorded_but_missing(registry, seen), [])
    tables = run("read the built-in baseline", lambda: baseline().as_dicts(), {})
    index = run("read provenance", lambda: plugin_index(registry), {})
    rows = []
    for slot in slots:
        patch = installed.get((slot.level, slot.target))
        row = run(_slot_stage(slot), lambda: _slot_row(slot, patch, index, tables), None)
        if row is not None:
            rows.append(row)
    run("read conflicts", lambda: _mark_unresolved(rows, registry.conflicts()), None)
    rows.sort(key=lambda r: (r["level"], r["target"]))
    return rows


def _load_seconds(extra: dict[str, Any]) -> float | None:
    seconds = extra.get("load_seconds")
    return None if seconds is None else round(float(seconds), 4)


def plugin_rows(registry: PatchRegistry) -> list[dict[str, Any]]:
    """One row per plugin the loader saw: loaded, failed, blocked, incompatible or deferred.

    A ``deferred`` row's ``reason`` names the module the plugin waits for. Plugin
    health: ``problems`` says why a plugin's hooks provide nothing as written (a
    hook-named function without ``@hookimpl``, no hook at all, no
    ``shardext_declare_patches``); ``load_seconds`` is how long its import and hooks
    took (``None``: never imported, e.g. blocked) and ``slow`` whether that exceeded
    ``SHARDEXT_SLOW_PLUGIN_SECONDS``.

    Examples:
        >>> import physicsnemo_shardext
        >>> row = next(r for r in plugin_rows(physicsnemo_shardext.get_registry()) if r["plugin"] == "pointwise")
        >>> row["status"], row["problems"], row["load_seconds"] >= 0, row["slow"]
        ('loaded', [], True, False)
    """
    return [
        {
            "plugin": report.plugin.name,
            "distribution": report.plugin.distribution,
            "version": report.plugin.version,
            "status": report.status.value,
            "patches": report.patches,
            "stage": report.stage,
            "reason": report.reason,
            # Attribute replacements whose applies() check found nothing to fix here.
            "not_applicable": [f"{target}: {why}" for target, why in report.extra.get("not_applicable", [])],
            # First-party declarations a newer PhysicsNeMo built-in now covers (upstream drift).
            "yielded_to_builtins": [f"{target}: {why}" for target, why in report.extra.get("yielded_to_builtins", [])],
            "problems": list(report.extra.get("problems", [])),
            "load_seconds": _load_seconds(report.extra),
            "slow": bool(report.extra.get("slow", False)),
        }
        for report in registry.reports()
    ]


def _versions() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nvidia-physicsnemo": installed_version("nvidia-physicsnemo"),
        "pluggy": pluggy.__version__ if hasattr(pluggy, "__version__") else installed_version("pluggy"),
        "physicsnemo-shardext": installed_version("physicsnemo-shardext"),
    }


def _backends() -> dict[str, Any]:
    return {
        "cuda": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "distributed": dist.is_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
    }


def _plugins_by_status(registry: PatchRegistry) -> dict[str, list[str]]:
    reports = registry.reports()
    return {status.value: [r.plugin.name for r in reports if r.status is status] for status in LoadStatus}


def _conflicts(registry: PatchRegistry) -> list[dict[str, Any]]:
    return [
        {
            "target": c.target,
            "level": c.level,
            "priority": c.priority,
            "providers": list(c.providers),
            "winner": c.winner,
            "resolved_by": c.resolved_by,
        }
        for c in registry.conflicts()
    ]


def _handler_counts(registry: PatchRegistry, rows: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "total": sum(1 for _ in shard_registries.iter_handlers()),
        "from_plugins": len(registry.installed()),
        "overriding_builtins": sum(1 for p in registry.installed() if p.overrides_builtin),
        "drifted": sum(1 for row in rows if row["drift"]),
    }


def _drift_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("target", "level", "handler", "recorded_handler", "provider", "drift_reason")
    return [{key: row[key] for key in keys} for row in rows if row["drift"]]


def doctor_report(registry: PatchRegistry, run: Runner = _direct) -> dict[str, Any]:
    """Environment, plugin health, conflicts and registry drift, as a JSON-ready dict."""
    rows = handler_rows(registry, run)
    return {
        "schema_version": SCHEMA_VERSION,
        "versions": run("doctor: versions", _versions, {}),
        "torch_support": run("doctor: torch support", support_report, {}),
        "backends": run("doctor: backends", _backends, {}),
        "settings": run("doctor: settings", lambda: Settings.from_env().__dict__, {}),
        "plugins": run("doctor: plugins", lambda: _plugins_by_status(registry), {s.value: [] for s in LoadStatus}),
        "plugin_details": run("doctor: plugin reports", lambda: plugin_rows(registry), []),
        "conflicts": run("doctor: conflicts", lambda: _conflicts(registry), []),
        "handlers": run(
            "doctor: handler counts",
            lambda: _handler_counts(registry, rows),
            {"total": len(rows), "from_plugins": 0, "overriding_builtins": 0, "drifted": 0},
        ),
        "drift": _drift_summary(rows),
    }
