"""Tests of physicsnemo_shardext.training.verification: hybrid training against single-process training.

Each multi-rank case trains a tiny CNN (Conv2d, GELU, Conv2d; H sharded unevenly
where the split allows it) on 4 gloo CPU ranks with `verify_training` and
requires every loss, first-step gradient and final parameter within 1e-5
(relative to the reference tensor's largest magnitude).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from training_models import PosCNN

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.torch_support import compiles_empty_shards
from physicsnemo_shardext.training.parallel import ParallelLayout, build_layout
from physicsnemo_shardext.training.verification import TensorError, TrainingReport, relative_error, verify_training

# --------------------------------------------------------------------------- pure parts


def test_relative_error_is_normalised_by_the_references_largest_magnitude():
    assert relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])) == (2.0, 0.5)
    assert relative_error(torch.tensor([0.5]), torch.tensor([0.0])) == (0.5, 0.5)  # zero reference: absolute
    assert relative_error(torch.ones(2), torch.ones(3)) == (float("inf"), float("inf"))  # shape mismatch


def _report(**changes):
    values = dict(
        sharded_losses=[1.0, 0.9],
        reference_losses=[1.0, 0.9],
        loss_error=0.0,
        outputs={"output (step 0)": TensorError(0.0, 0.0)},
        gradients={"0.weight": TensorError(1e-8, 1e-7), "0.bias": TensorError(3e-6, 2e-6)},
        parameters={"0.weight": TensorError(0.0, 0.0)},
        params_identical_across_ranks=True,
        rank_spread=0.0,
        rtol=1e-5,
        wrapper="fsdp2",
        mesh_shape=(2, 2),
    )
    values.update(changes)
    return TrainingReport(**values)


def test_report_verdict_and_worst_tensor():
    report = _report()
    assert report.ok and report.worst_tensor == "grad 0.bias"
    assert "training check ok" in report.format() and "grad 0.bias" in report.format()
    assert not _report(loss_error=1e-3).ok
    assert not _report(params_identical_across_ranks=False, rank_spread=1e-7).ok
    bad = _report(parameters={"0.weight": TensorError(0.2, 0.1)})
    assert not bad.ok and bad.worst_tensor == "param 0.weight"
    text = bad.format()
    assert text.splitlines()[0].startswith("training check FAILED") and "param 0.weight: rel error 1.000e-01" in text
    assert _report(outputs={}, gradients={}, parameters={}).worst is None


# --------------------------------------------------------------------------- training on 4 ranks


@functools.cache
def _layout(ddp: int) -> ParallelLayout:
    return build_layout(ddp=ddp)


def tiny_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 1, 3, padding=1))


def _batches(ddp: int, count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(ddp, 2, 9, 6), torch.randn(ddp, 1, 9, 6)) for _ in range(count)]


#: H = 9 rows over the domain ranks: uneven where that keeps torch.chunk's split
#: incompatible parameters out (pos_embed is split like torch.chunk).
SIZES = {1: [3, 2, 4, 0], 2: [6, 3], 4: None}

CASES = {
    "ddp-2x2": (2, "ddp", tiny_cnn, (), "sgd"),
    "ddp-4x1": (4, "ddp", tiny_cnn, (), "sgd"),
    "fsdp2-2x2": (2, "fsdp2", tiny_cnn, (), "adam"),
    "fsdp2-1x4": (1, "fsdp2", tiny_cnn, (), "sgd"),
    "none-1x4": (1, "none", tiny_cnn, (), "adamw"),
    "ddp-2x2-plain-pos_embed": (2, "ddp", PosCNN, (), "sgd"),
    "fsdp2-2x2-sharded-pos_embed": (2, "fsdp2", PosCNN, ("pos_embed",), "adam"),
}


@pytest.mark.multirank(4, timeout=240)
@pytest.mark.parametrize("case", list(CASES))
def test_training_matches_single_process(rank, case):
    ddp, wrapper, make_model, spatial, optimizer = CASES[case]
    layout = _layout(ddp)
    sizes = [5, 4] if spatial else SIZES[ddp]
    report = verify_training(
        make_model,
        _batches(ddp),
        layout,
        shard_dim=2,
        sizes=sizes,
        wrapper=wrapper,
        spatial_parameters=spatial,
        spatial_dim=2,
        steps=3,
        optimizer=optimizer,
    )
    print(report.format())
    assert report.ok, report.format()
    names = {n for n, _ in make_model().named_parameters()}
    assert set(report.gradients) == names and set(report.parameters) == names  # every parameter compared
    assert report.params_identical_across_ranks and len(report.sharded_losses) == len(report.losses) == 3
    worst = report.worst
    assert worst is not None and worst[1].relative <= 1e-5


@pytest.mark.multirank(4)
def test_a_doubled_gradient_is_caught_and_named(rank):
    def doubled() -> nn.Module:
        model = tiny_cnn()
        # a hook on the built model only: deepcopy (the reference) does not copy tensor hooks
        model[0].weight.register_hook(lambda grad: 2 * grad)
        return model

    report = verify_training(doubled, _batches(2), _layout(2), shard_dim=2, sizes=[6, 3], wrapper="ddp", steps=2)
    assert not report.ok
    assert report.worst_tensor == "grad 0.weight"
    assert report.gradients["0.weight"].relative == pytest.approx(1.0, rel=1e-4)
    assert report.gradients["0.bias"].relative <= 1e-5  # the others still match
    assert "FAILED" in report.format() and "grad 0.weight" in report.format()


@pytest.mark.multirank(4)
def test_inference_only(rank):
    report = verify_training(
        tiny_cnn, _batches(2), _layout(2), shard_dim=2, sizes=[9, 0], wrapper="none", steps=2, train=False
    )
    assert report.ok, report.format()
    assert set(report.outputs) == {"output (step 0)", "output (step 1)"} and not report.gradients
    assert report.format().startswith("inference check ok")


@pytest.mark.multirank(4)
def test_bad_arguments(rank):
    with pytest.raises(ValueError, match="nothing averages gradients over the ddp axis"):
        verify_training(tiny_cnn, _batches(2), _layout(2), shard_dim=2, wrapper="none")
    different = [(torch.full((2, 2, 9, 6), float(rank)), torch.zeros(2, 1, 9, 6))]
    with pytest.raises(ValueError, match=r"differ between rank 0 and rank\(s\) \[1, 2, 3\]"):
        verify_training(tiny_cnn, different, _layout(2), shard_dim=2, wrapper="ddp")
    with pytest.raises(ValueError, match="unknown optimizer"):
        verify_training(tiny_cnn, _batches(2), _layout(2), shard_dim=2, wrapper="ddp", optimizer="lbfgs")


@pytest.mark.multirank(4)
def test_autocast_bf16_within_a_bf16_tolerance(rank):
    report = verify_training(
        tiny_cnn,
        _batches(2),
        _layout(2),
        shard_dim=2,
        sizes=[6, 3],
        wrapper="ddp",
        steps=2,
        autocast_dtype=torch.bfloat16,
        rtol=3e-2,
    )
    print(report.format())
    assert report.ok, report.format()


@pytest.mark.multirank(4, timeout=400)
def test_compiled_training(rank):
    run = functools.partial(
        verify_training,
        tiny_cnn,
        _batches(1),
        _layout(1),
        shard_dim=2,
        sizes=[3, 2, 4, 0],
        wrapper="none",
        steps=2,
        compile=True,
    )
    if not compiles_empty_shards():  # torch 2.13: refused on every rank, where compiling hung the others
        with pytest.raises(MissingShardPatch, match=r"shard sizes \[3, 2, 4, 0\].*use torch>=2.14"):
            run()
        return
    report = run()
    assert report.ok, report.format()


def test_tensor_errors_come_from_the_one_comparison_rule():
    from physicsnemo_shardext.comparison import Tolerance, compare

    # issue 29: a zero reference and a 1e-8 difference pass, without a huge relative error
    near_zero = TensorError.of(compare(torch.full((3,), 1e-8), torch.zeros(3), Tolerance(1e-5, 1e-5)))
    assert near_zero.passed and near_zero.relative < 1e-2
    outside = TensorError.of(compare(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1e-3]), Tolerance(1e-5, 1e-5)))
    assert outside.passed is False and outside.relative == pytest.approx(1e-3)  # normwise: max|a - r| / max|r|
    report = _report(gradients={"0.weight": near_zero, "0.bias": outside}, atol=1e-5, loss_passed=True)
    assert not report.ok and report.worst_tensor == "grad 0.bias"
    text = report.format()
    assert "rtol=1e-05, atol=1e-05" in text.splitlines()[0] and "OUTSIDE atol + rtol*|r|" in text
    assert _report(gradients={"0.weight": near_zero}, atol=1e-5, loss_passed=True).ok
    assert not _report(loss_error=0.0, loss_passed=False).ok  # the loss verdict comes from the rule too
