"""Tests of the first-party losses plugin (patches/losses.py) and the fallback's Partial(avg) guard.

Every case compares the loss value and every gradient (input, a trainable target,
weights, variances) with single-process, under a random cotangent (so a uniformly
scaled gradient fails), on even, uneven and empty shards, with the target sharded
like the input and replicated, on 2 ranks and on a 2x2 mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.patches.losses import class_loss, elementwise_loss, sharded_norm
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

SPLITS = {"even": (16, [8, 8]), "uneven": (17, [9, 8]), "empty": (17, [17, 0])}
REDUCTIONS = ("none", "sum", "mean")


def _pm_one(shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.randint(0, 2, shape) * 2 - 1).float()


# name -> (loss(x, *operands, reduction=...), operands(shape), reductions)
ELEMENTWISE_CASES: dict[str, tuple[Callable, Callable, tuple[str, ...]]] = {
    "mse": (F.mse_loss, lambda s: [torch.randn(s)], REDUCTIONS),
    "mse-weighted": (
        lambda x, t, w, **kw: F.mse_loss(x, t, weight=w, **kw),
        lambda s: [torch.randn(s), torch.rand(s)],
        REDUCTIONS,
    ),
    "l1": (F.l1_loss, lambda s: [torch.randn(s)], REDUCTIONS),
    "l1-weighted": (
        lambda x, t, w, **kw: F.l1_loss(x, t, weight=w, **kw),
        lambda s: [torch.randn(s), torch.rand(s)],
        REDUCTIONS,
    ),
    "smooth-l1": (lambda x, t, **kw: F.smooth_l1_loss(x, t, beta=0.5, **kw), lambda s: [torch.randn(s)], REDUCTIONS),
    "huber": (lambda x, t, **kw: F.huber_loss(x, t, delta=0.7, **kw), lambda s: [torch.randn(s)], REDUCTIONS),
    "bce": (
        lambda x, t, **kw: F.binary_cross_entropy(torch.sigmoid(x), t, **kw),
        lambda s: [torch.rand(s)],
        REDUCTIONS,
    ),
    "bce-logits": (
        lambda x, t, w, **kw: F.binary_cross_entropy_with_logits(x, t, weight=w.detach(), **kw),
        lambda s: [torch.rand(s), torch.rand(s)],
        REDUCTIONS,
    ),
    "kl-div": (
        lambda x, t, **kw: F.kl_div(F.log_softmax(x, dim=1), F.softmax(t, dim=1), **kw),
        lambda s: [torch.randn(s)],
        (*REDUCTIONS, "batchmean"),
    ),
    "gaussian-nll": (
        lambda x, t, v, **kw: F.gaussian_nll_loss(x, t, v, **kw),
        lambda s: [torch.randn(s), torch.rand(s) + 0.1],
        REDUCTIONS,
    ),
    "poisson-nll": (F.poisson_nll_loss, lambda s: [torch.rand(s) * 3], REDUCTIONS),
    "soft-margin": (lambda x, t, **kw: F.soft_margin_loss(x, t.detach(), **kw), lambda s: [_pm_one(s)], REDUCTIONS),
    "hinge-embedding": (F.hinge_embedding_loss, lambda s: [_pm_one(s)], REDUCTIONS),
    "margin-ranking": (F.margin_ranking_loss, lambda s: [torch.randn(s), _pm_one(s)], REDUCTIONS),
}


def _loss_fn(loss: Callable, reduction: str) -> Callable:
    def fn(*tensors: torch.Tensor) -> torch.Tensor:
        out = loss(*tensors, reduction=reduction)
        return out

    return fn


def _expected(reduction: str, placements: list) -> object:
    return "input" if reduction == "none" else [[Replicate()] * len(placements)]


def _check_elementwise(name: str, mesh, placements, splits, shape, target_sharded: bool | str) -> None:
    """``target_sharded``: True (sharded like the input), False (plain), or "replicate" (a Replicate ShardTensor)."""
    loss, operands, reductions = ELEMENTWISE_CASES[name]
    x = torch.randn(shape)
    others = operands(shape)
    spec = ShardSpec(mesh, placements, splits)
    other_spec = {True: spec, False: None, "replicate": ShardSpec(mesh, [Replicate()] * mesh.ndim)}[target_sharded]
    specs = [spec] + [other_spec for _ in others]
    for reduction in reductions:
        check_conformance(
            _loss_fn(loss, reduction),
            [x, *others],
            specs,
            count_comms=False,
            expected_placements=_expected(reduction, placements),
            rtol=1e-4,
            atol=1e-5,
        )


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("name", sorted(ELEMENTWISE_CASES))
def test_elementwise_losses_match_single_process_on_a_1d_mesh(domain_mesh, name):
    for rows, splits in SPLITS.values():
        for target_sharded in (True, False):
            _check_elementwise(name, domain_mesh, [Shard(2)], splits, (1, 3, rows, 4), target_sharded)


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("name", sorted(ELEMENTWISE_CASES))
def test_elementwise_losses_with_replicate_shard_tensor_targets(domain_mesh, name):
    # The training guidance scatters targets with Replicate: the fallback raised a shape
    # error on any split other than torch.chunk's (9/8 is chunk's; 13/4 and 17/0 are not).
    for splits in ([13, 4], [17, 0], [9, 8]):
        _check_elementwise(name, domain_mesh, [Shard(2)], splits, (1, 3, 17, 4), "replicate")


@pytest.mark.multirank(4, timeout=120)
@pytest.mark.parametrize("name", ["mse", "mse-weighted", "huber", "bce-logits", "kl-div", "gaussian-nll"])
def test_elementwise_losses_match_single_process_on_a_2x2_mesh(spatial_mesh, name):
    for target_sharded in (True, False):
        _check_elementwise(
            name, spatial_mesh, [Shard(2), Shard(3)], {0: [5, 4], 1: [3, 0]}, (1, 3, 9, 3), target_sharded
        )


@pytest.mark.multirank(2)
def test_gaussian_nll_with_variance_missing_the_last_dim(domain_mesh):
    x, t, var = torch.randn(1, 17, 3), torch.randn(1, 17, 3), torch.rand(1, 17) + 0.1
    for reduction in REDUCTIONS:
        check_conformance(
            lambda a, b: F.gaussian_nll_loss(a, b, var, reduction=reduction),
            [x, t],
            ShardSpec(domain_mesh, [Shard(1)], [9, 8]),
            count_comms=False,
            expected_placements=_expected(reduction, [Shard(1)]),
        )


def _class_inputs(probabilities: bool, shape: tuple[int, ...]) -> list[torch.Tensor]:
    x = torch.randn(shape)
    if probabilities:
        return [x, torch.softmax(torch.randn(shape), dim=1)]
    target = torch.randint(0, shape[1], shape[:1] + shape[2:])
    target.view(-1)[::5] = 2  # a class that ignore_index hides below
    return [x, target]


CLASS_OPTIONS = {
    "plain": {},
    "weighted": {"weight": torch.tensor([0.2, 1.0, 0.5, 2.0, 0.7])},
    "ignore-index": {"ignore_index": 2},
    "weighted-ignore-smoothing": {
        "weight": torch.tensor([0.2, 1.0, 0.5, 2.0, 0.7]),
        "ignore_index": 2,
        "label_smoothing": 0.1,
    },
}


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("loss", [F.cross_entropy, F.nll_loss], ids=["cross-entropy", "nll"])
@pytest.mark.parametrize("option", sorted(CLASS_OPTIONS))
def test_class_losses_match_single_process(domain_mesh, loss, option):
    options = dict(CLASS_OPTIONS[option])
    if loss is F.nll_loss:
        options.pop("label_smoothing", None)
    for rows, splits in SPLITS.values():
        x, target = _class_inputs(False, (1, 5, rows, 3))
        for target_spec in (ShardSpec(domain_mesh, [Shard(1)], splits), None):
            for reduction in REDUCTIONS:

                def fn(a, t, reduction=reduction):
                    a = F.log_softmax(a, dim=1) if loss is F.nll_loss else a
                    return loss(a, t, reduction=reduction, **options)

                check_conformance(
                    fn,
                    [x, target],
                    [ShardSpec(domain_mesh, [Shard(2)], splits), target_spec],
                    count_comms=False,
                    expected_placements=None,
                )


@pytest.mark.multirank(2)
def test_cross_entropy_with_probability_targets_and_on_tokens(domain_mesh):
    for reduction in REDUCTIONS:
        x, probs = _class_inputs(True, (1, 5, 17, 3))
        check_conformance(
            lambda a, p: F.cross_entropy(a, p, label_smoothing=0.05, reduction=reduction),
            [x, probs],
            ShardSpec(domain_mesh, [Shard(2)], [9, 8]),
            count_comms=False,
            expected_placements=None,
        )
        tokens, labels = torch.randn(13, 5), torch.randint(0, 5, (13,))
        check_conformance(
            lambda a, t: F.cross_entropy(a, t, reduction=reduction),
            [tokens, labels],
            ShardSpec(domain_mesh, [Shard(0)], [13, 0]),
            count_comms=False,
            expected_placements=None,
        )


@pytest.mark.multirank(4, timeout=120)
def test_cross_entropy_on_a_2x2_mesh(spatial_mesh):
    x, target = _class_inputs(False, (1, 5, 9, 3))
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [5, 4], 1: [2, 1]})
    target_spec = ShardSpec(spatial_mesh, [Shard(1), Shard(2)], {0: [5, 4], 1: [2, 1]})
    for t_spec in (target_spec, None):
        check_conformance(
            lambda a, t: F.cross_entropy(a, t, **CLASS_OPTIONS["weighted-ignore-smoothing"]),
            [x, target],
            [spec, t_spec],
            count_comms=False,
            expected_placements=None,
        )


@pytest.mark.multirank(2)
def test_loss_modules_match_single_process(domain_mesh):
    spec = ShardSpec(domain_mesh, [Shard(2)], [9, 8])
    x, t = torch.randn(1, 3, 17, 4), torch.randn(1, 3, 17, 4)
    for module in (
        torch.nn.MSELoss(),
        torch.nn.L1Loss(reduction="sum"),
        torch.nn.SmoothL1Loss(),
        torch.nn.HuberLoss(),
        torch.nn.BCEWithLogitsLoss(pos_weight=torch.rand(4)),
        torch.nn.GaussianNLLLoss(),
    ):
        inputs = [x, t.sigmoid()] if isinstance(module, torch.nn.BCEWithLogitsLoss) else [x, t]
        if isinstance(module, torch.nn.GaussianNLLLoss):
            check_conformance(
                lambda a, b: module(a, b, torch.ones_like(b)), inputs, spec, count_comms=False, expected_placements=None
            )
            continue
        check_conformance(module, inputs, spec, count_comms=False, expected_placements=None, params="plain")
    target = torch.randint(0, 3, (1, 17, 4))
    check_conformance(
        torch.nn.CrossEntropyLoss(),
        [x, target],
        [spec, ShardSpec(domain_mesh, [Shard(1)], [9, 8])],
        count_comms=False,
        expected_placements=None,
        params="plain",
    )


@pytest.mark.multirank(2)
def test_a_loss_costs_one_scalar_all_reduce(domain_mesh):
    report = check_conformance(
        F.mse_loss,
        [torch.randn(1, 3, 17, 4), torch.randn(1, 3, 17, 4)],
        ShardSpec(domain_mesh, [Shard(2)], [9, 8]),
        expected_placements=[[Replicate()]],
    )
    assert report.comms.forward.total_calls == 1
    assert report.comms.forward.total_bytes == 4  # one float32 scalar
    assert report.comms.backward.total_calls == 0


@pytest.mark.multirank(2)
def test_sgd_training_tracks_single_process(domain_mesh):
    """A uniformly scaled gradient (the Partial(avg) defect) shows under SGD; here it must not."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 2, 3, padding=1)
    x, target = torch.randn(1, 2, 17, 6), torch.randn(1, 2, 17, 6)
    reference, sharded = [conv, torch.nn.Conv2d(2, 2, 3, padding=1)]
    sharded.load_state_dict(reference.state_dict())
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt_shd = torch.optim.SGD(sharded.parameters(), lr=0.1)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [9, 8])
    ts = shard_tensor(target, domain_mesh, [Shard(2)], [9, 8])
    for _ in range(3):
        losses = []
        for model, opt, inp, tgt in ((reference, opt_ref, x, target), (sharded, opt_shd, xs, ts)):
            opt.zero_grad()
            loss = F.mse_loss(model(inp), tgt)
            loss.backward()  # plain parameters: the conv patch sums their gradients over the shards
            opt.step()
            losses.append(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        torch.testing.assert_close(losses[1], losses[0].detach(), rtol=1e-5, atol=1e-6)
    for p_ref, p_shd in zip(reference.parameters(), sharded.parameters()):
        torch.testing.assert_close(p_shd, p_ref, rtol=1e-5, atol=1e-6)


# -- mean, norms, var/std ------------------------------------------------------------------
REDUCTION_CASES: dict[str, Callable] = {
    "mean": lambda x: x.mean(),
    "torch-mean-dim": lambda x: torch.mean(x, dim=2),
    "mean-dims-keepdim": lambda x: x.mean(dim=(1, 2), keepdim=True),
    "mean-unsharded-dim": lambda x: x.mean(dim=-1),
    "vector-norm": lambda x: torch.linalg.vector_norm(x),
    "vector-norm-l1-dim": lambda x: torch.linalg.vector_norm(x, ord=1, dim=2),
    "vector-norm-3-keepdim": lambda x: torch.linalg.vector_norm(x, ord=3, dim=(2, 3), keepdim=True),
    "linalg-norm": lambda x: torch.linalg.norm(x),
    "linalg-norm-fro": lambda x: torch.linalg.norm(x, ord="fro", dim=(2, 3)),
    "torch-norm": lambda x: torch.norm(x, dim=2),
    "tensor-norm-p1": lambda x: x.norm(p=1),
    "relative-l2": lambda x: torch.linalg.norm(x - 1.0) / torch.linalg.norm(x),
    "normalized": lambda x: x / torch.linalg.vector_norm(x),
    "centered": lambda x: x - x.mean(dim=2, keepdim=True),
    "var": lambda x: x.var(),
    "std-dim": lambda x: x.std(dim=2),
    "var-correction0-keepdim": lambda x: x.var(dim=(2, 3), correction=0, keepdim=True),
    "std-mean": lambda x: torch.std_mean(x, dim=2),
    "var-unbiased-false": lambda x: torch.var(x, 2, False, True),
    "standardized": lambda x: (x - x.mean()) / x.std(),
}


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("name", sorted(REDUCTION_CASES))
def test_reductions_match_single_process(domain_mesh, name):
    for rows, splits in SPLITS.values():
        check_conformance(
            REDUCTION_CASES[name],
            [torch.randn(1, 3, rows, 4)],
            ShardSpec(domain_mesh, [Shard(2)], splits),
            count_comms=False,
            expected_placements=None,
        )


@pytest.mark.multirank(4, timeout=120)
@pytest.mark.parametrize("name", ["mean", "torch-mean-dim", "vector-norm", "torch-norm", "relative-l2", "std-dim"])
def test_reductions_match_single_process_on_a_2x2_mesh(spatial_mesh, name):
    check_conformance(
        REDUCTION_CASES[name],
        [torch.randn(1, 3, 9, 3)],
        ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [5, 4], 1: [3, 0]}),
        count_comms=False,
        expected_placements=None,
    )


