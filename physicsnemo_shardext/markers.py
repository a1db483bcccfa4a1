"""The pluggy markers of the ``physicsnemo_shardext`` project.

Plugin authors decorate their hook functions with `hookimpl`.

Examples:
    >>> from physicsnemo_shardext import hookimpl
    >>> @hookimpl
    ... def shardext_declare_patches(patches):
    ...     pass
"""

from __future__ import annotations

import pluggy

__all__ = ["DISTRIBUTION_NAME", "PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "physicsnemo_shardext"
"""pluggy project name, and the entry-point group plugins are published under."""

DISTRIBUTION_NAME = "physicsnemo-shardext"
"""The distribution that ships the framework and its first-party patch families."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
