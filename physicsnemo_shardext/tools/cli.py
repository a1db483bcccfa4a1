"""The ``shardext`` command: see what is installed in ShardTensor and why, and start new plugins.

Usage:

```python
shardext list [--json] [--plugin NAME]   # every handler with its provenance
shardext doctor [--json]                 # versions, backends, plugin health, conflicts
shardext new NAME [--dir DIR]            # write a plugin distribution to start a patch from
shardext schema list|doctor|verify       # the JSON Schema of a --json output (no torch import)
shardext verify MODULE:FACTORY --input 1x3x64x64 --shard 2 --ranks 2   # a model sharded vs single-process
python -m physicsnemo_shardext list      # same, without the console script
```

Neither command dies because of a plugin: whatever a plugin raises while it is
loaded or inspected (``SystemExit`` included; only a real Ctrl-C, exactly
``KeyboardInterrupt``, still interrupts) is shown in the report, which is always
printed. While plugins load, their output goes to stderr, so ``--json`` stays
valid JSON.

``shardext new``, ``shardext schema`` and ``--help`` need neither torch nor PhysicsNeMo:
this module imports only the standard library, and the console script
(``physicsnemo_shardext_cli``) answers them without running the package's front door.

Examples:
    >>> import io, json
    >>> out = io.StringIO()
    >>> main(["list", "--json", "--plugin", "pointwise"], out=out)
    0
    >>> data = json.loads(out.getvalue())
    >>> data["schema_version"], data["errors"], any(row["drift"] for row in data["handlers"])
    (3, [], False)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO, TypeVar

__all__ = [
    "JSON_SCHEMA_VERSION",
    "TORCH_FREE_COMMANDS",
    "answers_without_torch",
    "autoload_for_cli",
    "build_parser",
    "contained",
    "main",
    "plugin_health",
    "plugin_output_to_stderr",
]

#: Version of the ``--json`` layout. 2 added ``schema_version``, ``errors``, and per handler
#: row ``recorded_handler``, ``drift`` and ``drift_reason`` (``handler`` is now the live one).
#: 3 added per handler row ``claimants``, the ``status`` value ``unresolved``, and a row for
#: every slot plugins tie on unresolved; ``doctor``'s ``conflicts`` are unchanged. Within 3, the
#: plugin ``status`` value ``deferred`` was added (the awaited module is named in ``reason``), and then
#: per plugin row ``problems``, ``load_seconds`` and ``slow`` (plugin health).
#: Equal to ``inventory.SCHEMA_VERSION`` (not imported: this module must import without torch).
JSON_SCHEMA_VERSION = 3

T = TypeVar("T")

#: Subcommands that import neither torch nor PhysicsNeMo (nor load plugins).
TORCH_FREE_COMMANDS = frozenset({"new", "schema"})

# Errors of a plugin load that ran before main() (the package loads plugins when imported).
_EARLY_ERRORS: list[str] = []


def _swap_stdout_fd() -> int | None:
    """Point file descriptor 1 at stderr; returns a copy of the old one (``None``: not possible)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):  # no real fd 1 (embedded interpreter, closed stream)
        return None
    return saved


def _restore_stdout_fd(saved: int | None) -> None:
    if saved is None:
        return
    # A plugin may have written to sys.__stdout__ directly: flush it while fd 1 is still stderr.
    with contextlib.suppress(Exception):
        sys.__stdout__.flush()
    os.dup2(saved, 1)
    os.close(saved)


@contextlib.contextmanager
def plugin_output_to_stderr() -> Iterator[None]:
    """Send everything written to stdout inside the block to stderr, ``print`` and fd 1 alike.

    The fd-level swap also catches ``os.write(1, ...)`` and extension modules.

    Examples:
        >>> with plugin_output_to_stderr():
        ...     print("from a plugin")  # goes to stderr
    """
    saved = _swap_stdout_fd()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _restore_stdout_fd(saved)