@pytest.mark.multirank(2)
def test_cosine_similarity_over_a_sharded_and_an_unsharded_dim(domain_mesh):
    x, y = torch.randn(1, 3, 17, 4), torch.randn(1, 3, 17, 4)
    spec = ShardSpec(domain_mesh, [Shard(2)], [9, 8])
    check_conformance(
        lambda a, b: F.cosine_similarity(a, b, dim=1).mean(), [x, y], spec, count_comms=False, expected_placements=None
    )
    check_conformance(
        lambda a, b: (1 - F.cosine_similarity(a, b, dim=2)).sum(),
        [x, y],
        spec,
        count_comms=False,
        expected_placements=None,
    )


@pytest.mark.multirank(2)
def test_norm_results_are_replicated_where_reduced_and_sharded_elsewhere(domain_mesh):
    xs = shard_tensor(torch.randn(1, 3, 17, 4), domain_mesh, [Shard(2)], [9, 8])
    assert tuple(torch.linalg.vector_norm(xs)._spec.placements) == (Replicate(),)
    kept = torch.linalg.vector_norm(xs, dim=1)
    assert tuple(kept._spec.placements) == (Shard(1),) and kept.shape == (1, 17, 4)


# -- delegation and the Partial(avg) guard -------------------------------------------------
def test_loss_and_norm_handlers_are_installed_with_provenance():
    registry = physicsnemo_shardext.get_registry()
    assert registry.provenance(F.mse_loss).declaration.handler is elementwise_loss
    assert registry.provenance(F.cross_entropy).declaration.handler is class_loss
    assert registry.provenance(torch.linalg.vector_norm).declaration.handler is sharded_norm


