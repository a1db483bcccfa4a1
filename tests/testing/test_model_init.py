"""Tests of `physicsnemo_shardext.testing.model_init`: zero parameters re-drawn, seeded, others untouched."""

from __future__ import annotations

import copy

import torch

from physicsnemo_shardext.testing import redraw_zero_parameters, without_random_masks


def _zeroed_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.GroupNorm(1, 3), torch.nn.Conv2d(3, 1, 1))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.zero_()
    return model


def test_only_all_zero_parameters_are_redrawn():
    model = _zeroed_model()
    before = copy.deepcopy(model.state_dict())
    # GroupNorm's bias starts at zero too: re-drawn, so a wrong normalisation cannot hide behind it
    assert redraw_zero_parameters(model, seed=3) == ["1.bias", "2.weight", "2.bias"]
    after = model.state_dict()
    for name in ("0.weight", "0.bias", "1.weight"):
        assert torch.equal(after[name], before[name]), name
    assert after["2.weight"].abs().min() > 0 and after["2.bias"].abs().min() > 0


def test_same_seed_same_values_and_fan_in_scale():
    a, b = _zeroed_model(), _zeroed_model()
    redraw_zero_parameters(a, seed=5)
    redraw_zero_parameters(b, seed=5)
    assert torch.equal(a[2].weight, b[2].weight)
    c = _zeroed_model()
    redraw_zero_parameters(c, seed=6)
    assert not torch.equal(a[2].weight, c[2].weight)
    big = torch.nn.Linear(400, 50)
    with torch.no_grad():
        big.weight.zero_()
    redraw_zero_parameters(big)
    assert 0.03 < float(big.weight.std()) < 0.07  # 1/sqrt(400) = 0.05


def test_a_redrawn_output_layer_reaches_the_output():
    model = _zeroed_model()
    x = torch.randn(1, 2, 6, 6)
    assert not model(x).any()
    redraw_zero_parameters(model)
    assert model(x).abs().sum() > 0


class _DropPath(torch.nn.Module):
    """A stochastic-depth module holding its probability as ``drop_prob`` (PhysicsNeMo's and timm's)."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob


def test_random_masks_are_switched_off():
    model = torch.nn.Sequential(torch.nn.Dropout(0.2), _DropPath(0.3), torch.nn.Dropout2d(0.0), _DropPath(0.0))
    assert without_random_masks(model) == ["0", "1"]
    assert model[0].p == 0.0 and model[1].drop_prob == 0.0
    assert without_random_masks(model) == []