def contained(step: str, errors: list[str], action: Callable[[], T], default: T) -> T:
    """Run ``action``; on any exception but a real Ctrl-C, note it in ``errors`` and return ``default``.

    Examples:
        >>> errors = []
        >>> contained("loading plugins", errors, lambda: sys.exit(3), default=None), errors
        (None, ['loading plugins: SystemExit: 3'])
    """
    try:
        return action()
    except BaseException as error:  # SystemExit, GeneratorExit, KeyboardInterrupt subclasses ...
        # errors.is_user_interrupt's rule, inlined: this module must import without torch.
        if type(error) is KeyboardInterrupt:
            raise
        errors.append(f"{step}: {type(error).__name__}: {error}")
        return default


def answers_without_torch(args: Sequence[str]) -> bool:
    """Whether ``shardext ARGS`` needs neither torch nor plugins: help, usage errors, `TORCH_FREE_COMMANDS`.

    Examples:
        >>> answers_without_torch(["new", "my-op"]), answers_without_torch(["--help"]), answers_without_torch([])
        (True, True, True)
        >>> answers_without_torch(["list", "--json"]), answers_without_torch(["list", "-h"])
        (False, True)
    """
    if not args or "-h" in args or "--help" in args:
        return True
    command = next((arg for arg in args if not arg.startswith("-")), None)
    return command is None or command in TORCH_FREE_COMMANDS


def autoload_for_cli(load: Callable[[], Any]) -> None:
    """Run the package's import-time plugin load the way the CLI needs it.

    Plugins' output goes to stderr (``--json`` stays valid) and anything they raise,
    strict-mode errors included, is kept for the report instead of ending the command.

    Examples:
        >>> autoload_for_cli(lambda: print("plugin chatter"))  # printed on stderr
    """
    with plugin_output_to_stderr():
        contained("loading plugins", _EARLY_ERRORS, load, None)


def _registry(errors: list[str]) -> Any:
    """Import the package (which loads plugins, unless already done) and return its registry."""

    def load() -> Any:
        import physicsnemo_shardext

        return physicsnemo_shardext.get_registry()

    errors.extend(_EARLY_ERRORS)
    with plugin_output_to_stderr():
        return contained("loading plugins", errors, load, None)


def _inspect(step: str, errors: list[str], action: Callable[[], T], default: T) -> T:
    """Read the inventory with plugin output kept off stdout (describing a handler may run plugin code)."""
    with plugin_output_to_stderr():
        return contained(step, errors, action, default)


