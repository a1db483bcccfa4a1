"""Tests of the layout_ops plugin (patches/layout_ops.py): permute, transpose, contiguous/clone, cat, stack, views.

PReLU, which lived in this family before, is tested in ``test_pointwise.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.layout_ops import (
    cat_local,
    complex_view_local,
    flatten_local,
    stack_local,
    unflatten_local,
)
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor


def _channel_layer_norm(x: torch.Tensor) -> torch.Tensor:
    # UNet's ReshapedLayerNorm: merge spatial dims, move channels last, normalize, move back.
    shape = x.shape
    y = x.view(shape[0], shape[1], -1).transpose(1, 2).contiguous()
    y = F.layer_norm(y, (shape[1],))
    return y.transpose(1, 2).contiguous().view(shape)


def _pixel_shuffle_3d(x: torch.Tensor) -> torch.Tensor:
    # SRResNet's PixelShuffle3d(2) (view / permute / contiguous / view).
    b, c, d, h, w = x.shape
    y = x.contiguous().view(b, c // 8, 2, 2, 2, d, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
    return y.view(b, c // 8, 2 * d, 2 * h, 2 * w)


CASES = {
    "permute": lambda x: x.permute(0, 2, 4, 1, 3) * 1.5,
    "torch_permute": lambda x: torch.permute(x, (2, 0, 1, 3, 4)) * 1.5,
    "transpose": lambda x: x.transpose(1, 2) * 1.5,
    "torch_transpose_negative": lambda x: torch.transpose(x, -3, -1) * 1.5,
    "contiguous_after_permute": lambda x: x.permute(0, 2, 1, 3, 4).contiguous() * 1.5,
    "clone": lambda x: x.clone() * 1.5,
    "cat_channels": lambda x: torch.cat([x, 3 * x, x * x], dim=1),
    "pixel_shuffle_3d": _pixel_shuffle_3d,
    # flatten with the sharded dim first of the group (AFNO's patch embedding), and back
    "flatten": lambda x: x.flatten(2) * 1.5,
    "torch_flatten_unflatten": lambda x: torch.unflatten(torch.flatten(x, 2, 3), 2, (7, 3)) * 1.5,
    "flatten_unflatten_negative_dims": lambda x: x.flatten(-3, -2).unflatten(-2, (7, 3)) * 1.5,
    "stack_new_last_dim": lambda x: torch.stack([x, 2 * x], dim=-1) * 1.5,
    "stack_before_sharded_dim": lambda x: torch.stack([x, x * x], dim=1),
    # complex views (the input's last dim of 2 is the real/imag pair): AFNO's spectral block
    "real_imag": lambda x: (lambda c: c.real * 2.0 + c.imag * c.real)(torch.view_as_complex(x)),
    "torch_real_imag": lambda x: (lambda c: torch.real(c) - 3.0 * torch.imag(c))(torch.view_as_complex(x)),
    "view_as_real_roundtrip": lambda x: torch.view_as_real(torch.view_as_complex(x)) * 1.5,
}


def _expected(name: str, placements: list) -> list:
    """Placements of each case's output, given the input's."""
    moves = {
        "permute": [0, 2, 4, 1, 3],
        "torch_permute": [2, 0, 1, 3, 4],
        "transpose": [0, 2, 1, 3, 4],
        "torch_transpose_negative": [0, 1, 4, 3, 2],
        "contiguous_after_permute": [0, 2, 1, 3, 4],
    }
    if name == "stack_before_sharded_dim":  # a new dim 1: the sharded dim moves up by one
        return [Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= 1 else p for p in placements]
    if name not in moves:
        return placements
    order = moves[name]
    return [Shard(order.index(p.dim)) if isinstance(p, Shard) else p for p in placements]


def test_every_target_is_installed_by_the_plugin():
    registry = physicsnemo_shardext.get_registry()
    for target in (torch.cat, torch.Tensor.permute, torch.Tensor.transpose, torch.Tensor.contiguous,
                   torch.stack, torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten, torch.unflatten,
                   torch.Tensor.real.__get__, torch.Tensor.imag.__get__, torch.view_as_real, torch.view_as_complex):
        record = registry.provenance(target)
        assert record is not None and record.plugin.name == "layout_ops"


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_op_on_uneven_rows(domain_mesh, name):
    # 7 rows split 5 + 2: even chunking would say 4 + 3, so a fallback that re-chunks fails here.
    x = torch.randn(1, 8, 7, 3, 2)
    placements = [Shard(2)]
    report = check_conformance(
        CASES[name], [x], ShardSpec(domain_mesh, placements, [5, 2]), expected_placements=_expected(name, placements)
    )
    assert report.comms.forward.total_calls == 0


@pytest.mark.multirank(2)
def test_channel_layer_norm_keeps_the_split(domain_mesh):
    x = torch.randn(1, 4, 7, 3, 2)
    check_conformance(_channel_layer_norm, [x], ShardSpec(domain_mesh, [Shard(2)], [5, 2]))


@pytest.mark.multirank(4)
@pytest.mark.parametrize("name", ["permute", "transpose", "cat_channels", "pixel_shuffle_3d"])
def test_layout_op_on_2d_spatial_mesh(spatial_mesh, name):
    x = torch.randn(1, 8, 7, 5, 2)
    placements = [Shard(2), Shard(3)]
    check_conformance(
        CASES[name], [x], ShardSpec(spatial_mesh, placements, {0: [5, 2], 1: [1, 4]}),
        expected_placements=_expected(name, placements),
    )


@pytest.mark.multirank(2)
def test_cat_refuses_what_it_cannot_do(domain_mesh):
    x = shard_tensor(torch.randn(1, 2, 7), domain_mesh, [Shard(2)], [5, 2])
    other_split = shard_tensor(torch.randn(1, 2, 7), domain_mesh, [Shard(2)], [4, 3])
    with pytest.raises(MissingShardPatch, match="sharded differently.*fails on uneven shards"):
        cat_local(torch.cat, (), ([x, other_split], 1), {})
    with pytest.raises(MissingShardPatch, match=r"replicated input of shape \(1, 2, 6\) does not match"):
        cat_local(torch.cat, (), ([x, torch.randn(1, 2, 6)],), {"dim": 1})


class CatsAGrid(torch.nn.Module):
    """FNO's coordinate features: a plain full-size grid (and a trainable replicated table) next to the input."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(1, 2, 7, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = torch.linspace(0, 1, 7).reshape(1, 1, 7, 1).expand(1, 1, 7, 3)
        return torch.cat((x, grid, self.table), dim=1)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[5, 2], [7, 0]], ids=["uneven", "empty-shard"])