@pytest.mark.multirank(2)
def test_differently_sharded_operands_are_delegated_to_the_fallback(domain_mesh):
    """Mismatched splits are not this handler's case: the DTensor fallback answers (here: it refuses loudly)."""
    x = shard_tensor(torch.randn(1, 3, 17, 4), domain_mesh, [Shard(2)], [9, 8], requires_grad=True)
    t = shard_tensor(torch.randn(1, 3, 17, 4), domain_mesh, [Shard(2)], [10, 7])
    with physicsnemo_shardext.disabled(plugins=["losses"]):
        try:
            expected = F.l1_loss(x, t, reduction="sum").full_tensor()
        except Exception as error:  # the fallback's own answer, whatever it is, must be what we give
            expected = type(error)
    try:
        got = F.l1_loss(x, t, reduction="sum").full_tensor()
    except Exception as error:
        got = type(error)
    if isinstance(expected, type):
        assert got is expected
    else:
        torch.testing.assert_close(got, expected)


@pytest.mark.multirank(2)
def test_norm_over_unsharded_dims_is_delegated(domain_mesh):
    xs = shard_tensor(torch.randn(1, 3, 17, 4), domain_mesh, [Shard(2)], [9, 8])
    with physicsnemo_shardext.disabled(plugins=["losses"]):
        expected = torch.linalg.vector_norm(xs, dim=3)
    got = torch.linalg.vector_norm(xs, dim=3)
    assert tuple(got._spec.placements) == tuple(expected._spec.placements)
    torch.testing.assert_close(got.full_tensor(), expected.full_tensor())


