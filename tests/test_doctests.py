"""Run the examples in the framework modules' docstrings, so documentation cannot drift."""

import doctest
import importlib

import pytest

MODULES = [
    "physicsnemo_shardext",
    "physicsnemo_shardext.builtins",
    "physicsnemo_shardext.compat",
    "physicsnemo_shardext.declarations",
    "physicsnemo_shardext.distributed",
    "physicsnemo_shardext.errors",
    "physicsnemo_shardext.inventory",
    "physicsnemo_shardext.loader",
    "physicsnemo_shardext.markers",
    "physicsnemo_shardext.primitives.checks",
    "physicsnemo_shardext.primitives.index_exchange",
    "physicsnemo_shardext.primitives.layout",
    "physicsnemo_shardext.provenance",
    "physicsnemo_shardext.registry",
    "physicsnemo_shardext.resolution",
    "physicsnemo_shardext.settings",
    "physicsnemo_shardext.shard_registries",
    "physicsnemo_shardext.targets",
    "physicsnemo_shardext.trace",
    "physicsnemo_shardext.testing.placeholders",
    "physicsnemo_shardext.testing.plugin_packages",
    "physicsnemo_shardext.testing.sharding",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, registry_snapshot):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no runnable docstring example"
    assert result.failed == 0
