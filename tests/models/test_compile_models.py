"""``torch.compile`` (``dynamic=False``) of PhysicsNeMo's FNO and AFNO and of a small UNet-like CNN on ShardTensor inputs.

Each test runs the same model three ways on 2 gloo ranks, the input split
unevenly along H: single-process on the full tensor, sharded eagerly, and sharded
under ``torch.compile``; every run does forward and backward **twice** (the second
compiled call reuses the compiled code). The compiled run must equal the eager run
and the single-process run: output, input gradient and every parameter gradient.
Parameters are plain tensors (no ``distribute_module``): PhysicsNeMo promotes them
to replicated operands where they meet a ShardTensor.

What is compiled: first-party handlers are not traced (see
``physicsnemo_shardext.primitives.compilation``): each sharded op they serve is a
clean graph break and runs eagerly, the code between them is compiled. So the
compiled run communicates exactly like the eager one, and ``aot_eager`` matches
eager bit for bit; ``inductor`` may reorder float sums in the compiled pieces.

Both backends run for every model: since the sharded ops run eagerly, the compiled
graphs are small and even ``inductor`` (C++ codegen on CPU) compiles in seconds.
Measured on the 2-core development machine (2 ranks, both steps, compile included):
UNet-like 2.4 s / 1.5 s, FNO 4.3 s / 6.9 s, AFNO 2.6 s / 3.8 s (``aot_eager`` /
``inductor``); compiled vs eager max difference 0 everywhere, compiled vs
single-process at most 2.4e-6 (UNet-like), 9.5e-7 (FNO), 5.7e-6 (AFNO).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.models.afno import AFNO
from physicsnemo.models.fno import FNO
from physicsnemo.models.unet import UNet
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Replicate, Shard

from physicsnemo_shardext.primitives import handlers_traced
from physicsnemo_shardext.testing import shard_tensor

#: AFNO's spectral filter runs eagerly (``patches/afno.py``: its sharded scratch buffers come from
#: a TorchFunctionMode that Dynamo cannot trace), behind ``torch.compiler.disable``.
AFNO_BREAK = "shard_aware_forward.<locals>.sharded_forward"
RTOL, ATOL = 1e-5, 1e-5  # float32; compiled vs eager vs single-process
STEPS = 2

FNO_CONFIG = dict(
    in_channels=2,
    out_channels=1,
    dimension=2,
    latent_channels=8,
    num_fno_layers=2,
    num_fno_modes=4,
    decoder_layers=1,
    decoder_layer_size=16,
)
AFNO_CONFIG = dict(
    inp_shape=[32, 16], in_channels=2, out_channels=1, patch_size=[4, 4], embed_dim=8, depth=1, num_blocks=2
)


class SmallUNet(nn.Module):
    """Conv2d, GroupNorm, GELU, average pooling, nearest upsampling, a skip connection and a zero pad."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.dec = nn.Conv2d(16, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = F.gelu(self.norm(self.enc(x)))
        y = F.avg_pool2d(skip, 2)
        y = F.gelu(self.mid(y))
        y = F.interpolate(y, scale_factor=2, mode="nearest")  # keeps the split: cat with the skip below
        y = self.dec(torch.cat([y, skip], dim=1))
        return self.out(F.pad(y, (1, 1, 1, 1)))