@pytest.mark.multirank(2)
def test_without_the_plugin_partial_avg_results_are_refused_not_wrong(domain_mesh):
    full, target = torch.randn(1, 3, 17, 4), torch.randn(1, 3, 17, 4)
    with physicsnemo_shardext.disabled(plugins=["losses"]):
        xs = shard_tensor(full, domain_mesh, [Shard(2)], [9, 8], requires_grad=True)
        with pytest.raises(MissingShardPatch, match=r"mse_loss: the DTensor fallback returns a Partial\(avg\)"):
            F.mse_loss(xs, shard_tensor(target, domain_mesh, [Shard(2)], [9, 8]))
        even = shard_tensor(full[:, :, :16], domain_mesh, [Shard(2)], [8, 8], requires_grad=True)
        with pytest.raises(MissingShardPatch, match="gradient would be scaled by the mesh size"):
            F.mse_loss(even, shard_tensor(target[:, :, :16], domain_mesh, [Shard(2)], [8, 8]))
        with torch.no_grad():  # equal shards, no gradient: the fallback's value is right and let through
            value = F.mse_loss(even, shard_tensor(target[:, :, :16], domain_mesh, [Shard(2)], [8, 8]))
        torch.testing.assert_close(value.full_tensor(), F.mse_loss(full[:, :, :16], target[:, :, :16]))


