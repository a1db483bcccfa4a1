"""Proof that the example plugin's clamp patch is right: the pattern to copy for your own patches."""

import doctest

import pytest
import torch
from torch.distributed.tensor import Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor
from shardext_example_plugin import clamp


def test_plugin_is_installed_with_provenance():
    record = physicsnemo_shardext.get_registry().provenance(torch.clamp)
    assert record.plugin.name == "example-clamp"
    assert record.plugin.distribution == "shardext-example-plugin"


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[6, 5], [10, 1]])
def test_clamp_matches_single_process(domain_mesh, split):
    x = torch.randn(2, 11, 4)
    spec = ShardSpec(domain_mesh, [Shard(1)], split)
    report = check_conformance(lambda t: torch.clamp(t, -0.5, 0.8), [x], spec)
    assert report.comms.forward.total_calls == 0
    check_conformance(lambda t: t.clamp(min=0.1), [x], spec)


@pytest.mark.multirank(2)
def test_tensor_bounds_are_refused(domain_mesh):
    xs = shard_tensor(torch.randn(2, 11, 4), domain_mesh, [Shard(1)], [6, 5])
    with pytest.raises(MissingShardPatch, match="scalar min/max only"):
        torch.clamp(xs, min=torch.zeros(()))


@pytest.mark.multirank(2)
def test_docstring_examples_run_on_two_ranks(domain_mesh, rank):
    # The examples in clamp.py's docstrings are documentation that cannot drift.
    result = doctest.testmod(clamp, extraglobs={"mesh": domain_mesh, "rank": rank}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
