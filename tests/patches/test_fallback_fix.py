"""Tests of the first-party fallback_fix plugin (patches/fallback_fix/) and its detection."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as shard_tensor_module
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import AttributeTarget, MissingShardPatch, PatchLevel
from physicsnemo_shardext.patches import fallback_fix
from physicsnemo_shardext.patches.fallback_fix import fallback_backward_is_defective, fixed_backward
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

OWNER = shard_tensor_module._ShardTensorToDTensor
TARGET = AttributeTarget(OWNER, "backward")


def test_plugins_are_loaded_through_their_entry_points():
    reports = {r.plugin.name: r for r in physicsnemo_shardext.get_registry().reports()}
    for name in ("fallback_fix",):
        assert reports[name].status.value == "loaded" and reports[name].plugin.distribution == "physicsnemo-shardext"


# Ops with no first-party patch whose DTensor fallback replicates the sharded dim.
FALLBACK_OPS = {
    "sort": lambda x: torch.sort(x, dim=2).values,
    "topk": lambda x: torch.topk(x, 2, dim=2).values,
    "tensor_sort": lambda x: x.sort(dim=2, descending=True)[0],
}


def test_probe_detects_the_defect_in_physicsnemo_2_2():
    assert fallback_backward_is_defective()  # PhysicsNeMo 2.2.2 + torch 2.14 is affected


def test_fix_is_installed_with_provenance_and_undone_exactly():
    registry = physicsnemo_shardext.get_registry()
    record = registry.provenance(TARGET, PatchLevel.ATTRIBUTE)
    assert record is not None and record.plugin.name == "fallback_fix"
    assert "shard_order" in record.declaration.description
    original = physicsnemo_shardext.builtin_handler(TARGET, PatchLevel.ATTRIBUTE)
    assert OWNER.__dict__["backward"].__func__ is fixed_backward
    assert original.__func__ is not fixed_backward
    with physicsnemo_shardext.disabled(plugins=["fallback_fix"]):
        assert OWNER.__dict__["backward"] is original
    assert OWNER.__dict__["backward"].__func__ is fixed_backward


def test_not_declared_where_the_probe_finds_no_defect(monkeypatch):
    from physicsnemo_shardext.declarations import PatchSet

    monkeypatch.setattr(fallback_fix, "fallback_backward_is_defective", lambda: False)
    patches = PatchSet("fallback_fix")
    fallback_fix.shardext_declare_patches(patches)
    attributes = [d.target_name for d in patches if d.level is PatchLevel.ATTRIBUTE]
    assert str(TARGET) not in attributes  # the Partial(avg) guard is declared regardless
    assert str(TARGET) in dict(patches.not_applicable)


# DTensor's own redistribution (inside the fallback *forward*) assumes torch.chunk sizes, so
# unequal shards are used here in chunk layout (7 -> 4+3, 3 -> 2+1), isolating the backward fix;
# other uneven sizes are covered for the backward by test_grad_layout_rules and, for the forward,
# by tests/patches/test_uneven_redistribute.py.
@pytest.mark.multirank(2)
@pytest.mark.parametrize(
    "name, length, split",
    [("sort", 7, [4, 3]), ("topk", 7, [4, 3]), ("tensor_sort", 3, [2, 1])],
    ids=["sort-uneven", "topk-uneven", "tensor_sort-tiny-shard"],
)
def test_fallback_ops_match_single_process_with_the_fix(domain_mesh, name, length, split):
    x = torch.randn(2, 3, length, 4)
    check_conformance(FALLBACK_OPS[name], [x], ShardSpec(domain_mesh, [Shard(2)], split), expected_placements=None)
    # The gradient has the input's own layout: Shard(2) and the input's uneven local sizes.
    xs = shard_tensor(x, domain_mesh, [Shard(2)], split, requires_grad=True)
    FALLBACK_OPS[name](xs).sum().backward()
    assert isinstance(xs.grad, ShardTensor) and tuple(xs.grad.placements) == (Shard(2),)
    assert xs.grad.to_local().shape == xs.to_local().shape
    assert xs.grad._spec.sharding_shapes() == xs._spec.sharding_shapes()


@pytest.mark.multirank(2)
@pytest.mark.parametrize("name", ["sort"])
def test_without_the_fix_the_fallback_backward_crashes(domain_mesh, name):
    x = torch.randn(2, 3, 7, 4)
    with physicsnemo_shardext.disabled(plugins=["fallback_fix"]):
        xs = shard_tensor(x, domain_mesh, [Shard(2)], [4, 3], requires_grad=True)
        y = FALLBACK_OPS[name](xs)
        with pytest.raises(AssertionError, match="shard_order"):
            y.sum().backward()


@pytest.mark.multirank(4)
def test_fallback_op_on_2d_mesh(spatial_mesh):
    # Sorting along H (sharded over mesh dim "h") while W stays sharded over "w".
    x = torch.randn(1, 2, 7, 5)
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [4, 3], 1: [3, 2]})
    check_conformance(lambda t: torch.sort(t, dim=2).values, [x], spec, expected_placements=None)


def _full(rank: int) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(2, 7, 3)


@pytest.mark.multirank(2)
def test_grad_layout_rules(domain_mesh, rank):
    """Replicate -> local slice; Partial over Shard -> reduced then sliced; even Shard -> re-cut to uneven."""
    from torch.distributed.tensor import distribute_tensor

    from physicsnemo_shardext.patches.fallback_fix import grad_in_input_layout

    full = _full(rank)
    primal = shard_tensor(full, domain_mesh, [Shard(1)], [6, 1])
    spec = primal._spec
    mine = slice(0, 6) if rank == 0 else slice(6, 7)

    replicated = DTensor.from_local(full, domain_mesh, [Replicate()], run_check=False)
    grad = grad_in_input_layout(replicated, spec)
    assert tuple(grad.placements) == (Shard(1),)
    torch.testing.assert_close(grad.to_local(), full[:, mine])

    partial = DTensor.from_local(full * (rank + 1), domain_mesh, [Partial()], run_check=False)
    grad = grad_in_input_layout(partial, spec)
    torch.testing.assert_close(grad.to_local(), 3 * full[:, mine])

    even = distribute_tensor(full, domain_mesh, [Shard(1)])  # torch's own 4/3 chunks
    grad = grad_in_input_layout(even, spec)
    assert grad.to_local().shape == (2, len(range(7)[mine]), 3)
    torch.testing.assert_close(grad.full_tensor(), full)


@pytest.mark.multirank(2)
def test_partial_grad_of_a_replicated_input_stays_partial(domain_mesh, rank):
    from physicsnemo_shardext.patches.fallback_fix import grad_in_input_layout

    full = _full(rank)
    primal = shard_tensor(full, domain_mesh, [Replicate()])
    partial = DTensor.from_local(full * (rank + 1), domain_mesh, [Partial()], run_check=False)
    grad = grad_in_input_layout(partial, primal._spec)
    assert tuple(grad.placements) == (Partial(),)
    torch.testing.assert_close(grad.to_local(), full * (rank + 1))  # no communication, sum still pending


# -- backward entry points (torch.Tensor.backward / torch.autograd.backward) ----------------
BACKWARD_ENTRIES = [torch.Tensor.backward, torch.autograd.backward]


class _CheckpointedConv(torch.nn.Module):
    """A halo-needing Conv2d whose forward is recomputed in backward by torch.utils.checkpoint."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.conv, x, use_reentrant=self.use_reentrant)