@pytest.mark.multirank(2)
def test_without_the_guard_the_fallback_scales_gradients_by_the_mesh_size(domain_mesh, world_size):
    """The defect the guard exists for, measured: the unguarded fallback's mse gradient is N times too large."""
    from physicsnemo.domain_parallel import shard_tensor as st_module

    from physicsnemo_shardext import AttributeTarget
    from physicsnemo_shardext.shard_registries import original_attribute

    unguarded = original_attribute(AttributeTarget(st_module, "_torch_function_fallback_via_dtensor"))
    assert unguarded is not st_module._torch_function_fallback_via_dtensor  # the guard is installed
    full, target = torch.randn(1, 3, 16, 4), torch.randn(1, 3, 16, 4)
    reference = full.clone().requires_grad_()
    F.mse_loss(reference, target).backward()
    xs = shard_tensor(full, domain_mesh, [Shard(2)], [8, 8], requires_grad=True)
    unguarded(F.mse_loss, (xs, shard_tensor(target, domain_mesh, [Shard(2)], [8, 8])), {}).backward()
    torch.testing.assert_close(xs.grad.full_tensor(), world_size * reference.grad)
    xs.grad = None
    F.mse_loss(xs, shard_tensor(target, domain_mesh, [Shard(2)], [8, 8])).backward()  # the plugin's handler
    torch.testing.assert_close(xs.grad.full_tensor(), reference.grad)


def test_l1_loss_is_wrapped_only_where_torch_drops_its_weight():
    from physicsnemo_shardext.patches import losses

    if losses.l1_loss_drops_weight():
        assert F.l1_loss is losses.l1_loss_keeping_weight
    with physicsnemo_shardext.disabled(plugins=["losses"]):
        assert F.l1_loss is losses._ORIGINAL_L1_LOSS
    # The wrapper is transparent on plain tensors, weight or not.
    x, t, w = torch.randn(3, 4), torch.randn(3, 4), torch.rand(3, 4)
    torch.testing.assert_close(losses.l1_loss_keeping_weight(x, t, weight=w), (w * (x - t).abs()).sum() / w.sum())
    torch.testing.assert_close(losses.l1_loss_keeping_weight(x, t), (x - t).abs().mean())