def _table(
    rows: list[dict[str, Any]], columns: Sequence[str], out: TextIO, titles: dict[str, str] | None = None
) -> None:
    if not rows:
        out.write("(none)\n")
        return
    titles = {c: (titles or {}).get(c, c) for c in columns}
    cells = [[("" if row[c] is None else str(row[c])) for c in columns] for row in rows]
    widths = [max(len(titles[c]), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    out.write("  ".join(titles[c].upper().ljust(w) for c, w in zip(columns, widths)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n")


def _write_errors(errors: Sequence[str], out: TextIO) -> None:
    if errors:
        out.write("\nErrors while loading or inspecting plugins (the report above may be incomplete):\n")
        out.writelines(f"  {error}\n" for error in errors)


def _recorded_cell(row: dict[str, Any]) -> str:
    """The RECORDED column: ``same``, or what provenance recorded for a drifted slot."""
    if not row["drift"]:
        return "same"
    return f"DRIFT (recorded: {row['recorded_handler'] or 'nothing'})"


def _provider_cell(row: dict[str, Any]) -> str | None:
    """The PROVIDER column: the provider, or ``UNRESOLVED`` for a tie with nothing installed by a plugin."""
    if row.get("claimants") and row["provider"] is None:
        return "UNRESOLVED"
    return row["provider"]


def _write_listing(handlers: list[dict[str, Any]], plugins: list[dict[str, Any]], out: TextIO) -> None:
    for row in handlers:
        row["overrides"] = "yes" if row["overrides_builtin"] else ""
        row["recorded"] = _recorded_cell(row)
        row["provider_cell"] = _provider_cell(row)
        if row.get("claimants"):
            row["recorded"] += f"; UNRESOLVED tie: {', '.join(row['claimants'])}"
    columns = ["target", "level", "handler", "provider_cell", "distribution", "priority", "overrides", "recorded"]
    _table(handlers, columns, out, {"provider_cell": "provider"})
    unresolved = [row for row in handlers if row.get("claimants")]
    for row in unresolved:
        row["claimants_cell"] = ", ".join(row["claimants"])
        row["calls"] = row["handler"] or "nothing (slow fallback)"
    if unresolved:
        out.write(
            "\nUnresolved conflicts: plugins claim these slots at equal priority, so neither handler is installed "
            "and ShardTensor calls what it had before (set SHARDEXT_PREFER, a priority, or SHARDEXT_DISABLE):\n"
        )
        _table(
            unresolved, ["target", "level", "priority", "claimants_cell", "calls"], out, {"claimants_cell": "claimants"}
        )
    drifted = [row for row in handlers if row["drift"]]
    if drifted:
        out.write("\nHandlers ShardTensor calls that are not the recorded ones:\n")
        _table(drifted, ["target", "level", "handler", "recorded_handler", "drift_reason"], out)
    waiting = [p for p in plugins if p["status"] == "deferred"]
    if waiting:
        out.write("\nPlugins waiting for a module (installed right after it is imported):\n")
        _table(waiting, ["plugin", "distribution", "version", "status", "reason"], out)
    yielded = [dict(p, yielded=line) for p in plugins for line in p.get("yielded_to_builtins", [])]
    if yielded:
        out.write("\nFirst-party handlers that stepped aside for a newer PhysicsNeMo's built-in (upstream drift):\n")
        _table(yielded, ["plugin", "version", "yielded"], out)
    problems = [p for p in plugins if p["status"] not in ("loaded", "deferred")]
    if problems:
        out.write("\nPlugins not installed:\n")
        _table(problems, ["plugin", "distribution", "version", "status", "reason"], out)
    unhealthy = [dict(p, health=note) for p in plugins for note in plugin_health(p)]
    if unhealthy:
        out.write("\nPlugin health (PROBLEM: provides nothing as written; slow: long to load; note: not an error):\n")
        _table(unhealthy, ["plugin", "distribution", "version", "status", "health"], out)


def plugin_health(plugin: dict[str, Any]) -> list[str]:
    """What to say about a plugin row's health: hook problems, a slow load, no patches declared here.

    A loaded plugin whose ``shardext_declare_patches`` ran and declared nothing (its
    declarations gated on this setup) gets a ``note``, not a ``PROBLEM``.

    Examples:
        >>> plugin_health({"status": "loaded", "patches": 0, "problems": [], "load_seconds": 2.5, "slow": True})
        ['slow: 2.50 s to load (import and hooks)', 'note: declared no patches on this setup (its shardext_declare_patches declared none here)']
        >>> plugin_health({"status": "loaded", "patches": 3, "problems": [], "load_seconds": 0.01, "slow": False})
        []
    """
    notes = [f"PROBLEM: {problem}" for problem in plugin.get("problems") or []]
    if plugin.get("slow"):
        notes.append(f"slow: {plugin.get('load_seconds') or 0:.2f} s to load (import and hooks)")
    if plugin["status"] == "loaded" and plugin["patches"] == 0 and not plugin.get("problems"):
        notes.append("note: declared no patches on this setup (its shardext_declare_patches declared none here)")
    return notes


def _runner(errors: list[str]) -> Callable[[str, Callable[[], Any], Any], Any]:
    """The inventory's ``run(stage, thunk, default)``: each piece contained on its own, so one
    broken plugin object costs one row, not the report."""
    return lambda stage, thunk, default: _inspect(stage, errors, thunk, default)


def _inventory() -> Any:
    """The inventory module, imported lazily: importing the package is what loads plugins."""
    from physicsnemo_shardext.tools import inventory

    return inventory


def _command_list(args: argparse.Namespace, out: TextIO) -> int:
    errors: list[str] = []
    registry = _registry(errors)
    handlers: list[dict[str, Any]] = []
    plugins: list[dict[str, Any]] = []
    if registry is not None:
        handlers = _inspect(
            "reading ShardTensor's registries", errors, lambda: _inventory().handler_rows(registry, _runner(errors)), []
        )
        plugins = _inspect("reading the plugin reports", errors, lambda: _inventory().plugin_rows(registry), [])
    if args.plugin:
        handlers = [h for h in handlers if h["provider"] == args.plugin or args.plugin in (h.get("claimants") or [])]
        plugins = [p for p in plugins if p["plugin"] == args.plugin]
    if args.json:
        data = {"schema_version": JSON_SCHEMA_VERSION, "handlers": handlers, "plugins": plugins, "errors": errors}
        out.write(json.dumps(data, indent=2, default=str) + "\n")
        return 0
    _write_listing(handlers, plugins, out)
    _write_errors(errors, out)
    return 0


def _doctor_data(errors: list[str]) -> dict[str, Any]:
    """The doctor report, or the sections that could be built, plus ``schema_version`` and ``errors``."""
    registry = _registry(errors)
    report: dict[str, Any] = {}
    if registry is not None:
        report = _inspect(
            "building the report", errors, lambda: _inventory().doctor_report(registry, _runner(errors)), {}
        )
    return {"schema_version": JSON_SCHEMA_VERSION, **report, "errors": errors}


def _write_doctor_plugins(report: dict[str, Any], out: TextIO) -> None:
    out.write("Plugins\n")
    versions = {d["plugin"]: d["version"] for d in report.get("plugin_details") or []}
    for status, names in report["plugins"].items():
        labelled = [f"{name}=={versions[name]}" if versions.get(name) else name for name in names]
        out.write(f"  {status:22} {len(names)}  {', '.join(labelled)}\n")
    for detail in report["plugin_details"]:
        if detail["status"] != "loaded":
            out.write(f"    {detail['plugin']} ({detail['distribution']}=={detail['version']}): {detail['reason']}\n")
        for skipped in detail["not_applicable"]:
            out.write(f"    {detail['plugin']}: not needed here, not installed: {skipped}\n")
        for yielded in detail.get("yielded_to_builtins", []):
            out.write(f"    {detail['plugin']}: upstream drift, not installed: {yielded}\n")
        for note in plugin_health(detail):
            out.write(f"    {detail['plugin']} ({detail['distribution']}=={detail['version']}): {note}\n")
    _write_doctor_load_times(report, out)


def _write_doctor_load_times(report: dict[str, Any], out: TextIO) -> None:
    """Each imported plugin's load time (import and hooks), slowest first."""
    timed = [d for d in report["plugin_details"] if d.get("load_seconds") is not None]
    threshold = (report.get("settings") or {}).get("slow_plugin_seconds")
    limit = "off" if threshold is None else f"{threshold:g} s"
    out.write(f"Plugin load times (import and hooks; SHARDEXT_SLOW_PLUGIN_SECONDS: {limit})\n")
    if not timed:
        out.write("  none\n")
    for detail in sorted(timed, key=lambda d: (-d["load_seconds"], d["plugin"])):
        flag = "  SLOW" if detail.get("slow") else ""
        out.write(f"  {detail['plugin']:22} {detail['load_seconds']:8.3f} s{flag}\n")


def _write_doctor_conflicts(report: dict[str, Any], out: TextIO) -> None:
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


def _write_doctor_handlers(report: dict[str, Any], out: TextIO) -> None:
    handlers = report["handlers"]
    out.write(
        f"Handlers\n  {handlers['total']} in ShardTensor, {handlers['from_plugins']} from plugins, "
        f"{handlers['overriding_builtins']} overriding PhysicsNeMo built-ins\n"
    )
    for row in report.get("drift") or []:
        out.write(
            f"  DRIFT {row['level']} {row['target']}: ShardTensor calls {row['handler'] or 'nothing'}, "
            f"recorded {row['recorded_handler'] or 'nothing'} ({row['drift_reason']})\n"
        )


def _command_doctor(args: argparse.Namespace, out: TextIO) -> int:
    errors: list[str] = []
    report = _doctor_data(errors)
    if args.json:
        out.write(json.dumps(report, indent=2, default=str) + "\n")
        return 0
    if "versions" in report:  # absent only when the report could not be built at all
        out.write("Versions\n")
        for name, version in report["versions"].items():
            out.write(f"  {name:22} {version}\n")
        support = report.get("torch_support") or {}
        if support.get("in_declared_range") is False:
            out.write(
                f"  torch {support['torch']} (release {support['release']}) is OUTSIDE the range this package "
                f"declares and tests, torch{support['declared']}\n"
            )
        out.write("Backends\n")
        for name, available in report["backends"].items():
            out.write(f"  {name:22} {available}\n")
        _write_doctor_plugins(report, out)
        _write_doctor_conflicts(report, out)
        _write_doctor_handlers(report, out)
    _write_errors(errors, out)
    return 0


def _command_new(args: argparse.Namespace, out: TextIO) -> int:
    from physicsnemo_shardext.tools import scaffold  # the standard library (and packaging) only

    try:
        result = scaffold.write_plugin(args.name, args.directory)
    except scaffold.ScaffoldError as error:
        sys.stderr.write(f"shardext new: error: {error}\n")
        return 2
    out.write(scaffold.next_steps(result) + "\n")
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
    new = commands.add_parser(
        "new",
        help="write a plugin distribution to start a patch from (pyproject, hooks, handler, tests, README, ci.sh)",
        description="Write a complete plugin distribution: pip install -e it and its tests pass as generated.",
    )
    new.add_argument(
        "name",
        metavar="NAME",
        help="distribution name, e.g. shardext-myop; the module (shardext_myop) and plugin name derive from it",
    )
    new.add_argument(
        "--dir", dest="directory", metavar="DIR", help="where to write it (default: ./NAME); must not exist or be empty"
    )
    new.set_defaults(run=_command_new)
    schema = commands.add_parser(
        "schema",
        help="print the JSON Schema of a command's --json output (list, doctor or verify; no torch import)",
    )
    schema.add_argument("schema_of", metavar="COMMAND", choices=["list", "doctor", "verify"])
    schema.set_defaults(run=_command_schema)
    verify = commands.add_parser(
        "verify",
        help="run a model sharded and single-process: op-by-op handlers, collectives, errors, gradients",
        description="Run MODULE:FACTORY's model on sharded and full inputs with identical seeds and report, op by "
        "op, which handler ran, whether the output stayed sharded, collectives and bytes per rank, the first error, "
        "and the output, loss and every gradient against single-process. Exit status: 0 match, 1 mismatch, "
        "2 unsupported op, 3 bad input, hang or dead rank.",
    )
    _verify_arguments(verify)
    verify.set_defaults(run=_command_verify)
    return parser


def _command_schema(args: argparse.Namespace, out: TextIO) -> int:
    from physicsnemo_shardext.tools.json_schemas import SCHEMAS  # the standard library only

    out.write(json.dumps(SCHEMAS[args.schema_of], indent=2) + "\n")
    return 0


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    from physicsnemo_shardext.tools.verify_command import add_arguments  # the standard library only

    add_arguments(parser)


def _command_verify(args: argparse.Namespace, out: TextIO) -> int:
    from physicsnemo_shardext.tools.verify_command import run_verify

    return run_verify(args, out)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of the ``shardext`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.run(args, out or sys.stdout)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