def test_cat_cuts_replicated_inputs_to_the_rows(domain_mesh, split):
    report = check_conformance(CatsAGrid(), [torch.randn(1, 3, 7, 3)], ShardSpec(domain_mesh, [Shard(2)], split))
    assert report.comms.forward.total_calls == 0


@pytest.mark.multirank(2)
def test_complex_view_of_uneven_shards_is_local_and_keeps_the_split(domain_mesh):
    x = shard_tensor(torch.randn(1, 2, 7, 2), domain_mesh, [Shard(2)], [5, 2])
    c = torch.view_as_complex(x)
    assert isinstance(c, ShardTensor) and c.dtype == torch.complex64
    assert c._spec.sharding_shapes()[0] == (torch.Size([1, 2, 5]), torch.Size([1, 2, 2]))
    back = torch.view_as_real(c)
    assert back._spec.sharding_shapes()[0] == (torch.Size([1, 2, 5, 2]), torch.Size([1, 2, 2, 2]))
    torch.testing.assert_close(c.imag.full_tensor(), x.full_tensor()[..., 1])


def _assert_delegated(fn, fulls, shards, plugin, placements):
    """``fn`` of ShardTensors: values, placements and input gradients match single-process and the plugin-off run."""
    fulls = [f.clone().requires_grad_(True) for f in fulls]
    expected = fn(*fulls)
    real = torch.view_as_real(expected) if expected.is_complex() else expected
    weight = torch.randn(real.shape, generator=torch.Generator().manual_seed(2), dtype=real.dtype)
    (real * weight).sum().backward()
    runs = []
    for disabled in (False, True):
        inputs = [s() for s in shards]
        if disabled:
            with physicsnemo_shardext.disabled(plugins=[plugin]):
                out = fn(*inputs)
        else:
            out = fn(*inputs)
        assert tuple(out.placements) == placements
        value = out.full_tensor()
        torch.testing.assert_close(value, expected)
        (torch.view_as_real(value) if value.is_complex() else value).mul(weight).sum().backward()
        grads = [t.grad.full_tensor() for t in inputs]
        for g, f in zip(grads, fulls):
            torch.testing.assert_close(g, f.grad)
        runs.append((value, grads))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


