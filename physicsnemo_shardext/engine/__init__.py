"""The plugin engine: discovery, validation, installation, provenance and undo of shard patches.

Internal: the names a user or plugin author needs are re-exported at the package's
top level (``physicsnemo_shardext.PluginLoader``, ``PatchRegistry``, ``builtin_handler`` ...).

* `loader`: discovers entry points through pluggy and runs a plugin's stages in order;
* `registry`: owns what is installed in ShardTensor's registries, all or nothing, undoable;
* `resolution`: which of several declarations for one slot wins (priority, ``prefer``);
* `baseline` / `lazy_builtins`: PhysicsNeMo's own patches, present without CUDA;
* `requirements`: a plugin's declared versions against the environment;
* `provenance`: what a report says about a plugin and each patch;
* `aliases`: every torch name of an op reaches the same handler;
* `import_hooks`: run a callback once a module is imported;
* `trace`: opt-in logging of which handler ran.

Examples:
    >>> from physicsnemo_shardext.engine.registry import PatchRegistry
    >>> from physicsnemo_shardext import PatchRegistry as Public
    >>> PatchRegistry is Public
    True
"""
