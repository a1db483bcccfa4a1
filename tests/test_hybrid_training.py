"""The smoke matrix of PhysicsNeMo's ShardTensor guidance, on 4 CPU ranks: hybrid training equals one process.

Each cell trains PhysicsNeMo's FNO (defaults) or AFNO (its ``pos_embed`` a
spatial parameter on the FSDP2 path) for a few SGD steps through
`physicsnemo_shardext.training.verification.verify_training`, against the single-process
run of the same global batches (the baseline every cell carries), and asserts:
losses, every parameter gradient at the first step and the parameters at the end
within ``1e-5`` relative in fp32, and parameters identical on every rank.

Cells: ddp=4; domain=4 (no wrapper: the broadcast path); ddp=2 x domain=2 with
DDP; the same with FSDP2; FSDP2 with ddp=1; inference only; each with and
without ``torch.compile`` (the compiled cells beyond a representative pair are
marked ``slow``: ``pytest --run-slow`` runs all). The expected failures (a world
size that does not factor, two samples in one domain group) raise clear errors.
The example script is run through ``torchrun`` for two cells.
``SHARDEXT_MATRIX_LOG=FILE`` appends each cell's report to ``FILE`` (the numbers
quoted in docs/training.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5

#: cell id -> (ddp, domain, wrapper, train)
CELLS = {
    "ddp4": (4, 1, "ddp", True),
    "domain4-none": (1, 4, "none", True),
    "ddp2xdomain2-ddp": (2, 2, "ddp", True),
    "ddp2xdomain2-fsdp2": (2, 2, "fsdp2", True),
    "domain4-fsdp2": (1, 4, "fsdp2", True),
    "ddp2xdomain2-inference": (2, 2, "ddp", False),
}

#: compiled cells CI runs; the others are marked slow.
COMPILED_IN_CI = {("fno", "ddp2xdomain2-ddp"), ("afno", "domain4-fsdp2")}

HEIGHT, WIDTH, PATCH = 36, 24, 4


def _model_factory(model: str):
    from physicsnemo.models.afno import AFNO
    from physicsnemo.models.fno import FNO

    if model == "afno":
        return lambda: AFNO(
            inp_shape=[HEIGHT, WIDTH],
            in_channels=2,
            out_channels=1,
            patch_size=[PATCH, PATCH],
            embed_dim=8,
            depth=1,
            num_blocks=2,
        )
    return lambda: FNO(
        in_channels=2,
        out_channels=1,
        dimension=2,
        latent_channels=8,
        num_fno_layers=2,
        num_fno_modes=4,
        decoder_layers=1,
        decoder_layer_size=16,
    )


def _sizes(model: str, domain: int) -> list[int]:
    # Uneven where the domain allows it; whole patches for AFNO.
    if domain == 1:
        return [HEIGHT]
    if model == "afno":
        return {2: [20, 16], 4: [12, 8, 8, 8]}[domain]
    return {2: [19, 17], 4: [10, 9, 9, 8]}[domain]


def _batches(ddp: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(steps):
        x = torch.randn(ddp, 2, HEIGHT, WIDTH, generator=generator)
        batches.append((x, F.avg_pool2d(x[:, :1], 3, stride=1, padding=1) + 0.5 * x[:, :1] * x[:, 1:]))
    return batches


def _cell_params():
    params = []
    for model in ("fno", "afno"):
        for cell in CELLS:
            params.append(pytest.param(model, cell, False, id=f"{model}-{cell}"))
            marks = () if (model, cell) in COMPILED_IN_CI else (pytest.mark.slow,)
            params.append(pytest.param(model, cell, True, id=f"{model}-{cell}-compiled", marks=marks))
    return params


@pytest.mark.multirank(4, timeout=600)
@pytest.mark.parametrize(("model", "cell", "compiled"), _cell_params())
def test_smoke_matrix_cell_matches_single_process(model, cell, compiled, rank):
    from physicsnemo_shardext.training.parallel import build_layout
    from physicsnemo_shardext.training.verification import verify_training

    if compiled:
        torch._dynamo.reset()
    ddp, domain, wrapper, train = CELLS[cell]
    layout = build_layout(ddp, domain)
    report = verify_training(
        _model_factory(model),
        _batches(ddp, 3),
        layout,
        shard_dim=2,
        sizes=_sizes(model, domain),
        wrapper=wrapper,
        spatial_parameters=["pos_embed"] if (model == "afno" and wrapper == "fsdp2") else (),
        steps=3,
        lr=1e-2,
        optimizer="sgd",
        compile=compiled,
        train=train,
        rtol=RTOL,
    )
    if os.environ.get("SHARDEXT_MATRIX_LOG") and rank == 0:  # the measured matrix, for the docs
        with open(os.environ["SHARDEXT_MATRIX_LOG"], "a") as log:
            log.write(f"== {model}-{cell}{'-compiled' if compiled else ''}\n{report.format()}\n")
    assert report.ok, report.format()
    assert report.params_identical_across_ranks, report.format()
    if train:
        assert len(report.sharded_losses) == 3


@pytest.mark.multirank(4)
def test_a_world_size_that_does_not_factor_is_refused(rank):
    from physicsnemo_shardext.training.parallel import build_layout

    with pytest.raises(ValueError, match="3"):
        build_layout(3, None)
    with pytest.raises(ValueError, match="ddp 3 x domain 2"):
        build_layout(3, 2)


@pytest.mark.multirank(4)
def test_two_samples_in_one_domain_group_are_refused(rank):
    from physicsnemo_shardext.training.parallel import build_layout, scatter_input

    layout = build_layout(2, 2)
    with pytest.raises(ValueError, match="one sample per domain group"):
        scatter_input(torch.randn(4, 2, HEIGHT, WIDTH), layout, dim=2)


def _torchrun(*options: str, ranks: int = 4) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(REPO / "examples" / "train_hybrid.py"),
            "--batches",
            "2",
            "--epochs",
            "1",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize(
    "options",
    [("--ddp", "2", "--wrapper", "ddp"), ("--ddp", "2", "--wrapper", "fsdp2", "--model", "afno")],
    ids=["fno-ddp", "afno-fsdp2"],
)
def test_example_script_trains_and_verifies(options):
    result = _torchrun(*options)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert re.search(r"ddp 2 x domain 2 \(cpu\)", result.stdout), result.stdout
    assert "trained 2 steps" in result.stdout


@pytest.mark.slow
def test_example_script_with_compile_and_bf16_autocast():
    result = _torchrun("--domain", "2", "--wrapper", "none", "--compile", "--amp", "bf16", ranks=2)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "compile True, amp bf16" in result.stdout and "training check ok" in result.stdout
    worst = float(re.search(r"worst: .*?rel error (\S+)", result.stdout).group(1))
    assert worst < 5e-2  # bf16 forward against the single-process bf16 forward, in another order