def test_backward_entry_handlers_are_installed_with_provenance():
    registry = physicsnemo_shardext.get_registry()
    for entry in BACKWARD_ENTRIES:
        assert fallback_fix.backward_entry_status(entry) is None  # needed on PhysicsNeMo 2.2.2 + torch 2.14
        record = registry.provenance(entry, PatchLevel.FUNCTION)
        assert record is not None and record.plugin.name == "fallback_fix"
        assert "conversion scope" in record.declaration.description
        assert ShardTensor._function_registry[entry] is fallback_fix.backward_in_shard_space
    with physicsnemo_shardext.disabled(targets=BACKWARD_ENTRIES):
        assert not any(entry in ShardTensor._function_registry for entry in BACKWARD_ENTRIES)


@pytest.mark.parametrize(
    "why, patch",
    [
        (
            "passthrough",
            lambda mp: mp.setattr(ShardTensor, "_autograd_passthrough_functions", frozenset(BACKWARD_ENTRIES)),
        ),
        ("private torch API", lambda mp: mp.delattr(torch.autograd.graph, "_engine_run_backward")),
    ],
)
def test_backward_entry_handlers_not_declared_where_not_needed_or_not_possible(monkeypatch, why, patch):
    from physicsnemo_shardext.declarations import PatchSet

    patch(monkeypatch)
    patches = PatchSet("fallback_fix")
    fallback_fix.shardext_declare_patches(patches)
    declared = {d.target for d in patches}
    assert not declared & set(BACKWARD_ENTRIES)
    skipped = dict(patches.not_applicable)
    assert set(skipped) >= {"Tensor.backward", "backward"}
    expected = "passthrough" if why == "passthrough" else "_engine_run_backward"
    assert all(expected in skipped[name] for name in ("Tensor.backward", "backward"))


