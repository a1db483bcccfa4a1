"""Small models shared by the training wing's tests (not a test module: pytest collects nothing here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PosCNN(nn.Module):
    """A conv, a spatial positional embedding (as AFNO's ``pos_embed``), a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, 4, 9, 6))
        self.c2 = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.gelu(self.c1(x)) + self.pos_embed)
