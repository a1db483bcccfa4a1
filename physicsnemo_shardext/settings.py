"""User switches read from environment variables.

================================  =====================================================
Variable                          Meaning
================================  =====================================================
``SHARDEXT_AUTOLOAD``             ``0``/``false``/``no``/``off``: do not load plugins on import
``SHARDEXT_DISABLE``              comma-separated plugin or distribution names never to load (a name
                                  matching nothing installed gives a ``ShardextWarning``)
``SHARDEXT_ONLY``                 comma-separated allow-list: load only these plugins (unknown names
                                  warn, as for ``SHARDEXT_DISABLE``)
``SHARDEXT_STRICT``               ``1``: anything but a clean load (failed, refused name, direct registry
                                  write, incompatible, hooks that provide nothing, a nested load) or an
                                  unresolved conflict raises
``SHARDEXT_SLOW_PLUGIN_SECONDS``  seconds above which a plugin's load (import and hooks) warns
                                  (default ``1``; ``off`` never warns)
``SHARDEXT_PREFER``               comma-separated names, most preferred first, breaking equal-priority ties
``SHARDEXT_TRACE``                ``1``: log every handler decision (``op -> handler -> plugin``)
``SHARDEXT_TEST_TIMEOUT``         seconds a multirank test may run (read by the pytest plugin per test)
================================  =====================================================

`ENVIRONMENT_VARIABLES` holds the help string of every variable the package reads;
`Settings` parses those read on import (all but ``SHARDEXT_TEST_TIMEOUT``).

Examples:
    >>> settings = Settings.from_env({"SHARDEXT_DISABLE": "a, b-dist", "SHARDEXT_STRICT": "1"})
    >>> settings.deny, settings.strict, settings.autoload, settings.slow_plugin_seconds
    (('a', 'b-dist'), True, True, 1.0)
    >>> Settings.from_env({"SHARDEXT_SLOW_PLUGIN_SECONDS": "off"}).slow_plugin_seconds is None
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_SLOW_PLUGIN_SECONDS", "ENVIRONMENT_VARIABLES", "RENAMED_PLUGINS", "Settings"]

#: First-party plugins renamed in 0.2, old name -> new name. The old names keep
#: working wherever a plugin is named (``SHARDEXT_DISABLE``/``_ONLY``/``_PREFER``,
#: ``physicsnemo_shardext.disabled(plugins=...)``).
RENAMED_PLUGINS: dict[str, str] = {"misc_ops": "layout_ops", "spectral": "indexing_einsum"}


def current_name(name: str) -> str:
    """``name`` with a renamed first-party plugin's old name replaced by its new one.

    Examples:
        >>> current_name("misc_ops"), current_name("fft")
        ('layout_ops', 'fft')
    """
    return RENAMED_PLUGINS.get(name, name)


#: A plugin whose load (import and hooks) takes longer warns (``SHARDEXT_SLOW_PLUGIN_SECONDS``).
DEFAULT_SLOW_PLUGIN_SECONDS = 1.0

#: Every environment variable the package reads, with its help string.
ENVIRONMENT_VARIABLES: dict[str, str] = {
    "SHARDEXT_AUTOLOAD": "0/false/no/off: do not discover and install plugins on import",
    "SHARDEXT_DISABLE": (
        "comma-separated plugin (entry-point) or distribution names never to load; a name that matches "
        "no installed plugin or distribution gives a ShardextWarning naming the close matches"
    ),
    "SHARDEXT_ONLY": (
        "comma-separated allow-list of plugin or distribution names; others are blocked (empty: block all); "
        "a name that matches no installed plugin or distribution gives a ShardextWarning naming the close "
        "matches (a warning in strict mode too)"
    ),
    "SHARDEXT_STRICT": (
        "1: a plugin that does not load cleanly (failed, name refused, wrote into the registries itself, "
        "incompatible, hooks that provide nothing such as a hook function without @hookimpl, or a plugin "
        "calling load_plugins() from its own load) or an unresolved conflict raises instead of warning; "
        "blocked plugins are fine, and so are slow ones"
    ),
    "SHARDEXT_SLOW_PLUGIN_SECONDS": (
        f"seconds (default {DEFAULT_SLOW_PLUGIN_SECONDS:g}) above which a plugin's load (its import and hooks) "
        "gives a ShardextWarning naming the plugin and its time; off/none never warns. shardext doctor shows "
        "every plugin's load time"
    ),
    "SHARDEXT_PREFER": "comma-separated plugin or distribution names, most preferred first, breaking ties",
    "SHARDEXT_COMPILE_HANDLERS": (
        "1/true/yes/on: under torch.compile first-party handlers are traced into the graph with functional "
        "collectives (opt-in); default: every first-party handler is a graph break and runs eagerly"
    ),
    "SHARDEXT_TRACE": "1: wrap installed handlers and log 'op -> handler -> plugin' decisions",
    "SHARDEXT_TEST_TIMEOUT": (
        "seconds a @pytest.mark.multirank test may run before its hung ranks are reported (read by the pytest "
        "plugin for each test; a marker's timeout= wins, and it wins over the ini option shardext_timeout)"
    ),
}

_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}


def _flag(value: str | None, default: bool, name: str) -> bool:
    if value is None or value.strip() == "":
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _seconds(value: str | None, default: float | None, name: str) -> float | None:
    """A duration in seconds: a non-negative number, or ``off``/``none``/``false``/``no`` for none."""
    if value is None or value.strip() == "":
        return default
    lowered = value.strip().lower()
    if lowered in {"off", "none", "false", "no"}:
        return None
    try:
        seconds = float(lowered)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # negative, or nan
        raise ValueError(f"{name}={value!r} is not a number of seconds (use e.g. 2.5, or off)")
    return seconds


def _names(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(current_name(name.strip()) for name in value.split(",") if name.strip())


@dataclass(frozen=True)
class Settings:
    """Parsed switches; see the module docstring for the variables."""

    autoload: bool = True
    deny: tuple[str, ...] = ()
    allow: tuple[str, ...] | None = None
    strict: bool = False
    prefer: tuple[str, ...] = ()
    trace: bool = False
    slow_plugin_seconds: float | None = DEFAULT_SLOW_PLUGIN_SECONDS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the ``SHARDEXT_*`` variables (from ``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        allow = _names(env.get("SHARDEXT_ONLY"))
        return cls(
            autoload=_flag(env.get("SHARDEXT_AUTOLOAD"), True, "SHARDEXT_AUTOLOAD"),
            deny=_names(env.get("SHARDEXT_DISABLE")),
            allow=allow if "SHARDEXT_ONLY" in env else None,
            strict=_flag(env.get("SHARDEXT_STRICT"), False, "SHARDEXT_STRICT"),
            prefer=_names(env.get("SHARDEXT_PREFER")),
            trace=_flag(env.get("SHARDEXT_TRACE"), False, "SHARDEXT_TRACE"),
            slow_plugin_seconds=_seconds(
                env.get("SHARDEXT_SLOW_PLUGIN_SECONDS"), DEFAULT_SLOW_PLUGIN_SECONDS, "SHARDEXT_SLOW_PLUGIN_SECONDS"
            ),
        )
