"""First-party shard patches, installed as ``physicsnemo_shardext.patches``.

Each module here is a plugin published under the ``physicsnemo_shardext``
entry-point group in this project's ``pyproject.toml``, exactly as a third
party would publish one; none is imported or registered by the framework
directly. This package module holds only what every family shares: the
PhysicsNeMo version range they are written against, as one
``shardext_requirements`` hook that each family imports into its own namespace
(pluggy finds a hook implementation by attribute, wherever it was defined).

Examples:
    >>> from physicsnemo_shardext.patches import shardext_requirements
    >>> shardext_requirements()
    {'nvidia-physicsnemo': '>=2.2,<2.3'}
    >>> from physicsnemo_shardext.patches import fft
    >>> fft.shardext_requirements is shardext_requirements
    True
"""

from physicsnemo_shardext.markers import hookimpl

__all__ = ["PHYSICSNEMO_DISTRIBUTION", "PHYSICSNEMO_REQUIREMENT", "shardext_requirements"]

PHYSICSNEMO_DISTRIBUTION = "nvidia-physicsnemo"
"""The distribution whose ShardTensor internals the first-party families rely on."""

PHYSICSNEMO_REQUIREMENT = ">=2.2,<2.3"
"""The PhysicsNeMo versions the first-party families are written against (the same range ``pyproject.toml`` pins).

A new PhysicsNeMo release is supported (or refused) by changing this one line
and the pin.
"""


@hookimpl
def shardext_requirements() -> dict[str, str]:
    """The PhysicsNeMo versions every first-party family relies on (its ShardTensor spec and internals)."""
    return {PHYSICSNEMO_DISTRIBUTION: PHYSICSNEMO_REQUIREMENT}
