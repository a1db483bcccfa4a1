"""Mixed precision: every first-party family under ``torch.autocast`` matches single-process autocast.

Each case runs through :func:`check_conformance` with ``autocast=``: the reference and the
sharded forward both run under ``torch.autocast``; tolerances follow the single-process
autocast-vs-fp32 error (``atol = max(atol, 4 e)``), and output/gradient dtypes must match.
Shards are uneven (9 + 8 rows of 17 unless a case says otherwise), on 2 ranks.

What CPU autocast does (torch 2.14, ``dtype=torch.bfloat16``): ``conv*``, ``linear``,
``matmul``/``einsum`` (real operands) and ``prelu`` run in bf16; normalization, softmax,
cumsum, pointwise activations, padding, pooling, interpolation, pixel shuffle, roll/flip,
``torch.gradient``/``diff`` and the layout ops have **no CPU autocast rule** (they run in the
dtype they are given), ``cat``/``stack`` promote to the widest input, and the FFTs have no
rule and refuse bf16 input on CPU. So the families without a rule are tested twice: as
called on float32 data (autocast must leave them in float32: tolerance = the plain one), and
after a ``Linear`` over the last dim, so they see the bf16 activations a real network under
autocast feeds them. FFT cases only take float32 data (single-process fails on bf16 too).

On CUDA (``cuda-bf16``, ``cuda-fp16``) the same cases run where the mesh fixtures are CUDA
meshes, i.e. with a GPU for each rank; on CPU-only machines (CI) those are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.nn.module.afno_layers import AFNO2DLayer
from physicsnemo.nn.module.spectral_layers import SpectralConv2d
from torch import nn
from torch.distributed.tensor import Shard

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

# The mesh fixtures are NCCL/CUDA meshes exactly when every rank gets a GPU (testing/worker.py).
_CUDA_MESH = torch.cuda.is_available() and torch.cuda.device_count() >= 2
_NO_CUDA = "needs a CUDA GPU for each of the 2 ranks (the mesh fixtures are CPU/gloo meshes otherwise)"
PRECISIONS = [
    pytest.param(
        torch.bfloat16,
        id="cpu-bf16",
        marks=pytest.mark.skipif(_CUDA_MESH, reason="the mesh fixtures are CUDA meshes on this machine"),
    ),
    pytest.param(torch.bfloat16, id="cuda-bf16", marks=pytest.mark.skipif(not _CUDA_MESH, reason=_NO_CUDA)),
    pytest.param(torch.float16, id="cuda-fp16", marks=pytest.mark.skipif(not _CUDA_MESH, reason=_NO_CUDA)),
]
SHAPE = (2, 4, 17, 6)  # (B, C, H, W), sharded on H


@dataclass(frozen=True)
class Case:
    """``make()`` builds the module or function (in the rank, after seeding)."""

    make: Callable[[], Any]
    shape: tuple[int, ...] = SHAPE
    dim: int = 2
    split: tuple[int, ...] = (9, 8)
    options: dict[str, Any] = field(default_factory=dict)


class _Fn(nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _after_linear(make: Callable[[], Any], width: int = SHAPE[-1]) -> Callable[[], nn.Module]:
    """The op fed by a Linear over the last dim: under autocast its input is low precision."""

    def build() -> nn.Module:
        op = make()
        return nn.Sequential(nn.Linear(width, width), op if isinstance(op, nn.Module) else _Fn(op))

    return build


def _randomized(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        module = make()
        with torch.no_grad():
            for p in module.parameters():
                p.uniform_(0.5, 1.5)
        return module

    return build


def _both(cases: dict[str, Case]) -> dict[str, Case]:
    """Each case as called (float32 data) and after a Linear (low-precision data)."""
    result = dict(cases)
    for name, case in cases.items():
        result[f"{name}-after-linear"] = Case(
            _after_linear(case.make, case.shape[-1]), case.shape, case.dim, case.split, case.options
        )
    return result


def _run(case: Case, mesh, dtype: torch.dtype):
    x = torch.randn(case.shape)
    return check_conformance(
        case.make(),
        [x],
        ShardSpec(mesh, [Shard(case.dim)], list(case.split)),
        autocast=dtype,
        count_comms=False,
        **case.options,
    )


# -- families with no CPU autocast rule: as called, and on low-precision data ------------------
POINTWISE = _both(
    {
        "gelu": Case(lambda: F.gelu),
        "gelu-tanh": Case(lambda: lambda t: F.gelu(t, approximate="tanh")),
        "silu": Case(lambda: F.silu),
        "sigmoid-mul": Case(lambda: lambda t: torch.sigmoid(t) * t),
        "leaky-relu": Case(lambda: nn.LeakyReLU(0.1)),
    }
)
NORMALIZATION = _both(
    {
        "batch-norm": Case(_randomized(lambda: nn.BatchNorm2d(4))),
        "instance-norm-stats": Case(_randomized(lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True))),
        "layer-norm-sharded": Case(_randomized(lambda: nn.LayerNorm([4, 17, 6]))),
        "layer-norm-local": Case(_randomized(lambda: nn.LayerNorm(6))),
        "group-norm": Case(_randomized(lambda: nn.GroupNorm(2, 4))),
        "rms-norm-sharded": Case(_randomized(lambda: nn.RMSNorm([17, 6]))),
        "rms-norm-local": Case(_randomized(lambda: nn.RMSNorm(6))),
    }
)
SOFTMAX_CUMSUM = _both(
    {
        "softmax-sharded-dim": Case(lambda: lambda t: F.softmax(t, dim=2)),
        "log-softmax-sharded-dim": Case(lambda: lambda t: F.log_softmax(t, dim=2)),
        "softmax-local-dim": Case(lambda: lambda t: torch.softmax(t, dim=3)),
        "cumsum-sharded-dim": Case(lambda: lambda t: t.cumsum(2), options={"atol": 1e-4}),
    }
)
ROLL_FLIP = _both(
    {
        "roll": Case(lambda: lambda t: torch.roll(t, 5, 2)),
        "roll-two-dims": Case(lambda: lambda t: torch.roll(t, (-3, 2), (2, 3))),
        "flip": Case(lambda: lambda t: torch.flip(t, [2])),
    }
)
FINITE_DIFFERENCES = _both(
    {
        "gradient": Case(lambda: lambda t: torch.gradient(t, dim=2)[0]),
        "gradient-edge2-spacing": Case(lambda: lambda t: torch.gradient(t, spacing=0.5, dim=2, edge_order=2)[0]),
        "diff": Case(lambda: lambda t: torch.diff(t, dim=2)),
        "diff-n3": Case(lambda: lambda t: torch.diff(t, n=3, dim=2)),
    }
)
PADDING = _both(
    {
        mode: Case(lambda mode=mode: lambda t: F.pad(t, (1, 2, 3, 2), mode=mode))
        for mode in ("reflect", "replicate", "circular")
    }
    | {"constant": Case(lambda: lambda t: F.pad(t, (1, 2, 3, 2), value=0.5))}
)
POOLING = _both(
    {
        "max-k3-s2-p1": Case(lambda: lambda t: F.max_pool2d(t, 3, stride=2, padding=1)),
        "avg-k2": Case(lambda: nn.AvgPool2d(2)),
        "avg-k3-s2-ceil": Case(lambda: lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True, count_include_pad=False)),
        "adaptive-avg": Case(lambda: lambda t: F.adaptive_avg_pool2d(t, (5, 3))),
        "adaptive-max": Case(lambda: lambda t: F.adaptive_max_pool2d(t, (4, 3))),
    }
)
RESAMPLING = _both(
    {
        "nearest-x2": Case(lambda: lambda t: F.interpolate(t, scale_factor=2, mode="nearest")),
        "bilinear-1.5-align": Case(
            lambda: lambda t: F.interpolate(t, scale_factor=1.5, mode="bilinear", align_corners=True)
        ),
        "bicubic-size": Case(lambda: lambda t: F.interpolate(t, size=(23, 5), mode="bicubic")),
        "pixel-shuffle": Case(lambda: nn.PixelShuffle(2)),
    }
)
LAYOUT_OPS = _both(
    {
        "permute": Case(lambda: lambda t: t.permute(0, 2, 3, 1) * 1.5, options={"expected_placements": [Shard(1)]}),
        "cat-channels": Case(lambda: lambda t: torch.cat([t, 3 * t], dim=1)),
        "flatten-unflatten": Case(lambda: lambda t: t.flatten(2).unflatten(2, (17, 6)) * 1.5),
        "reshape": Case(lambda: lambda t: t.reshape(2, 2, 2, 17, 6).sum(1)),
    }
)
LAYOUT_OPS |= {
    # prelu has a CPU autocast rule (lower precision); cat of bf16 and float32 promotes.
    "prelu": Case(lambda: nn.PReLU(4)),
    "prelu-per-channel-after-linear": Case(_after_linear(lambda: nn.PReLU(4))),
    "cat-bf16-with-fp32": Case(lambda: _CatsLinear()),
}


class _CatsLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return torch.cat([self.linear(x), x], dim=1)


# -- families whose ops autocast on CPU -----------------------------------------------------
CONVOLUTION = {
    "conv1d-k3-same": Case(lambda: nn.Conv1d(4, 5, 3, padding=1), shape=(2, 4, 17)),
    "conv2d-k3-same": Case(lambda: nn.Conv2d(4, 5, 3, padding=1)),
    "conv2d-k4-s2-p1": Case(lambda: nn.Conv2d(4, 5, 4, stride=2, padding=1)),
    "conv3d-k3-same": Case(lambda: nn.Conv3d(4, 3, 3, padding=1), shape=(1, 4, 17, 4, 3)),
    "conv-transpose2d-k3-s2-p1-op1": Case(lambda: nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)),
    "conv-transpose1d-k4-s2-p1": Case(lambda: nn.ConvTranspose1d(4, 3, 4, stride=2, padding=1), shape=(2, 4, 17)),
}
LINEAR = {
    "linear": Case(lambda: nn.Linear(6, 5)),
    "linear-no-bias-3d": Case(lambda: nn.Linear(6, 3, bias=False), shape=(2, 17, 6), dim=1),
    "mlp-gelu": Case(lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6))),
}
# -- spectral families: FFTs have no CPU autocast rule and refuse bf16 input ---------------------
FFT = {
    "rfft2": Case(lambda: torch.fft.rfft2, options={"atol": 1e-4, "expected_placements": None}),
    "rfft2-irfft2": Case(
        lambda: lambda t: torch.fft.irfft2(torch.fft.rfft2(t) * 0.5, s=t.shape[-2:]), options={"atol": 1e-4}
    ),
    "fftn-ortho": Case(
        lambda: lambda t: torch.fft.fftn(t, dim=(2, 3), norm="ortho").abs(),
        options={"atol": 1e-4, "expected_placements": None},
    ),
}
SPECTRAL = {
    # PhysicsNeMo's FNO spectral conv: its einsum is on complex operands (no autocast rule).
    "fno-spectral-conv2d": Case(
        lambda: SpectralConv2d(3, 3, 3, 4), shape=(2, 3, 10, 12), split=(6, 4), options={"atol": 1e-4}
    ),
}
AFNO = {
    "afno2d-layer": Case(
        lambda: AFNO2DLayer(hidden_size=8, num_blocks=2),
        shape=(2, 10, 12, 8),
        dim=1,
        split=(7, 3),
        options={"atol": 1e-4},
    ),
    "afno2d-layer-thresholded": Case(
        lambda: AFNO2DLayer(hidden_size=8, num_blocks=4, hard_thresholding_fraction=0.5),
        shape=(2, 10, 12, 8),
        dim=1,
        split=(7, 3),
        options={"atol": 1e-4},
    ),
}

FAMILIES = {
    "pointwise": POINTWISE,
    "normalization": NORMALIZATION,
    "softmax_cumsum": SOFTMAX_CUMSUM,
    "roll_flip": ROLL_FLIP,
    "finite_differences": FINITE_DIFFERENCES,
    "padding": PADDING,
    "convolution": CONVOLUTION,
    "linear": LINEAR,
    "pooling": POOLING,
    "resampling": RESAMPLING,
    "fft": FFT,
    "indexing_einsum": SPECTRAL,
    "afno": AFNO,
    "layout_ops": LAYOUT_OPS,
}
CASES = [(family, name) for family, cases in FAMILIES.items() for name in sorted(cases)]


@pytest.mark.multirank(2)
@pytest.mark.parametrize("dtype", PRECISIONS)
@pytest.mark.parametrize("family, name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_family_matches_single_process_autocast(domain_mesh, family, name, dtype):
    report = _run(FAMILIES[family][name], domain_mesh, dtype)
    assert report.autocast == (domain_mesh.device_type, dtype)
    if domain_mesh.device_type == "cpu":
        # Not vacuous: exactly the cases with a CPU autocast rule on their path changed precision.
        touched = report.autocast_reference_errors["output[0]"] > 0
        assert touched == _autocasts_on_cpu(family, name), report.autocast_reference_errors


# One GPU (the GPU lane, .ci/gpu-lane): the same cases on a one-rank CUDA mesh, the whole
# tensor in one shard. No halo moves, but every handler's CUDA autocast path (dtypes of its
# local compute and of what it wraps) is compared with single-process CUDA autocast.
_ONE_GPU = "needs a CUDA GPU (the one-rank mesh is a CUDA mesh only there)"
ONE_GPU_PRECISIONS = [
    pytest.param(torch.bfloat16, id="cuda-bf16"),
    pytest.param(torch.float16, id="cuda-fp16"),
]


@pytest.mark.multirank(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason=_ONE_GPU)
@pytest.mark.parametrize("dtype", ONE_GPU_PRECISIONS)
@pytest.mark.parametrize("family, name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_family_matches_single_process_autocast_on_one_gpu(domain_mesh, family, name, dtype):
    case = FAMILIES[family][name]
    whole = Case(case.make, case.shape, case.dim, (case.shape[case.dim],), case.options)
    report = _run(whole, domain_mesh, dtype)
    assert report.autocast == ("cuda", dtype)


def _autocasts_on_cpu(family: str, name: str) -> bool:
    return (
        family in {"convolution", "linear", "afno"} or "after-linear" in name or name in {"prelu", "cat-bf16-with-fp32"}
    )


@pytest.mark.multirank(2)
def test_fft_of_low_precision_data_is_refused_like_single_process(domain_mesh):
    # CPU has no autocast rule for the FFTs and no bf16 FFT kernel: single-process raises.
    x = torch.randn(2, 3, 9, 6, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="BFloat16"):
        torch.fft.rfft2(x)
    xs = shard_tensor(x, domain_mesh, [Shard(2)], [5, 4])
    with pytest.raises((RuntimeError, MissingShardPatch)):
        torch.fft.rfft2(xs)
