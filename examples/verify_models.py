"""Model factories for `shardext verify`: PhysicsNeMo's FNO, UNet (3-D) and Transolver, small enough for a laptop.

Run from the repository root (each line starts its own CPU ranks; under
``torchrun`` on GPUs the same command runs inline):

    shardext verify examples/verify_models.py:fno --input 1x3x64x64 --shard 2 --ranks 2
    shardext verify examples/verify_models.py:unet --input 1x1x16x8x8 --shard 2 --ranks 2
    shardext verify examples/verify_models.py:transolver --shard 1 --ranks 2 --html transolver.html

A factory returns the model, or the model and its inputs (Transolver takes two
per-point tensors; both are split along the points).
"""

from __future__ import annotations

import torch
from torch import nn


def fno() -> nn.Module:
    """A 2-D Fourier neural operator: spectral convolutions need the FFT transposes."""
    from physicsnemo.models.fno import FNO

    return FNO(
        in_channels=3,
        out_channels=2,
        decoder_layers=1,
        decoder_layer_size=32,
        dimension=2,
        latent_channels=16,
        num_fno_layers=4,
        num_fno_modes=12,
        padding=0,
    )


def unet() -> nn.Module:
    """PhysicsNeMo's 3-D UNet: halos, pooling, transposed convolutions, group norm, skip concatenation."""
    from physicsnemo.models.unet import UNet

    return UNet(in_channels=1, out_channels=1, model_depth=3, feature_map_channels=[2, 2, 4, 4, 8, 8])


def transolver() -> tuple[nn.Module, list[torch.Tensor]]:
    """Transolver on 64 points: physics attention over slice tokens, points sharded."""
    from physicsnemo.models.transolver import Transolver

    model = Transolver(
        structured_shape=None,
        n_layers=2,
        n_hidden=32,
        dropout=0.0,
        n_head=4,
        time_input=False,
        act="gelu",
        mlp_ratio=2,
        functional_dim=3,
        embedding_dim=5,
        out_dim=2,
        slice_num=8,
        ref=1,
        unified_pos=False,
        use_te=False,
    )
    return model, [torch.randn(1, 64, 3), torch.randn(1, 64, 5)]