MODELS: dict[str, tuple[Any, tuple[int, ...], list[int]]] = {
    # name: (constructor, full input shape, H split on 2 ranks)
    "unet": (SmallUNet, (1, 2, 16, 12), [10, 6]),
    "fno": (lambda: FNO(**FNO_CONFIG), (1, 2, 17, 13), [9, 8]),
    "afno": (lambda: AFNO(**AFNO_CONFIG), (1, 2, 32, 16), [12, 20]),
    # PhysicsNeMo's 3-D UNet as tests/models/test_cnn_models.py runs it (GroupNorm, MaxPool3d,
    # transposed convs, skip concatenation), depth split 12 + 4.
    "physicsnemo-unet3d": (
        lambda: UNet(
            in_channels=1,
            out_channels=1,
            model_depth=3,
            feature_map_channels=[2, 2, 4, 4, 8, 8],
            gradient_checkpointing=False,
        ),
        (1, 1, 16, 4, 4),
        [12, 4],
    ),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """The ranks are long-lived workers shared across tests: no compiled code crosses a test boundary."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if isinstance(t, (ShardTensor, DTensor)):
        if all(isinstance(p, Replicate) for p in t.placements):  # a reduced parameter gradient
            return t.to_local().detach().clone()
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def _steps(model: nn.Module, call: Any, x: torch.Tensor, cotangent: torch.Tensor) -> list[dict[str, Any]]:
    """``STEPS`` forward+backward passes; per pass the output, the input gradient and every parameter gradient."""
    results = []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = call(x)
        out.backward(cotangent)
        results.append(
            {
                "output": _full(out),
                "input grad": _full(x.grad),
                **{f"grad {n}": _full(p.grad) for n, p in model.named_parameters() if p.requires_grad},
            }
        )
    return results


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    assert a.keys() == b.keys()
    diffs = {}
    for key in a:
        if a[key] is None or b[key] is None:
            assert a[key] is None and b[key] is None, f"{key}: one run has no gradient"
            continue
        assert a[key].shape == b[key].shape, f"{key}: {tuple(a[key].shape)} != {tuple(b[key].shape)}"
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")
        diffs[key] = (a[key] - b[key]).abs().max().item()
    return diffs


def _compile_against_eager(name: str, backend: str, mesh: Any, traced: bool) -> dict[str, float]:
    make, shape, split = MODELS[name]
    torch.manual_seed(0)
    model = make()
    full = torch.randn(shape)
    with torch.no_grad():
        out_shape = model(full).shape
    full_cotangent = torch.randn(out_shape)

    reference = copy.deepcopy(model)
    x_ref = full.clone().requires_grad_(True)
    single = _steps(reference, reference, x_ref, full_cotangent)

    def sharded() -> tuple[torch.Tensor, torch.Tensor]:
        x = shard_tensor(full, mesh, [Shard(2)], split, requires_grad=True)
        return x, shard_tensor(full_cotangent, mesh, [Shard(2)], split)

    eager_model = copy.deepcopy(model)
    eager = _steps(eager_model, eager_model, *sharded())

    compiled_model = copy.deepcopy(model)
    compiled_call = torch.compile(compiled_model, backend=backend, dynamic=False)
    counters["graph_break"].clear()
    start = time.perf_counter()
    with handlers_traced(traced):
        compiled = _steps(compiled_model, compiled_call, *sharded())
    elapsed = time.perf_counter() - start
    breaks = {" ".join(reason.split("\n")[:2])[:400]: n for reason, n in counters["graph_break"].items()}

    worst: dict[str, float] = {}
    for step in range(STEPS):
        vs_eager = _max_diff(compiled[step], eager[step])
        vs_single = _max_diff(compiled[step], single[step])
        _max_diff(eager[step], single[step])
        worst["compiled vs eager"] = max(worst.get("compiled vs eager", 0.0), *vs_eager.values())
        worst["compiled vs single-process"] = max(worst.get("compiled vs single-process", 0.0), *vs_single.values())
    print(f"[compile] {name} {backend}: {worst}, compiled {STEPS} steps in {elapsed:.1f} s, breaks {breaks}")
    # Every first-party handler these models meet is traced: no graph break but AFNO's documented one.
    unexpected = {reason: n for reason, n in breaks.items() if not (name == "afno" and AFNO_BREAK in reason)}
    assert not traced or not unexpected, f"{name}: graph breaks {breaks}"
    return worst


@pytest.mark.multirank(2, timeout=300)
@pytest.mark.parametrize("name", ["unet", "fno", "afno", "physicsnemo-unet3d"])
def test_compiled_model_matches_eager_aot_eager(domain_mesh, name):
    worst = _compile_against_eager(name, "aot_eager", domain_mesh, traced=True)
    # aot_eager runs the same kernels as eager, and every sharded op runs eagerly: identical numbers.
    assert worst["compiled vs eager"] == 0.0, worst


@pytest.mark.multirank(2, timeout=600)
@pytest.mark.parametrize("name", ["unet", "fno", "afno"])
def test_compiled_model_matches_eager_inductor(domain_mesh, name):
    # Handlers eager (the default policy): traced handlers under inductor are not the default yet.
    worst = _compile_against_eager(name, "inductor", domain_mesh, traced=False)
    assert worst["compiled vs single-process"] <= ATOL + RTOL, worst


# -- PhysicsNeMo's zoo models and a ViT under check_conformance(compile="aot_eager") ------------------------------
def _zoo_case(name: str, mesh: Any) -> tuple[Any, list[torch.Tensor], list[Any], dict[str, Any]]:
    from physicsnemo_shardext.testing.model_init import redraw_zero_parameters, without_random_masks
    from tests.models.test_model_zoo import zoo

    entry = zoo.ZOO[name]
    model, inputs = entry.build()
    without_random_masks(model)
    redraw_zero_parameters(model)
    specs = entry.specs(mesh, inputs)
    return model, inputs, specs, dict(rtol=entry.rtol, atol=entry.atol, kwargs=entry.kwargs, params=entry.params)


def _vit_case(mesh: Any) -> tuple[Any, list[torch.Tensor], list[Any], dict[str, Any]]:
    from physicsnemo_shardext.testing import ShardSpec
    from tests.models.test_transformer_models import _vit

    options = dict(rtol=1e-4, atol=1e-5, expected_placements=[Replicate()])
    return _vit(), [torch.randn(1, 2, 16, 16)], [ShardSpec(mesh, [Shard(2)], [12, 4])], options


@pytest.mark.multirank(2, timeout=600)
@pytest.mark.parametrize("name", ["pix2pix", "songunet", "vit"])
def test_model_compiles_into_one_graph_and_matches(domain_mesh, name):
    """Compiled forward+backward (two steps) equals eager and single-process with no graph break: every
    first-party handler these models meet (halos, norms, attention, layout ops) is traced."""
    from physicsnemo_shardext.testing import check_conformance

    torch.manual_seed(0)
    model, inputs, specs, options = _vit_case(domain_mesh) if name == "vit" else _zoo_case(name, domain_mesh)
    counters["graph_break"].clear()
    with handlers_traced(True):
        check_conformance(model, inputs, specs, compile="aot_eager", **options)
    breaks = {" ".join(reason.split("\n")[:2])[:400]: n for reason, n in counters["graph_break"].items()}
    # SongUNet's `x.add_(params)`: in-place updates run eagerly (patches/pointwise.py, in_place_eagerly).
    unexpected = {r: n for r, n in breaks.items() if not (name == "songunet" and "torch.Tensor.add_" in r)}
    assert not unexpected, f"{name}: graph breaks {breaks}"
