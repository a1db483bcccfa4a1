"""First-party shard patches, installed as ``physicsnemo_shardext.patches``.

Each module here is a plugin published under the ``physicsnemo_shardext``
entry-point group in this project's ``pyproject.toml``, exactly as a third
party would publish one; none is imported or registered by the framework
directly.
"""
