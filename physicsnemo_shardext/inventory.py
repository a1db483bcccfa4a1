"""A flat, serialisable inventory of ShardTensor's handlers and the plugins behind them.

This is the data behind ``shardext list`` and ``shardext doctor``; it reads
the live registries, so handlers registered by hand outside the framework
show up too (as ``external``).

Example:
    >>> import physicsnemo_shardext
    >>> rows = handler_rows(physicsnemo_shardext.get_registry())
    >>> {row["provider"] for row in rows} >= {"physicsnemo"}
    True
"""

from __future__ import annotations

import platform
from typing import Any

import pluggy
import torch
import torch.distributed as dist

from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.builtins import handler_origin
from physicsnemo_shardext.compat import installed_version
from physicsnemo_shardext.provenance import LoadStatus
from physicsnemo_shardext.registry import PatchRegistry
from physicsnemo_shardext.settings import Settings
from physicsnemo_shardext.targets import describe_handler, describe_target

__all__ = ["doctor_report", "handler_rows", "plugin_rows"]


def handler_rows(registry: PatchRegistry) -> list[dict[str, Any]]:
    """One row per handler ShardTensor would consult, with its provenance."""
    installed = {(p.declaration.level, p.declaration.target): p for p in registry.installed()}
    physicsnemo_version = installed_version("nvidia-physicsnemo") or "?"
    rows = []
    for level, target, handler in shard_registries.iter_handlers():
        patch = installed.get((level, target))
        if patch is not None:
            row = {
                "provider": patch.plugin.name,
                "distribution": f"{patch.plugin.distribution}=={patch.plugin.version or '?'}",
                "priority": patch.declaration.priority,
                "overrides_builtin": patch.overrides_builtin,
                "shadowed": list(patch.shadowed),
                "replaced": describe_handler(patch.replaced) if patch.replaced is not None else None,
                "description": patch.declaration.description,
                "handler": describe_handler(patch.declaration.handler),
            }
        else:
            origin = handler_origin(handler)
            row = {
                "provider": origin if origin == "physicsnemo" else "external",
                "distribution": f"nvidia-physicsnemo=={physicsnemo_version}" if origin == "physicsnemo" else origin,
                "priority": None,
                "overrides_builtin": False,
                "shadowed": [],
                "replaced": None,
                "description": "",
                "handler": describe_handler(handler),
            }
        rows.append({"target": describe_target(target), "level": level.value, **row})
    rows.sort(key=lambda r: (r["level"], r["target"]))
    return rows


def plugin_rows(registry: PatchRegistry) -> list[dict[str, Any]]:
    """One row per plugin the loader saw: loaded, failed, blocked or incompatible."""
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
        }
        for report in registry.reports()
    ]


def doctor_report(registry: PatchRegistry) -> dict[str, Any]:
    """Environment, plugin health and conflict resolution, as a JSON-ready dict."""
    reports = registry.reports()

    def names(status: LoadStatus) -> list[str]:
        return [r.plugin.name for r in reports if r.status is status]

    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nvidia-physicsnemo": installed_version("nvidia-physicsnemo"),
            "pluggy": pluggy.__version__ if hasattr(pluggy, "__version__") else installed_version("pluggy"),
            "physicsnemo-shardext": installed_version("physicsnemo-shardext"),
        },
        "backends": {
            "cuda": torch.cuda.is_available(),
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "distributed": dist.is_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
        },
        "settings": Settings.from_env().__dict__,
        "plugins": {
            "loaded": names(LoadStatus.LOADED),
            "failed": names(LoadStatus.FAILED),
            "blocked": names(LoadStatus.BLOCKED),
            "incompatible": names(LoadStatus.INCOMPATIBLE),
        },
        "plugin_details": plugin_rows(registry),
        "conflicts": [
            {
                "target": c.target,
                "level": c.level,
                "priority": c.priority,
                "providers": list(c.providers),
                "winner": c.winner,
                "resolved_by": c.resolved_by,
            }
            for c in registry.conflicts()
        ],
        "handlers": {
            "total": sum(1 for _ in shard_registries.iter_handlers()),
            "from_plugins": len(registry.installed()),
            "overriding_builtins": sum(1 for p in registry.installed() if p.overrides_builtin),
        },
    }
