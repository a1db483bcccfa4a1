"""Whole models: one training step of PhysicsNeMo's FNO, UNet, Pix2Pix and SongUNet and timm's ViT, plain and sharded.

`build_model` builds a model and its full input at ``--model-res``;
`measure_model` measures one forward+backward: its peak memory at once, and its
median time through the timer it returns, which the world calls only after
every memory measurement of the process (inside ``_common.heap_allocations``).
At ``ranks=1`` the plain model runs on the whole input (the baseline); else the
input is sharded over dim 2 on the world's mesh.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import all_ranks_agree, first_line, median_ms, peak_memory, sync
from cases import randn
from measure import cotangent_like

__all__ = ["MODELS", "ModelResult", "Timer", "build_model", "measure_model"]

MODELS = ("fno", "unet", "pix2pix", "songunet", "vit")


class _Labelled(torch.nn.Module):
    """A diffusion UNet called as ``model(x, noise_labels)``, the labels a plain (replicated) tensor, not a buffer.

    ``distribute_module`` leaves the labels alone (a buffer would become a Replicate DTensor), as
    ``examples/model_zoo.py`` passes them: plain, beside the sharded image.
    """

    def __init__(self, model: torch.nn.Module, noise_labels: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.noise_labels = noise_labels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, self.noise_labels.to(x.device))


@dataclass
class ModelResult:
    """One rank's measurement of one model at one rank count (1: the plain model on the whole input)."""

    model: str
    config: str
    ranks: int
    rank: int
    input_shape: list[int]
    peak_mib: float | None = None
    median_ms: float | None = None
    status: str = "ok"


def build_model(name: str, res: int) -> tuple[torch.nn.Module, torch.Tensor, str]:
    """The model, its full input (sharded over dim 2) and a one-line description, at resolution ``res``."""
    torch.manual_seed(0)
    if name == "fno":
        from physicsnemo.models.fno import FNO

        modes = max(2, min(16, res // 8))
        model = FNO(
            in_channels=3, out_channels=1, dimension=2, latent_channels=32, num_fno_layers=4, num_fno_modes=modes
        )
        return model, randn(1, 3, res, res), f"FNO 2-D, latent 32, 4 layers, {modes} modes, padding 8, coords"
    if name == "unet":
        from physicsnemo.models.unet import UNet

        side = max(4, res // 8)
        model = UNet(
            in_channels=1,
            out_channels=1,
            model_depth=3,
            feature_map_channels=[8, 8, 16, 16, 32, 32],
            gradient_checkpointing=False,
        )
        return model, randn(1, 1, side, side, side), "UNet 3-D, depth 3, channels 8-32, GroupNorm, MaxPool3d(2)"
    if name == "pix2pix":
        from physicsnemo.models.pix2pix import Pix2Pix

        model = Pix2Pix(
            in_channels=1,
            out_channels=1,
            dimension=2,
            conv_layer_size=32,
            n_downsampling=2,
            n_upsampling=2,
            n_blocks=2,
            batch_norm=True,
            padding_type="reflect",
        )
        return model, randn(1, 1, res, res), "Pix2Pix 2-D, 32 channels, 2 down/up, 2 blocks, BatchNorm, reflect"
    if name == "songunet":
        from physicsnemo.models.diffusion_unets import SongUNet

        # examples/model_zoo.py's sharded configuration, one level deeper: attention at the lowest
        # resolution (res/8) and in the bottleneck; 16 channels (x1, 2, 2, 2), one block per level
        model = SongUNet(
            img_resolution=res,
            in_channels=2,
            out_channels=2,
            model_channels=16,
            channel_mult=[1, 2, 2, 2],
            num_blocks=1,
            attn_resolutions=[res // 8],
            dropout=0.0,
            embedding_type="positional",
        )
        return (
            _Labelled(model, randn(1, seed=3)),
            randn(1, 2, res, res),
            f"SongUNet, 16 channels x1,2,2,2, 1 block/level, attention at {res // 8}x{res // 8} + bottleneck",
        )
    if name == "vit":
        from timm.models.vision_transformer import VisionTransformer

        patch = max(2, res // 32)
        model = VisionTransformer(
            img_size=res,
            patch_size=patch,
            in_chans=3,
            num_classes=10,
            embed_dim=256,
            depth=4,
            num_heads=8,
            mlp_ratio=2.0,
            class_token=False,
            global_pool="avg",
        )
        return (
            model,
            randn(1, 3, res, res),
            (f"timm ViT, patch {patch}, {(res // patch) ** 2} tokens, width 256, depth 4, 8 heads, no class token"),
        )
    raise ValueError(name)


Timer = Callable[[], None]


def measure_model(
    name: str, args: argparse.Namespace, mesh: Any, device: torch.device, ranks: int
) -> tuple[ModelResult, Timer | None]:
    """One training step (forward+backward) of ``name``: sharded over dim 2 on ``mesh``, or plain (``ranks=1``).

    Measures the peak memory now and returns a timer that fills in the median step time: call the
    timers only after every memory measurement of the process, inside ``heap_allocations()`` (memory
    freed to glibc's heap while timing would hide later peaks: a Pix2Pix step measured after an FNO
    was timed read 17 MiB instead of 106).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        model, full, config = build_model(name, args.model_res)
    except ImportError as exc:
        return ModelResult(name, "", ranks, rank, [], status=f"skipped: {first_line(exc)}"), None
    result = ModelResult(name, config, ranks, rank, list(full.shape))
    model = model.to(device)
    if ranks == 1:
        x = full.to(device).requires_grad_(True)
        local_sync: Callable[[], None] = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    else:
        from torch.distributed.tensor import Shard, distribute_module

        from physicsnemo_shardext.testing import shard_tensor

        model = distribute_module(model, mesh)
        x = shard_tensor(full.to(device), mesh, [Shard(2)], requires_grad=True)
        local_sync = lambda: sync(device)  # noqa: E731
    cotangent: list[torch.Tensor | None] = [None]

    def step() -> None:
        x.grad = None
        model.zero_grad(set_to_none=True)
        out = model(x)
        if cotangent[0] is None:
            full_cotangent = randn(*out.shape, seed=7).to(device)
            cotangent[0] = full_cotangent if ranks == 1 else cotangent_like(out, full_cotangent)
        out.backward(cotangent[0])

    ok = True
    try:
        step()  # warm-up
    except Exception as exc:  # noqa: BLE001
        ok, result.status = False, f"fails: {type(exc).__name__}: {first_line(exc)}"
    if ranks > 1 and not all_ranks_agree(ok):
        result.status = result.status if not ok else "fails on another rank"
        return result, None
    if not ok:
        return result, None
    x.grad = None
    model.zero_grad(set_to_none=True)
    local_sync()
    with peak_memory(device) as peak:
        step()
    result.peak_mib = peak[0]

    def timer() -> None:
        if ranks == 1:  # this process alone (under torchrun the other ranks wait at a barrier)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                step()
                local_sync()
                times.append(time.perf_counter() - start)
            result.median_ms = statistics.median(times) * 1e3
        else:
            result.median_ms = median_ms(step, args.repeats, device)

    return result, timer
