"""Write small, genuinely installed plugin distributions for tests.

`write_plugin_distribution` lays out what an installer leaves behind
(``name-version.dist-info/`` with ``METADATA`` and ``entry_points.txt``, plus
the plugin's modules) in a folder, so that once the folder is on ``sys.path``
``importlib.metadata`` discovers the plugin exactly as it discovers one that
pip installed.

Examples:
    >>> import tempfile
    >>> from importlib import metadata
    >>> folder = tempfile.mkdtemp()
    >>> _ = write_plugin_distribution(folder, "demo-dist", "1.2", {"demo": "demo_mod"}, {"demo_mod": ""})
    >>> [ep.name for d in metadata.distributions(path=[folder]) for ep in d.entry_points]
    ['demo']
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from physicsnemo_shardext.engine.loader import ENTRY_POINT_GROUP as GROUP
from physicsnemo_shardext.markers import DISTRIBUTION_NAME as FIRST_PARTY_DISTRIBUTION

__all__ = ["entry_points_in", "first_party_entry_points", "write_plugin_distribution"]


def write_plugin_distribution(
    folder: str | Path,
    distribution: str,
    version: str,
    entry_points: Mapping[str, str],
    modules: Mapping[str, str],
) -> Path:
    """Create an installed distribution with plugin entry points in ``folder``.

    Args:
        folder: a directory that will be put on ``sys.path``.
        distribution: the distribution name (``my-plugin``).
        version: its version string.
        entry_points: ``{entry point name: "module" or "module:attr"}`` in the plugin group.
        modules: ``{module name: source code}`` written as ``module.py`` files.

    Returns:
        The ``.dist-info`` directory.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    info = folder / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    lines = [f"[{GROUP}]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
    return info


def entry_points_in(folder: str | Path, group: str = GROUP) -> list[metadata.EntryPoint]:
    """The plugin entry points of the distributions installed in ``folder`` only, by (name, distribution)."""
    return sorted(
        (ep for dist in metadata.distributions(path=[str(folder)]) for ep in dist.entry_points if ep.group == group),
        key=lambda ep: (ep.name, ep.dist.name if ep.dist is not None else ""),
    )


def first_party_entry_points(*names: str, group: str = GROUP) -> list[metadata.EntryPoint]:
    """The installed ``physicsnemo-shardext`` entry points called ``names`` (all of them if none given).

    Lets a test put a real first-party plugin beside fixture plugins, in any order.

    Examples:
        >>> [ep.name for ep in first_party_entry_points("pointwise")]
        ['pointwise']
    """
    distribution = metadata.distribution(FIRST_PARTY_DISTRIBUTION)
    return [ep for ep in distribution.entry_points if ep.group == group and (not names or ep.name in names)]
