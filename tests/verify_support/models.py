"""Factories for `shardext verify`'s tests: one model per outcome (match, gather, refusal, mismatch).

Loaded by path (``tests/verify_support/models.py:fno``) on every rank the command starts.
"""

from __future__ import annotations

import torch
from torch import nn


def fno() -> nn.Module:
    """PhysicsNeMo's FNO, small: every op has a shard patch, so it matches."""
    from physicsnemo.models.fno import FNO

    return FNO(
        in_channels=3,
        out_channels=2,
        decoder_layers=1,
        decoder_layer_size=16,
        dimension=2,
        latent_channels=8,
        num_fno_layers=2,
        num_fno_modes=6,
        padding=0,
    )


class ConvThen(nn.Module):
    """A convolution followed by one op along the sharded dim H."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if self.op == "median":
            # No plugin patches median: the DTensor fallback gathers H. (Not cummax: its fallback
            # backward fails on torch 2.13, "scatter_add got mixed torch.Tensor and DTensor".)
            return torch.median(y, dim=2, keepdim=True).values
        return torch.nn.functional.gelu(y)


def gathering() -> nn.Module:
    """Matches, but only because the DTensor fallback gathers the whole activation for ``torch.median``."""
    return ConvThen("median")


def gelu_model() -> nn.Module:
    """Conv then GELU: correct with the first-party patches, wrong with ``wrong_plugin.py`` loaded."""
    return ConvThen("gelu")


def model_and_inputs() -> tuple[nn.Module, list[torch.Tensor]]:
    """A factory that returns its own inputs (no ``--input`` needed)."""
    return ConvThen("gelu"), [torch.randn(1, 2, 12, 6)]


def broken() -> nn.Module:
    """A factory that raises: the command must say so and exit 3."""
    raise RuntimeError("checkpoint file missing")


class WaitsOnRank1(nn.Module):
    """Rank 1 waits for a message rank 0 never sends: a hang the command must end with a stack report."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            dist.recv(torch.zeros(1), src=0)
        return x * self.scale


def hanging() -> nn.Module:
    """See `WaitsOnRank1`."""
    return WaitsOnRank1()