@pytest.mark.multirank(2)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_sharded_conv_matches_single_process(domain_mesh, use_reentrant):
    torch.manual_seed(0)
    model, x = _CheckpointedConv(use_reentrant), torch.randn(1, 2, 8, 5)
    spec = ShardSpec(domain_mesh, [Shard(2)], [5, 3])  # uneven H split; the conv needs a 1-row halo
    check_conformance(model, [x], spec)
    if use_reentrant:
        return  # without the fix this one ends in DTensor's uneven tp_convolution exchange and kills a rank
    # Without the entry handlers the recomputation runs inside the fallback's conversion scope:
    # conv2d on the local shard with no halo, so the recomputed tensors (or their number) disagree with the saved ones.
    with physicsnemo_shardext.disabled(targets=BACKWARD_ENTRIES):
        with pytest.raises(Exception, match="(?i)recomputed|recomputation|shape|size"):
            check_conformance(model, [x], spec)


def _conv_and_sharded_input(domain_mesh: Any) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    conv, x = torch.nn.Conv2d(2, 3, 3, padding=1), torch.randn(1, 2, 8, 5)
    return conv, x, shard_tensor(x, domain_mesh, [Shard(2)], [5, 3], requires_grad=True)


@pytest.mark.multirank(2)
def test_backward_arguments_on_a_shard_tensor(domain_mesh):
    conv, x, xs = _conv_and_sharded_input(domain_mesh)
    ref_x = x.clone().requires_grad_(True)
    ref_conv = copy.deepcopy(conv)
    g = torch.randn(1, 3, 8, 5)

    # gradient=: a ShardTensor cotangent in the output's layout.
    ref_conv(ref_x).backward(gradient=g)
    conv(xs).backward(gradient=shard_tensor(g, domain_mesh, [Shard(2)], [5, 3]))
    torch.testing.assert_close(xs.grad.full_tensor(), ref_x.grad)
    torch.testing.assert_close(conv.weight.grad, ref_conv.weight.grad, rtol=1e-4, atol=1e-5)

    # retain_graph: a second backward works with it, and raises as in plain torch without it.
    xs.grad = None
    loss = conv(xs).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(xs.grad.full_tensor(), 2 * _ones_grad(ref_conv, x))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()

    # inputs=: only the named tensors receive gradients (ShardTensor alone, or plain parameters in a list).
    xs.grad, conv.weight.grad, conv.bias.grad = None, None, None
    conv(xs).sum().backward(inputs=xs)
    assert conv.weight.grad is None and conv.bias.grad is None
    torch.testing.assert_close(xs.grad.full_tensor(), _ones_grad(ref_conv, x))
    xs.grad = None
    torch.autograd.backward(conv(xs).sum(), inputs=[conv.weight])
    assert xs.grad is None and conv.bias.grad is None
    ref_conv.weight.grad = None
    ref_conv(x).sum().backward()
    torch.testing.assert_close(conv.weight.grad, ref_conv.weight.grad, rtol=1e-4, atol=1e-5)

    # A lone plain tensor as inputs= is promoted by PhysicsNeMo before any handler runs: refused, not lost.
    with pytest.raises(physicsnemo_shardext.MissingShardPatch, match=r"inputs=.*inputs=\[t\]"):
        conv(xs).sum().backward(inputs=conv.weight)


