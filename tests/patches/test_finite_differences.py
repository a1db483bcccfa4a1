"""Tests of patches/finite_differences.py: torch.gradient and torch.diff along sharded dims by halo exchange."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.finite_differences import diff_output_sizes, sharded_diff, sharded_gradient
from physicsnemo_shardext.testing import CommCounter, ShardSpec, check_conformance, check_delegation, shard_tensor

SHAPE = (2, 3, 17, 5)  # sharded along dim 2
ROW_BYTES = 2 * 3 * 5 * 4  # one float32 row of dim 2
COORDS = torch.cumsum(torch.rand(17, generator=torch.Generator().manual_seed(3)) + 0.2, 0)  # non-uniform


def test_every_target_is_installed_by_the_plugin():
    registry = physicsnemo_shardext.get_registry()
    assert registry.provenance(torch.gradient).declaration.handler is sharded_gradient
    assert registry.provenance(torch.diff).declaration.handler is sharded_diff
    assert registry.provenance(torch.Tensor.diff).declaration.handler is sharded_diff


def test_diff_output_sizes_trim_the_tail():
    assert diff_output_sizes([10, 7], 2) == [10, 5]
    assert diff_output_sizes([16, 1], 3) == [14, 0]
    assert diff_output_sizes([4, 4], 9) == [0, 0]
    assert diff_output_sizes([0, 5, 0], 1, prepend_rows=2, append_rows=1) == [2, 5, 0]


GRADIENTS = {
    "default": (lambda x: torch.gradient(x), 1),
    "scalar-edge2": (lambda x: torch.gradient(x, spacing=0.5, dim=2, edge_order=2), 2),
    "list-of-scalars": (lambda x: torch.gradient(x, spacing=[0.5, 2.0], dim=(-2, 3)), 1),
    "coordinates-edge2": (lambda x: torch.gradient(x, spacing=(COORDS,), dim=2, edge_order=2), 2),
    "coordinates-edge1": (lambda x: torch.gradient(x, spacing=[COORDS], dim=2), 1),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(GRADIENTS))
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [0, 17]], ids=["uneven", "tiny", "empty"])
def test_gradient_matches_single_process(domain_mesh, name, split):
    fn, edge_order = GRADIENTS[name]
    report = check_conformance(fn, [torch.randn(SHAPE)], ShardSpec(domain_mesh, [Shard(2)], split))
    # One halo exchange for the sharded dim: the other rank wants at most edge_order + 1 of my rows.
    assert report.comms.forward.total_bytes <= (edge_order + 1) * ROW_BYTES
    assert report.comms.forward.counts in ({"c10d.alltoall_base_": 1}, {})
    assert report.comms.backward.total_bytes <= (edge_order + 1) * ROW_BYTES


@pytest.mark.multirank(4)
@pytest.mark.parametrize("split", [[5, 4, 4, 4], [1, 1, 0, 15]], ids=["even", "tiny-and-empty"])
def test_gradient_and_diff_on_four_ranks(domain_mesh, split):
    x = torch.randn(SHAPE)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    check_conformance(lambda t: torch.gradient(t, dim=2, edge_order=2), [x], spec)
    check_conformance(lambda t: torch.diff(t, n=3, dim=2), [x], spec)


@pytest.mark.multirank(4)
def test_gradient_and_diff_on_spatial_mesh(spatial_mesh):
    x = torch.randn(1, 3, 9, 7)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [8, 1], 1: [1, 6]})
    fn = lambda t: torch.gradient(t, spacing=[2.0, 0.5, 3.0], dim=(1, 2, 3), edge_order=2)  # noqa: E731
    report = check_conformance(fn, [x], spec)
    assert report.output_placements == [(Shard(2), Shard(3))] * 3
    assert report.comms.forward.counts == {"c10d.alltoall_base_": 2}  # one halo exchange per sharded dim
    check_conformance(lambda t: torch.diff(t, n=2, dim=3), [x], spec)


DIFFS = {
    "n1": lambda x: torch.diff(x, dim=2),
    "n2-method": lambda x: x.diff(2, -2),
    "n3": lambda x: torch.diff(x, n=3, dim=2),
    "unsharded-dim": lambda x: torch.diff(x, n=2, dim=3),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(DIFFS))
@pytest.mark.parametrize("split", [[10, 7], [16, 1], [17, 0]], ids=["uneven", "tiny", "empty"])
def test_diff_matches_single_process(domain_mesh, name, split):
    report = check_conformance(DIFFS[name], [torch.randn(SHAPE)], ShardSpec(domain_mesh, [Shard(2)], split))
    n = {"n1": 1, "n2-method": 2, "n3": 3, "unsharded-dim": 0}[name]
    assert report.comms.forward.total_bytes <= n * ROW_BYTES  # a halo of n rows after each shard


@pytest.mark.multirank(2)
def test_diff_output_sizes_and_placements(domain_mesh):
    x = shard_tensor(torch.randn(3, 17), domain_mesh, [Shard(1)], [16, 1])
    y = torch.diff(x, n=2, dim=1)
    assert y._spec.placements == (Shard(1),)
    assert [s[1] for s in y._spec.sharding_shapes()[0]] == [15, 0]  # the tail rank loses the rows
    z = torch.diff(x, n=20, dim=1)
    assert z.shape == (3, 0)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[10, 7], [0, 17], [17, 0]], ids=["uneven", "empty-first", "empty-last"])
def test_diff_with_prepend_and_append(domain_mesh, split):
    x, before, after = torch.randn(SHAPE), torch.randn(2, 3, 2, 5), torch.randn(2, 3, 1, 5)
    spec = ShardSpec(domain_mesh, [Shard(2)], split)
    check_conformance(
        lambda t, p, a: torch.diff(t, n=2, dim=2, prepend=p, append=a), [x, before, after], [spec, None, None]
    )
    check_conformance(lambda t, a: torch.diff(t, n=4, dim=2, append=a), [x, after], [spec, None])


@pytest.mark.multirank(4)
def test_diff_prepend_gradient_on_spatial_mesh(spatial_mesh):
    full = torch.randn(1, 2, 9, 7, dtype=torch.float64, requires_grad=True)
    before = torch.randn(1, 2, 9, 2, dtype=torch.float64, requires_grad=True)
    after = torch.randn(1, 1, 9, 7, dtype=torch.float64, requires_grad=True)
    x = shard_tensor(full.detach(), spatial_mesh, [Shard(2), Shard(3)], {0: [8, 1], 1: [1, 6]}, requires_grad=True)
    before_sh, after_sh = before.detach().clone().requires_grad_(), after.detach().clone().requires_grad_()
    weights = torch.randn(1, 2, 9, 8, dtype=torch.float64), torch.randn(1, 2, 9, 7, dtype=torch.float64)
    y = torch.diff(x, dim=3, prepend=before_sh)  # along the sharded W
    z = torch.diff(x, dim=1, append=after_sh)  # along an unsharded dim: local blocks of `after`
    assert y._spec.placements == z._spec.placements == (Shard(2), Shard(3))
    ref_y, ref_z = torch.diff(full, dim=3, prepend=before), torch.diff(full, dim=1, append=after)
    torch.testing.assert_close(y.full_tensor(), ref_y)
    torch.testing.assert_close(z.full_tensor(), ref_z)
    w_y = shard_tensor(weights[0], spatial_mesh, [Shard(2), Shard(3)], {0: [8, 1], 1: [3, 5]})
    w_z = shard_tensor(weights[1], spatial_mesh, [Shard(2), Shard(3)], {0: [8, 1], 1: [1, 6]})
    ((y.to_local() * w_y.to_local()).sum() + (z.to_local() * w_z.to_local()).sum()).backward()
    ((ref_y * weights[0]).sum() + (ref_z * weights[1]).sum()).backward()
    torch.testing.assert_close(x.grad.full_tensor(), full.grad)
    torch.testing.assert_close(before_sh.grad, before.grad)  # partial per rank, all-reduced by the bridge
    torch.testing.assert_close(after_sh.grad, after.grad)


@pytest.mark.multirank(2)
def test_patch_moves_less_than_dtensor_fallback(domain_mesh):
    full = torch.randn(2, 4, 64, 8)
    x = shard_tensor(full, domain_mesh, [Shard(2)], [32, 32])  # the fallback aborts gloo on uneven splits
    row = 2 * 4 * 8 * 4
    cases = [
        (lambda t: torch.gradient(t, dim=2, edge_order=2)[0], 1 * row),
        (lambda t: torch.diff(t, n=2, dim=2), 2 * row),
    ]
    for fn, bound in cases:
        with torch.no_grad(), CommCounter() as patched:
            fn(x)
        with physicsnemo_shardext.disabled(plugins=["finite_differences"]), torch.no_grad(), CommCounter() as fallback:
            fn(x)
        assert fallback.stats.total_bytes >= 32 * row  # the fallback all-gathers the activation
        assert patched.stats.total_bytes <= bound < fallback.stats.total_bytes


PARTIAL_STENCILS = {
    "gradient": lambda t: torch.stack(torch.gradient(t, spacing=0.5, edge_order=2)),
    "gradient-dim": lambda t: torch.gradient(t, dim=1)[0],
    "gradient-coords": lambda t: torch.gradient(t, spacing=[torch.tensor([0.0, 1.0, 3.0, 4.0, 7.0])], dim=1)[0],
    "diff-n2": lambda t: torch.diff(t, n=2, dim=0),
    "diff-prepend": lambda t: torch.diff(t, dim=0, prepend=torch.ones(1, 5)),
    "Tensor.diff": lambda t: t.diff(),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(PARTIAL_STENCILS))
def test_partial_input_is_delegated_to_the_fallback(domain_mesh, rank, name):
    # Linear stencils of a pending sum: the DTensor fallback is right (forward and grads).
    full = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    check_delegation(PARTIAL_STENCILS[name], full, domain_mesh, rank, "finite_differences", (Partial(),), exact=False)


DELEGATED_CONFIGURATIONS = {
    "coordinates-requiring-grad": (
        lambda t: torch.gradient(t, spacing=[torch.tensor([0.0, 1.0, 3.0, 4.5, 7.0], requires_grad=True)], dim=0)[0],
        0,
        [Replicate()],
    ),
    "prepend-shard-tensor-uneven": (lambda t: torch.diff(t, dim=0, prepend=t), 0, [Replicate()]),
    "prepend-shard-tensor-other-dim": (lambda t: torch.diff(t, dim=1, prepend=t), 1, None),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", sorted(DELEGATED_CONFIGURATIONS))
def test_configurations_the_fallback_handles_are_delegated(domain_mesh, name):
    fn, _, expected = DELEGATED_CONFIGURATIONS[name]
    x = torch.randn(5, 3)
    spec = ShardSpec(domain_mesh, [Shard(0)], [3, 2])
    check_conformance(fn, [x], spec, expected_placements=expected)
    out = fn(shard_tensor(x, domain_mesh, [Shard(0)], [3, 2]))
    with physicsnemo_shardext.disabled(plugins=["finite_differences"]):
        baseline = fn(shard_tensor(x, domain_mesh, [Shard(0)], [3, 2]))
    assert tuple(out._spec.placements) == tuple(baseline._spec.placements)
    torch.testing.assert_close(out.to_local(), baseline.to_local())


@pytest.mark.multirank(2)
def test_refused_configurations_and_torch_errors(domain_mesh, rank):
    x = shard_tensor(torch.randn(4, 6), domain_mesh, [Shard(0)], [3, 1])
    short = shard_tensor(torch.randn(2, 6), domain_mesh, [Shard(0)], [1, 1])
    with pytest.raises(RuntimeError, match="edge_order"):  # torch's own error, on every rank, before any exchange
        torch.gradient(short, dim=0, edge_order=2)
    with pytest.raises(RuntimeError, match="prepend"):
        torch.diff(x, dim=0, prepend=torch.randn(1, 5))


# (x sharded dim, x split, diff dim, extra shape, extra placement dim or None for Replicate, extra split)
SHARD_TENSOR_EXTRAS = {
    "replicate-extra-on-the-sharded-diff-dim": (1, [6, 1], 1, (3, 3, 5), None, None),
    "extra-sharded-on-the-diff-dim": (1, [6, 1], 1, (3, 3, 5), 1, [3, 0]),
    "extra-sharded-on-the-diff-dim-thin": (1, [6, 1], 1, (3, 3, 5), 1, [0, 3]),
    "other-dim-on-torch-chunks": (1, [4, 3], 2, (3, 7, 1), 1, [4, 3]),
    "replicate-extra-other-dim-on-torch-chunks": (1, [4, 3], 2, (3, 7, 1), None, None),
}


@pytest.mark.multirank(2)
@pytest.mark.parametrize("kw", ["prepend", "append"])
@pytest.mark.parametrize("name", sorted(SHARD_TENSOR_EXTRAS))
def test_shard_tensor_extras_are_delegated_where_the_fallback_is_right(domain_mesh, name, kw):
    xd, xsplit, dim, shape, ed, esplit = SHARD_TENSOR_EXTRAS[name]
    x, extra = torch.randn(3, 7, 5), torch.randn(shape)
    x_ref = x.clone().requires_grad_(True)
    ref = torch.diff(x_ref, dim=dim, **{kw: extra})
    weight = torch.randn(ref.shape)
    (ref * weight).sum().backward()
    runs = []
    for disabled in (False, True):
        xs = shard_tensor(x, domain_mesh, [Shard(xd)], xsplit, requires_grad=True)
        es = shard_tensor(extra, domain_mesh, [Replicate()] if ed is None else [Shard(ed)], esplit)
        if disabled:
            with physicsnemo_shardext.disabled(plugins=["finite_differences"]):
                out = torch.diff(xs, dim=dim, **{kw: es})
        else:
            out = torch.diff(xs, dim=dim, **{kw: es})
        torch.testing.assert_close(out.full_tensor(), ref)
        (out.full_tensor() * weight).sum().backward()
        torch.testing.assert_close(xs.grad.full_tensor(), x_ref.grad)
        runs.append((tuple(out._spec.placements), out.to_local(), xs.grad.to_local()))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1:], runs[1][1:])


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[6, 1], [7, 0]])
def test_shard_tensor_extras_off_the_diff_dim_on_other_splits_are_refused(domain_mesh, split):
    # Measured with the plugin off: the fallback raises ("Sizes of tensors must match"), or with an
    # input requiring grad one rank raises while the other hangs.
    xs = shard_tensor(torch.randn(3, 7, 5), domain_mesh, [Shard(1)], split, requires_grad=True)
    like_x = shard_tensor(torch.randn(3, 7, 1), domain_mesh, [Shard(1)], split)
    replicated = shard_tensor(torch.randn(3, 7, 1), domain_mesh, [Replicate()])
    for extra in (like_x, replicated):
        with pytest.raises(MissingShardPatch, match=r"prepend/append as a ShardTensor.*not torch.chunk's.*hangs"):
            torch.diff(xs, dim=2, prepend=extra)


@pytest.mark.multirank(2)
@pytest.mark.parametrize("split", [[4, 3], [6, 1], [7, 0]], ids=["4-3", "6-1", "7-0"])
@pytest.mark.parametrize("layout", ["replicate", "split-like-x"])
def test_shard_tensor_coordinates_are_delegated_where_the_fallback_is_right(domain_mesh, split, layout):
    x, coords = torch.randn(3, 7, 5), torch.linspace(0, 1, 7) ** 2
    x_ref = x.clone().requires_grad_(True)
    (ref,) = torch.gradient(x_ref, spacing=[coords], dim=1)
    weight = torch.randn(ref.shape)
    (ref * weight).sum().backward()
    runs = []
    for disabled in (False, True):
        xs = shard_tensor(x, domain_mesh, [Shard(1)], split, requires_grad=True)
        cs = shard_tensor(
            coords,
            domain_mesh,
            [Replicate()] if layout == "replicate" else [Shard(0)],
            None if layout == "replicate" else split,
        )
        if disabled:
            with physicsnemo_shardext.disabled(plugins=["finite_differences"]):
                (out,) = torch.gradient(xs, spacing=[cs], dim=1)
        else:
            (out,) = torch.gradient(xs, spacing=[cs], dim=1)
        torch.testing.assert_close(out.full_tensor(), ref)
        (out.full_tensor() * weight).sum().backward()
        torch.testing.assert_close(xs.grad.full_tensor(), x_ref.grad)
        runs.append((tuple(out._spec.placements), out.to_local()))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1])


@pytest.mark.multirank(2)
def test_shard_tensor_coordinates_split_unlike_x_are_refused(domain_mesh):
    xs = shard_tensor(torch.randn(3, 7, 5), domain_mesh, [Shard(1)], [6, 1])
    cs = shard_tensor(torch.linspace(0, 1, 7), domain_mesh, [Shard(0)], [4, 3])
    with pytest.raises(MissingShardPatch, match="coordinate tensors in spacing as DTensors, or as ShardTensors"):
        torch.gradient(xs, spacing=[cs], dim=1)
