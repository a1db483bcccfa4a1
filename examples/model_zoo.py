"""PhysicsNeMo's model families at small sizes, each with the dims a sample can be split along.

Every entry of `ZOO` builds one model of PhysicsNeMo 2.2 (``physicsnemo.models``
and ``physicsnemo.experimental.models``) with its inputs, and says which input dims
are split across ranks: an uneven split for 2 ranks and, for 2-D fields, a split
of two dims for a 2x2 mesh. `tests/models/test_model_zoo.py` runs each against
single-process (output, every parameter and input gradient, zero-initialised
parameters re-drawn); `docs/models.md` has the table of results. A factory also
works with ``shardext verify``:

    shardext verify examples/model_zoo.py:songunet --shard 2 --ranks 2

Examples:
    >>> entry = ZOO["songunet"]
    >>> model, inputs = entry.build()
    >>> [tuple(x.shape) for x in inputs], entry.dims, entry.split
    ([(1, 2, 16, 16), (1,)], (2, 3), (10, 6))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

warnings.filterwarnings("ignore", message=".*physicsnemo.experimental.*")

Built = tuple[nn.Module, list[torch.Tensor]]


@dataclass(frozen=True)
class ZooModel:
    """One model family: how to build it, how its input is split, and what to expect.

    Attributes:
        family: PhysicsNeMo's module (``physicsnemo.models.<family>``).
        build: returns the model and its inputs (seeded, the same on every rank).
        dims: the dims of the sharded inputs that are split: the first on a 1-D
            mesh, both on a 2x2 mesh (``()`` when not domain-parallel).
        split: the local sizes of ``dims[0]`` on 2 ranks (uneven).
        split_2d: local sizes of ``dims[0]`` and ``dims[1]`` on a 2x2 mesh, or
            ``None`` where the model is not 2-D.
        sharded: which inputs are split (the others are replicated).
        outcome: ``"match"``, ``"refused"`` (a ``MissingShardPatch`` naming an op)
            or ``"not domain-parallel"``.
        note: the refused op or the reason, for the table.
    """

    family: str
    build: Callable[[], Built]
    dims: tuple[int, ...]
    split: tuple[int, ...] = ()
    split_2d: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    sharded: tuple[int, ...] = (0,)
    outcome: str = "match"
    note: str = ""
    rtol: float = 1e-4
    atol: float = 1e-4
    kwargs: dict[str, Any] = field(default_factory=dict)

    def specs(self, mesh: Any, inputs: list[torch.Tensor], two_d: bool = False) -> list[Any]:
        """The `ShardSpec` of each input on ``mesh`` (1-D, or 2x2 when ``two_d``); ``None`` for replicated ones."""
        from torch.distributed.tensor import Shard

        from physicsnemo_shardext.testing import ShardSpec

        if two_d:
            assert self.split_2d is not None, f"{self.family}: no 2-D split"
            spec = ShardSpec(mesh, [Shard(self.dims[0]), Shard(self.dims[1])],
                             {0: list(self.split_2d[0]), 1: list(self.split_2d[1])})
        else:
            spec = ShardSpec(mesh, [Shard(self.dims[0])], list(self.split))
        return [spec if i in self.sharded else None for i in range(len(inputs))]


def _seeded(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def songunet() -> Built:
    """SongUNet (CorrDiff's and StormCast's backbone) with attention at 8x8 and in the bottleneck."""
    from physicsnemo.models.diffusion_unets import SongUNet

    torch.manual_seed(0)
    model = SongUNet(img_resolution=16, in_channels=2, out_channels=2, model_channels=8, channel_mult=[1, 2],
                     num_blocks=1, attn_resolutions=[8], dropout=0.0, embedding_type="positional")
    x, noise = _seeded((1, 2, 16, 16), (1,))
    return model, [x, noise]


def dhariwalunet() -> Built:
    """DhariwalUNet (ADM) with attention at 8x8."""
    from physicsnemo.models.diffusion_unets import DhariwalUNet

    torch.manual_seed(0)
    # 64 channels at 8x8: one attention head (DhariwalUNet's heads are channels // 64)
    model = DhariwalUNet(img_resolution=16, in_channels=2, out_channels=2, model_channels=32, channel_mult=[1, 2],
                         num_blocks=1, attn_resolutions=[8], dropout=0.0)
    x, noise = _seeded((1, 2, 16, 16), (1,))
    return model, [x, noise]


def corrdiff_regression() -> Built:
    """CorrDiff's regression UNet (SongUNetPosEmbd inside, positional grid embedding, attention on)."""
    from physicsnemo.models.diffusion_unets import CorrDiffRegressionUNet

    torch.manual_seed(0)
    model = CorrDiffRegressionUNet(img_resolution=16, img_in_channels=2, img_out_channels=2, model_type="SongUNet",
                                   model_channels=8, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8],
                                   dropout=0.0)
    x, lr = _seeded((1, 2, 16, 16), (1, 2, 16, 16))
    return model, [x, lr]


ZOO: dict[str, ZooModel] = {
    "songunet": ZooModel("diffusion_unets", songunet, dims=(2, 3), split=(10, 6), split_2d=((10, 6), (6, 10))),
    "dhariwalunet": ZooModel("diffusion_unets", dhariwalunet, dims=(2, 3), split=(10, 6),
                             split_2d=((10, 6), (6, 10))),
    "corrdiff_regression": ZooModel("diffusion_unets", corrdiff_regression, dims=(2, 3), split=(10, 6),
                                    split_2d=((10, 6), (6, 10)), sharded=(0, 1)),
}