@pytest.mark.multirank(2)
def test_autograd_backward_grad_tensors_create_graph_and_grad_variables(domain_mesh):
    conv, x, xs = _conv_and_sharded_input(domain_mesh)
    g = torch.randn(1, 3, 8, 5)
    gs = shard_tensor(g, domain_mesh, [Shard(2)], [5, 3])
    ref_x = x.clone().requires_grad_(True)
    torch.autograd.backward([copy.deepcopy(conv)(ref_x)], grad_tensors=[g])

    torch.autograd.backward([conv(xs)], grad_tensors=[gs])
    torch.testing.assert_close(xs.grad.full_tensor(), ref_x.grad)

    # create_graph=True makes retain_graph default to True, as in plain torch. Even shards and a
    # pointwise op: a differentiable backward runs aten ops through PhysicsNeMo's dispatch-level
    # DTensor fallback, which assumes torch.chunk sizes (a PhysicsNeMo limit, not this handler's).
    xe = shard_tensor(x, domain_mesh, [Shard(2)], [4, 4], requires_grad=True)
    y = xe * xe
    torch.autograd.backward(y, xe.detach(), create_graph=True)
    torch.autograd.backward(y, xe.detach())
    torch.testing.assert_close(xe.grad.full_tensor().detach(), 4 * x * x)

    xs.grad = None
    with pytest.warns(FutureWarning, match="grad_variables"):
        torch.autograd.backward([conv(xs)], grad_variables=[gs])
    torch.testing.assert_close(xs.grad.full_tensor(), ref_x.grad)
    with pytest.raises(RuntimeError, match="cannot be empty"):
        torch.autograd.backward([conv(xs)], [gs], inputs=[])


