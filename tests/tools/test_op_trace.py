"""OpTracer on 2 ranks: who handled each op, where it was called, what it moved forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import physicsnemo_shardext
from physicsnemo_shardext.testing import shard_tensor
from physicsnemo_shardext.tools.op_trace import (
    OpTracer,
    describe_call,
    find_call_site,
    output_layout,
    registry_provider,
)


def test_call_site_skips_machinery_and_names_this_line():
    site = find_call_site()
    assert site is not None and site.file == __file__ and "find_call_site()" in site.code


def test_describe_call_names_shapes_dtypes_and_values():
    assert describe_call((torch.zeros(2, 3, dtype=torch.float64), [torch.ones(1)]), {"p": 0.5}) == (
        "Tensor[2, 3] float64, [Tensor[1] float32], p=0.5"
    )


@pytest.mark.multirank(2)
def test_handlers_sites_collectives_and_backward_are_attributed(domain_mesh, rank):
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    x = shard_tensor(torch.randn(1, 2, 11, 4), domain_mesh, [Shard(2)], [7, 4], requires_grad=True)
    tracer = OpTracer(provider_of=registry_provider(physicsnemo_shardext.get_registry()))
    with tracer:
        y = conv(x)
        z = torch.median(y, dim=2, keepdim=True).values  # the DTensor fallback: gathers H
        loss = F.gelu(z).sum()
    whole = tracer.backward(loss)
    sites = {site.op: site for site in tracer.ordered_sites()}
    conv_site = sites["torch.nn.functional.conv2d"]
    assert conv_site.provider_kind == "plugin" and conv_site.provider.startswith("convolution (")
    assert conv_site.output == "sharded" and conv_site.stayed_sharded
    assert conv_site.forward_collectives >= 1 and conv_site.gathers == 0  # the halo, not a gather
    assert conv_site.backward_collectives >= 1  # halo gradients and the weight's summed gradient
    assert conv_site.site is not None and conv_site.site.code == "y = conv(x)"
    median = sites["torch.median"]
    assert median.provider_kind == "dtensor" and median.handler == "DTensor fallback"
    assert median.gathers >= 1 and median.gathered_elements >= 1 * 3 * 11 * 4
    assert [s.index for s in tracer.ordered_sites()] == sorted(s.index for s in tracer.ordered_sites())
    attributed = sum(site.backward_collectives for site in tracer.sites.values())
    assert 0 < attributed <= whole.stats.total_calls
    assert tracer.first_error is None


@pytest.mark.multirank(2)
def test_the_first_error_is_kept_with_its_configuration(domain_mesh):
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    x = shard_tensor(torch.randn(1, 2, 8, 4), domain_mesh, [Shard(1)])
    tracer = OpTracer()
    with pytest.raises(NotImplementedError), tracer:
        conv(x)
    error = tracer.first_error
    assert error is not None and error.op == "torch.nn.functional.conv2d"
    assert error.error.startswith("MissingShardPatch") and "Shard(1)" in error.configuration


def test_output_layout_kinds():
    assert output_layout((torch.ones(2), None)) == ("plain", "")
    assert output_layout("text") == ("none", "")
