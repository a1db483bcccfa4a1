"""The ``shardext`` command: see what is installed in ShardTensor and why.

Usage::

    shardext list [--json] [--plugin NAME]   # every handler with its provenance
    shardext doctor [--json]                 # versions, backends, plugin health, conflicts
    python -m physicsnemo_shardext list      # same, without the console script

Example:
    >>> main(["list", "--json"]) == 0  # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["main"]


def _table(rows: list[dict[str, Any]], columns: Sequence[str], out: TextIO) -> None:
    if not rows:
        out.write("(none)\n")
        return
    cells = [[("" if row[c] is None else str(row[c])) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    out.write("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")


def _command_list(args: argparse.Namespace, out: TextIO) -> int:
    import physicsnemo_shardext
    from physicsnemo_shardext.inventory import handler_rows, plugin_rows

    registry = physicsnemo_shardext.get_registry()
    handlers = handler_rows(registry)
    plugins = plugin_rows(registry)
    if args.plugin:
        handlers = [h for h in handlers if h["provider"] == args.plugin]
        plugins = [p for p in plugins if p["plugin"] == args.plugin]
    if args.json:
        out.write(json.dumps({"handlers": handlers, "plugins": plugins}, indent=2) + "\n")
        return 0
    for row in handlers:
        row["overrides"] = "yes" if row["overrides_builtin"] else ""
    _table(handlers, ["target", "level", "handler", "provider", "distribution", "priority", "overrides"], out)
    problems = [p for p in plugins if p["status"] != "loaded"]
    if problems:
        out.write("\nPlugins not installed:\n")
        _table(problems, ["plugin", "distribution", "version", "status", "reason"], out)
    return 0


def _command_doctor(args: argparse.Namespace, out: TextIO) -> int:
    import physicsnemo_shardext
    from physicsnemo_shardext.inventory import doctor_report

    report = doctor_report(physicsnemo_shardext.get_registry())
    if args.json:
        out.write(json.dumps(report, indent=2, default=str) + "\n")
        return 0
    out.write("Versions\n")
    for name, version in report["versions"].items():
        out.write(f"  {name:22} {version}\n")
    out.write("Backends\n")
    for name, available in report["backends"].items():
        out.write(f"  {name:22} {available}\n")
    out.write("Plugins\n")
    for status, names in report["plugins"].items():
        out.write(f"  {status:22} {len(names)}  {', '.join(names)}\n")
    for detail in report["plugin_details"]:
        if detail["status"] != "loaded":
            out.write(f"    {detail['plugin']} ({detail['distribution']}=={detail['version']}): {detail['reason']}\n")
        for skipped in detail["not_applicable"]:
            out.write(f"    {detail['plugin']}: not needed here, not installed: {skipped}\n")
    out.write("Conflicts\n")
    if not report["conflicts"]:
        out.write("  none\n")
    for conflict in report["conflicts"]:
        how = (
            f"resolved: {conflict['winner']} wins by {conflict['resolved_by']}"
            if conflict["winner"]
            else "UNRESOLVED: neither handler installed (set SHARDEXT_PREFER or priorities)"
        )
        out.write(
            f"  {conflict['level']} {conflict['target']} (priority {conflict['priority']}): "
            f"{', '.join(conflict['providers'])} -> {how}\n"
        )
    handlers = report["handlers"]
    out.write(
        f"Handlers\n  {handlers['total']} in ShardTensor, {handlers['from_plugins']} from plugins, "
        f"{handlers['overriding_builtins']} overriding PhysicsNeMo built-ins\n"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``shardext`` (documented in the CLI reference page)."""
    parser = argparse.ArgumentParser(prog="shardext", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="every handler in ShardTensor's registries, with provenance")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.add_argument("--plugin", help="only this plugin's handlers and report")
    listing.set_defaults(run=_command_list)
    doctor = commands.add_parser("doctor", help="versions, backends, plugin health and conflicts")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(run=_command_doctor)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of the ``shardext`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.run(args, out or sys.stdout)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