@pytest.mark.multirank(2)
def test_view_as_complex_of_a_sharded_last_dim_is_delegated_to_the_fallback(domain_mesh):
    # The fallback gathers the real/imag dim: Replicate, values and gradients right.
    full = torch.randn(3, 2, dtype=torch.float64)
    _assert_delegated(torch.view_as_complex, [full],
                      [lambda: shard_tensor(full, domain_mesh, [Shard(1)], [1, 1], requires_grad=True)],
                      "layout_ops", (Replicate(),))


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[5, 2], [4, 3]], ids=["uneven", "even-ish"])
def test_cat_along_the_sharded_dim_is_delegated_to_the_fallback(domain_mesh, split):
    # The fallback gathers the sharded dim: Replicate output, values and gradients right on uneven shards.
    a, b = torch.randn(2, 1, 2, 7, dtype=torch.float64)
    _assert_delegated(lambda x, y: torch.cat([x, y], 2), [a, b],
                      [lambda: shard_tensor(a, domain_mesh, [Shard(2)], split, requires_grad=True),
                       lambda: shard_tensor(b, domain_mesh, [Shard(2)], split, requires_grad=True)],
                      "layout_ops", (Replicate(),))


LAYOUTS = {
    # name: (op, shapes, placements and splits of the inputs, output placements); every shard holds
    # torch.chunk's rows (8 or 7 rows: 4/4 or 4/3; 2 channels: 1/1), the layout the fallback assumes.
    "cat-shard2-with-shard1": ("cat", 1, [(1, 2, 8), (1, 4, 8)], [(Shard(2), [4, 4]), (Shard(1), [2, 2])], (Shard(2),)),
    "cat-shard2-with-replicate": ("cat", 1, [(1, 2, 7), (1, 3, 7)], [(Shard(2), [4, 3]), (Replicate(), None)],
                                  (Shard(2),)),
    "stack-shard2-with-shard1": ("stack", 1, [(1, 2, 8), (1, 2, 8)], [(Shard(2), [4, 4]), (Shard(1), [1, 1])],
                                 (Replicate(),)),
    "stack-shard2-with-replicate": ("stack", 0, [(1, 2, 7), (1, 2, 7)], [(Shard(2), [4, 3]), (Replicate(), None)],
                                    (Shard(3),)),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cat_and_stack_of_different_layouts_with_dtensor_chunks_are_delegated(domain_mesh, name):
    # The fallback redistributes inputs it can take for DTensor's own (torch.chunk) layout: right.
    op, dim, shapes, layouts, placements = LAYOUTS[name]
    fulls = [torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
             for i, shape in enumerate(shapes)]
    makers = [lambda f=f, p=p, split=split: shard_tensor(f, domain_mesh, [p], split, requires_grad=True)
              for f, (p, split) in zip(fulls, layouts)]
    _assert_delegated(lambda *ts: getattr(torch, op)(list(ts), dim=dim), fulls, makers, "layout_ops", placements)


@pytest.mark.multirank(2)
def test_stack_with_a_plain_tensor_and_dtensor_chunks_is_delegated(domain_mesh):
    a, b = torch.randn(2, 1, 2, 7, dtype=torch.float64)
    xs = shard_tensor(a, domain_mesh, [Shard(2)], [4, 3])
    out = torch.stack([xs, b], dim=0)
    with physicsnemo_shardext.disabled(plugins=["layout_ops"]):
        baseline = torch.stack([xs, b], dim=0)
    assert tuple(out.placements) == tuple(baseline.placements) == (Shard(3),)
    torch.testing.assert_close(out.full_tensor(), torch.stack([a, b]))
    torch.testing.assert_close(out.to_local(), baseline.to_local(), rtol=0, atol=0)


@pytest.mark.multirank(2)
def test_stack_of_different_shapes_gets_torchs_error(domain_mesh):
    x = shard_tensor(torch.randn(1, 7, 3), domain_mesh, [Shard(1)], [5, 2])
    y = shard_tensor(torch.randn(1, 7, 2), domain_mesh, [Shard(1)], [5, 2])
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        torch.stack([x, y])


@pytest.mark.multirank(2)
def test_flatten_scales_the_rows_and_refuses_interleaving(domain_mesh):
    x = shard_tensor(torch.randn(1, 2, 7, 3), domain_mesh, [Shard(2)], [5, 2])
    y = flatten_local(torch.Tensor.flatten, (), (x, 2), {})
    assert y._spec.sharding_shapes()[0] == (torch.Size([1, 2, 15]), torch.Size([1, 2, 6]))
    torch.testing.assert_close(y.full_tensor(), x.full_tensor().flatten(2))
    with pytest.raises(MissingShardPatch, match=r"merges sharded dim 2 with dims \[1\]"):
        flatten_local(torch.flatten, (), (x, 1), {})  # rows would interleave with the unsharded dim 1
    with pytest.raises(MissingShardPatch, match="not multiples of 7"):
        unflatten_local(torch.unflatten, (), (y, 2, (3, 7)), {})


@pytest.mark.multirank(2)
def test_stack_refuses_differently_sharded_inputs(domain_mesh):
    x = shard_tensor(torch.randn(1, 2, 7), domain_mesh, [Shard(2)], [5, 2])
    other_split = shard_tensor(torch.randn(1, 2, 7), domain_mesh, [Shard(2)], [4, 3])
    with pytest.raises(MissingShardPatch, match="stacking needs identical shards"):
        stack_local(torch.stack, (), ([x, other_split], -1), {})
    with pytest.raises(MissingShardPatch, match="every input must be a ShardTensor"):
        stack_local(torch.stack, (), ([x, torch.randn(1, 2, 7)],), {})


GRID_TO_POINTS = {
    # FNO's decoder and AFNO's patch embedding: an H- and W-sharded grid flattened into points, and back.
    "reshape": lambda x: (x.permute(0, 2, 3, 1).reshape(-1, 2) * 1.5).reshape(1, 9, 7, 2),
    "torch_reshape": lambda x: torch.reshape(x.permute(0, 2, 3, 1), (-1, 2)).tanh(),
    "view": lambda x: x.permute(0, 2, 3, 1).contiguous().view(63, 2) * 1.5,
    "flatten": lambda x: (x.flatten(2).transpose(1, 2) * 1.5).reshape(1, 9, 7, 2),
}


@pytest.mark.multirank(4)
@pytest.mark.parametrize("name", sorted(GRID_TO_POINTS))
def test_merging_two_sharded_dims_gathers_the_inner_one(spatial_mesh, name):
    # Points split over two mesh dims would need per-group shard sizes, which DTensor cannot express:
    # W is gathered over the "w" mesh dim (one all-gather), the points are sharded over "h" only.
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [5, 4], 1: [2, 5]})
    report = check_conformance(GRID_TO_POINTS[name], [torch.randn(1, 2, 9, 7)], spec,
                               expected_placements=[Shard(0) if name in ("torch_reshape", "view") else Shard(1),
                                                    Replicate()])
    assert sum(n for op, n in report.comms.forward.counts.items() if "gather" in op) == 1


