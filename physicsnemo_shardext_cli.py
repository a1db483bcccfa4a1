"""The ``shardext`` console script, started from a module that imports no torch.

``shardext new``, ``shardext schema`` and ``--help`` need neither torch nor
PhysicsNeMo nor any plugin. `main` answers them from the torch-free
``physicsnemo_shardext.tools`` modules without running the package's front door
(which imports torch and installs every plugin). Every other command imports the
package with its plugin autoload deferred, then loads the plugins through
``tools.cli.autoload_for_cli``: plugins' prints go to stderr, so ``--json`` stays
valid, and what a plugin raises is shown in the report instead of ending the
command. ``physicsnemo_shardext_pytest`` solves the same problem for pytest.

``python -m physicsnemo_shardext_cli`` is this script; ``python -m physicsnemo_shardext``
runs the same commands after an ordinary import of the package.

Examples:
    >>> import io, contextlib
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     main(["schema", "list"])
    0
    >>> '"$schema"' in out.getvalue()
    True
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Sequence

__all__ = ["main"]

PACKAGE = "physicsnemo_shardext"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardext ARGV`` and return its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if PACKAGE not in sys.modules:
        with _package_without_front_door():
            cli = importlib.import_module(f"{PACKAGE}.tools.cli")
            if cli.answers_without_torch(args):
                return int(cli.main(args))
        _import_with_plugins_through_cli()
    cli = importlib.import_module(f"{PACKAGE}.tools.cli")
    return int(cli.main(args))


@contextlib.contextmanager
def _package_without_front_door() -> Iterator[None]:
    """Make the package's submodules importable without running its ``__init__`` (no torch, no plugins).

    Everything imported under the bare parent is forgotten on exit, so that a later
    ``import physicsnemo_shardext`` runs the real front door.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.submodule_search_locations is None:
        raise ModuleNotFoundError(f"{PACKAGE} is not installed", name=PACKAGE)
    bare = types.ModuleType(PACKAGE, "the package's folder, without its front door")
    bare.__path__ = list(spec.submodule_search_locations)
    sys.modules[PACKAGE] = bare
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def _import_with_plugins_through_cli() -> None:
    """Import the package with ``SHARDEXT_AUTOLOAD=0``, then load the plugins the way the command reports them."""
    before = os.environ.get("SHARDEXT_AUTOLOAD")
    os.environ["SHARDEXT_AUTOLOAD"] = "0"
    try:
        package = importlib.import_module(PACKAGE)
    finally:  # ranks that `verify` starts later see the user's own setting
        if before is None:
            del os.environ["SHARDEXT_AUTOLOAD"]
        else:
            os.environ["SHARDEXT_AUTOLOAD"] = before
    settings = package.Settings.from_env()
    if settings.autoload:
        cli = importlib.import_module(f"{PACKAGE}.tools.cli")
        cli.autoload_for_cli(lambda: package.load_plugins(settings))


if __name__ == "__main__":
    sys.exit(main())