def _ones_grad(conv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Single-process d(sum(conv(x)))/dx."""
    ref_x = x.clone().requires_grad_(True)
    copy.deepcopy(conv)(ref_x).sum().backward()
    return ref_x.grad


# -- metadata reads -------------------------------------------------------------------------
METADATA_READS = {
    "shape": lambda x: tuple(x.shape),
    "ndim": lambda x: x.ndim,
    "dim": lambda x: x.dim(),
    "ndimension": lambda x: x.ndimension(),
    "size": lambda x: tuple(x.size()),
    "size(d)": lambda x: x.size(-2),
    "numel": lambda x: x.numel(),
    "nelement": lambda x: x.nelement(),
    "dtype": lambda x: x.dtype,
    "device": lambda x: x.device,
    "layout": lambda x: x.layout,
    "is_cuda": lambda x: x.is_cuda,
    "is_floating_point": lambda x: x.is_floating_point(),
    "is_complex": lambda x: x.is_complex(),
    "element_size": lambda x: x.element_size(),
}


def test_metadata_passthrough_is_installed_with_provenance_and_undone_exactly():
    target = AttributeTarget(ShardTensor, "_autograd_passthrough_functions")
    record = physicsnemo_shardext.get_registry().provenance(target, PatchLevel.ATTRIBUTE)
    assert record is not None and record.plugin.name == "fallback_fix"
    original = physicsnemo_shardext.builtin_handler(target, PatchLevel.ATTRIBUTE)
    assert fallback_fix.METADATA_GETTERS <= ShardTensor._autograd_passthrough_functions
    assert original <= ShardTensor._autograd_passthrough_functions  # PhysicsNeMo's own entries stay
    with physicsnemo_shardext.disabled(plugins=["fallback_fix"]):
        assert ShardTensor.__dict__["_autograd_passthrough_functions"] is original
        assert not fallback_fix.METADATA_GETTERS & original
    assert fallback_fix.METADATA_GETTERS <= ShardTensor._autograd_passthrough_functions


@pytest.mark.multirank(4)
@pytest.mark.parametrize(
    "placements,sizes",
    [
        ([Shard(2), Replicate()], {0: [6, 3]}),
        ([Shard(2), Shard(3)], {0: [6, 3], 1: [1, 4]}),
        ([Partial(), Shard(1)], {1: [2, 1]}),
    ],
    ids=["shard-replicate", "shard-shard", "partial-shard"],
)
def test_metadata_reads_answer_what_the_fallback_answers_without_it(spatial_mesh, placements, sizes, monkeypatch):
    """Each read, with the passthrough, equals the DTensor fallback's answer, and no longer converts to DTensor."""
    full = torch.randn(2, 3, 9, 5, dtype=torch.float64)
    x = shard_tensor(full, spatial_mesh, placements, sizes, requires_grad=True)
    conversions = []
    convert = shard_tensor_module._convert_args_to_dtensor

    def counting(*args, **kwargs):
        conversions.append(args[0])
        return convert(*args, **kwargs)

    monkeypatch.setattr(shard_tensor_module, "_convert_args_to_dtensor", counting)
    for name, read in METADATA_READS.items():
        conversions.clear()
        fast = read(x)
        assert conversions == [], name
        with physicsnemo_shardext.disabled(plugins=["fallback_fix"]):
            slow = read(x)
        assert conversions, name  # without the passthrough the read converted x to a DTensor
        assert fast == slow == read(full), name


@pytest.mark.multirank(2)
def test_an_in_place_update_used_after_the_statement_keeps_its_gradient(domain_mesh):
    # y.mul_(2) through the fallback changed y's values but left y's history stale: the
    # gradient of y.sum() reached x as 1, not 2 (silently wrong; y = y.mul_(2) was right).
    full = torch.randn(7, 2, 7)

    def fn(t):
        y = t * 1.0
        y.mul_(2.0)
        y += 1.0
        return y * y

    check_conformance(fn, [full], ShardSpec(domain_mesh, [Shard(2)], [3, 4]))


@pytest.mark.multirank(2)
def test_an_op_whose_fallback_result_is_sized_as_even_chunks_is_refused_by_name(domain_mesh):
    # HEALPix padding's t.rot90(1, (-2, -1)) on rows 5/3: PhysicsNeMo's spec inference raised a bare
    # "Rank 0 expected local shape (2, 3, 4) does not match ..." naming neither the op nor a way out.
    x = shard_tensor(torch.randn(2, 8, 3), domain_mesh, [Shard(1)], [5, 3])
    with pytest.raises(MissingShardPatch, match=r"torch\.Tensor\.rot90: the DTensor fallback sizes its result"):
        x.rot90(1, (-2, -1))
    even = shard_tensor(torch.arange(48.0).reshape(2, 8, 3), domain_mesh, [Shard(1)], [4, 4])
    torch.testing.assert_close(even.rot90(2, (-2, -1)).full_tensor(), even.full_tensor().rot90(2, (-2, -1)))


@pytest.mark.multirank(2)
def test_operators_named_like_in_place_ones_leave_their_operand_alone(domain_mesh):
    # ~mask (Tensor.__invert__) starts with "__i" but is not in place: it must not be mistaken for
    # `mask ^= ...` and have its result written back into mask.
    full = torch.tensor([True, False, True, True, False, False, True, False])
    mask = shard_tensor(full, domain_mesh, [Shard(0)], [5, 3])
    inverted = ~mask
    torch.testing.assert_close(inverted.full_tensor(), ~full)
    torch.testing.assert_close(mask.full_tensor(), full)
    values = shard_tensor(torch.arange(8.0), domain_mesh, [Shard(0)], [5, 3], requires_grad=True)
    negated = -(values * 1.0)  # __neg__: not in place either
    torch.testing.assert_close(negated.full_tensor(), -torch.arange(8.0))