def test_reshape_is_an_override_that_delegates_to_the_builtin():
    registry = physicsnemo_shardext.get_registry()
    for target in (torch.Tensor.reshape, torch.reshape, torch.Tensor.view):
        record = registry.provenance(target)
        assert record is not None and record.plugin.name == "layout_ops" and record.replaced is not None


# -- the override rule: what the handlers do not handle goes to what they replaced -----------------
def _partial(full: torch.Tensor, mesh, rank: int) -> ShardTensor:
    """A Partial(sum) ShardTensor whose two ranks' terms add up to ``full``."""
    share = torch.rand(full.shape, generator=torch.Generator().manual_seed(1))
    local = full * share if rank == 0 else full * (1 - share)
    return ShardTensor.from_local(local, mesh, [Partial()], sharding_shapes={})


@pytest.mark.multirank(2)
@pytest.mark.parametrize("op", ["cat", "stack"])
def test_partial_inputs_of_cat_and_stack_are_delegated(domain_mesh, rank, op):
    # GeoTransolver's context builder concatenates Partial(sum) tensors: DTensor's fallback does it right.
    torch.manual_seed(0)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    pa, pb = _partial(a, domain_mesh, rank), _partial(b, domain_mesh, rank)
    func = getattr(torch, op)
    out = func([pa, pb], dim=1)
    torch.testing.assert_close(out.full_tensor(), func([a, b], dim=1))
    with physicsnemo_shardext.disabled(plugins=["layout_ops"]):
        baseline = func([pa, pb], dim=1)
    assert tuple(out._spec.placements) == tuple(baseline._spec.placements)
    torch.testing.assert_close(out.to_local(), baseline.to_local())


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[3, 3], [4, 2], [6, 0]], ids=["even", "uneven", "empty-shard"])
def test_cat_with_a_sharded_plain_dtensor(domain_mesh, split):
    # FLARE's positional buffer: a plain DTensor sharded DTensor's way (even chunks) next to the
    # input. It is gathered and cut to the input's rows, not taken for a replicated tensor.
    torch.manual_seed(0)
    a, b = torch.randn(1, 6, 3), torch.randn(1, 6, 2)
    ra, rb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    expected = torch.cat([ra, rb], dim=2)
    weight = torch.randn(expected.shape)
    (expected * weight).sum().backward()
    xs = shard_tensor(a, domain_mesh, [Shard(1)], split, requires_grad=True)
    buffer = distribute_tensor(b, domain_mesh, [Shard(1)]).detach().requires_grad_(True)
    out = torch.cat([xs, buffer], dim=2)
    assert out._spec.sharding_shapes()[0] == xs._spec.sharding_shapes()[0][:0] + tuple(
        torch.Size([1, n, 5]) for n in split)
    torch.testing.assert_close(out.full_tensor(), expected)
    (out.full_tensor() * weight).sum().backward()
    torch.testing.assert_close(xs.grad.full_tensor(), ra.grad)
    torch.testing.assert_close(buffer.grad.full_tensor(), rb.grad)


# -- several samples per domain group: merging the batch dim with a sharded dim -------------------
DECODER_RESHAPES = {
    # FNO's grid_to_points: (B, C, H, W) -> (B, H, W, C) -> (B*H*W, C)
    "reshape": lambda x: x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]),
    "torch_reshape": lambda x: torch.reshape(x.permute(0, 2, 3, 1), (-1, x.shape[1])),
    "view": lambda x: x.permute(0, 2, 3, 1).contiguous().view(-1, x.shape[1]),
    "flatten": lambda x: x.permute(0, 2, 3, 1).flatten(0, 2),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(DECODER_RESHAPES))
def test_merging_a_batch_of_two_with_the_sharded_dim_is_refused(domain_mesh, name):
    x = shard_tensor(torch.randn(2, 3, 7, 4), domain_mesh, [Shard(2)], [4, 3])
    with pytest.raises(MissingShardPatch, match=r"merges sharded dim 1 with dims \[0\] in front of it \(sizes \(2,\)\)"):
        DECODER_RESHAPES[name](x)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(DECODER_RESHAPES))
def test_merging_a_batch_of_one_with_the_sharded_dim_matches(domain_mesh, name):
    spec = ShardSpec(domain_mesh, [Shard(2)], [4, 3])
    check_conformance(lambda x: DECODER_RESHAPES[name](x) * 1.5, [torch.randn(1, 3, 7, 4)], spec,
                      expected_placements=[Shard(0)])


@pytest.mark.multirank(2)
def test_reshape_keeping_the_batch_dim_apart_still_works_with_two_samples(domain_mesh):
    spec = ShardSpec(domain_mesh, [Shard(2)], [4, 3])
    check_conformance(lambda x: x.permute(0, 2, 3, 1).reshape(2, -1, 3) * 1.5, [torch.randn(2, 3, 7, 4)], spec,
                      expected_placements=[Shard(1)])


@pytest.mark.multirank(2)
def test_reshape_of_a_partial_input_is_delegated(domain_mesh, rank):
    full = torch.randn(2, 3, 4)
    out = _partial(full, domain_mesh, rank).reshape(6, 4)
    torch.testing.assert_close(out.full_tensor(), full.reshape(6, 4))
