"""Train a PhysicsNeMo model with ddp x domain parallelism, then check the run against a single process.

The same script runs on a laptop CPU (gloo) and on GPUs (NCCL)::

    torchrun --nproc-per-node 4 examples/train_hybrid.py --ddp 2 --domain 2 --wrapper ddp
    torchrun --nproc-per-node 4 examples/train_hybrid.py --domain 4 --wrapper none --model afno
    torchrun --nproc-per-node 4 examples/train_hybrid.py --ddp 2 --domain 2 --wrapper fsdp2 --model afno
    torchrun --nproc-per-node 2 examples/train_hybrid.py --domain 2 --compile --amp bf16

It follows PhysicsNeMo's ShardTensor guidance step by step (the numbered comments
in ``train``): a 2-D ("ddp", "domain") mesh, one sample per domain group, inputs
sharded over the domain axis (unevenly when the height does not divide), targets
replicated, parameters left plain and broadcast over the domain axis, DDP on the
ddp axis or FSDP2 on the ddp mesh (AFNO's ``pos_embed`` then becomes a DTensor on
the domain mesh), optimizer groups split by mesh, and a ddp-averaged loss for
logging. The model itself is PhysicsNeMo's, unmodified.

Before training, ``--verify`` (on by default) runs a few seeded steps both ways
with `physicsnemo_shardext.training.verification.verify_training` and prints how far the
losses, every first-step gradient and the final parameters are from the
single-process run; the script exits with status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from physicsnemo.models.afno import AFNO
from physicsnemo.models.fno import FNO

import physicsnemo_shardext
from physicsnemo_shardext.training.parallel import (
    build_layout,
    ddp_mean,
    param_groups,
    scatter_input,
    scatter_target,
    wrap_model,
)
from physicsnemo_shardext.training.verification import verify_training

#: Parameters made DTensors on the domain mesh on the FSDP2 path (statically shaped, spatial).
SPATIAL_PARAMETERS = {"afno": ["pos_embed"], "fno": []}


def model_factory(args: argparse.Namespace) -> Callable[[], torch.nn.Module]:
    """A function building the (unmodified) PhysicsNeMo model: FNO with its defaults, or AFNO."""
    if args.model == "afno":
        return lambda: AFNO(
            inp_shape=[args.height, args.width],
            in_channels=2,
            out_channels=1,
            patch_size=[args.patch, args.patch],
            embed_dim=args.latent,
            depth=2,
            num_blocks=2,
        )
    return lambda: FNO(
        in_channels=2,
        out_channels=1,
        dimension=2,
        latent_channels=args.latent,
        num_fno_layers=2,
        num_fno_modes=args.modes,
        decoder_layers=1,
        decoder_layer_size=16,
    )


def shard_heights(args: argparse.Namespace, domain: int) -> list[int]:
    """Rows per domain rank: as even as possible, in whole patches for AFNO (a split inside a patch means nothing)."""
    unit = args.patch if args.model == "afno" else 1
    units = args.height // unit
    return [unit * (units // domain + (r < units % domain)) for r in range(domain)]


def make_batches(
    args: argparse.Namespace, samples: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (field, target), the same on every rank: target = smoothed channel 0 + channel product."""
    generator = torch.Generator().manual_seed(1234)  # the same global batches on every rank
    batches = []
    for _ in range(args.batches):
        field = torch.randn(samples, 2, args.height, args.width, generator=generator).to(device)
        smooth = F.avg_pool2d(field[:, :1], 5, stride=1, padding=2, count_include_pad=False)
        batches.append((field, smooth + 0.5 * field[:, :1] * field[:, 1:]))
    return batches


def autocast(args: argparse.Namespace, device: torch.device):  # noqa: ANN201 - a context manager
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# --8<-- [start:train]
def train(args: argparse.Namespace) -> float:
    """The training script a user writes, step by step; returns the last ddp-averaged loss."""
    # 1. Mesh: both axes always, one inferred from the world size (clear error if it does not factor).
    layout = build_layout(args.ddp, args.domain)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if layout.mesh.device_type == "cuda" else torch.device("cpu")
    )
    # 2. Same seed everywhere: the model starts identical; the domain broadcast in wrap_model makes sure.
    torch.manual_seed(0)
    model = model_factory(args)().to(device)
    # 3-5. Domain broadcast of plain parameters and buffers, then the wrapper on the ddp axis.
    model = wrap_model(
        model,
        layout,
        args.wrapper,
        spatial_parameters=SPATIAL_PARAMETERS[args.model] if args.wrapper == "fsdp2" else (),
    )
    if args.compile:
        model = torch.compile(model, dynamic=False)
    # 6. Optimizer after wrapping, one parameter group per mesh.
    optimizer = torch.optim.AdamW(param_groups(model), lr=args.lr)
    heights = shard_heights(args, layout.domain_size)
    loss_value = float("nan")
    for step, (field, target) in enumerate(make_batches(args, layout.ddp_size, device) * args.epochs):
        # 2-3. This ddp group's one sample: the field sharded on H, the target replicated.
        x = scatter_input(field, layout, dim=2, sizes=heights)
        y = scatter_target(target, layout)
        with autocast(args, device):
            prediction = model(x)
        # 7. A plain loss on the sharded output and the replicated target.
        loss = F.mse_loss(prediction.float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # 8. Log a ddp-averaged scalar from rank 0.
        loss_value = ddp_mean(loss, layout)
        if torch.distributed.get_rank() == 0:
            print(f"step {step:3d}: loss {loss_value:.6f}")
    return loss_value


# --8<-- [end:train]


# --8<-- [start:verify]
def verify(args: argparse.Namespace) -> bool:
    """9. A few seeded steps domain-parallel and single-process: losses, every gradient, final parameters."""
    layout = build_layout(args.ddp, args.domain)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if layout.mesh.device_type == "cuda" else torch.device("cpu")
    )
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    report = verify_training(
        model_factory(args),
        make_batches(args, layout.ddp_size, device)[: args.verify_steps],
        layout,
        shard_dim=2,
        sizes=shard_heights(args, layout.domain_size),
        wrapper=args.wrapper,
        spatial_parameters=SPATIAL_PARAMETERS[args.model] if args.wrapper == "fsdp2" else (),
        steps=args.verify_steps,
        compile=args.compile,
        autocast_dtype=amp,
        train=not args.inference,
        rtol=args.tolerance,
    )
    if torch.distributed.get_rank() == 0:
        print(
            f"{args.model}: ddp {layout.ddp_size} x domain {layout.domain_size} ({layout.mesh.device_type}), "
            f"wrapper {args.wrapper}, compile {args.compile}, amp {args.amp}, shard heights "
            f"{shard_heights(args, layout.domain_size)}"
        )
        print(report.format())
    return report.ok


# --8<-- [end:verify]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("fno", "afno"), default="fno")
    parser.add_argument("--ddp", type=int, default=None, help="data-parallel size (inferred if omitted)")
    parser.add_argument("--domain", type=int, default=None, help="domain-parallel size (inferred if omitted)")
    parser.add_argument("--wrapper", choices=("none", "ddp", "fsdp2"), default="ddp")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model, dynamic=False)")
    parser.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none", help="autocast the forward")
    parser.add_argument("--inference", action="store_true", help="verify the forward only")
    parser.add_argument(
        "--height",
        type=int,
        default=None,
        help="grid height, the sharded dimension (default 37 for FNO, 36 for AFNO: uneven bands)",
    )
    parser.add_argument("--width", type=int, default=24)
    parser.add_argument("--patch", type=int, default=4, help="AFNO patch size (height and width must divide)")
    parser.add_argument("--latent", type=int, default=8, help="FNO latent channels / AFNO embedding size")
    parser.add_argument("--modes", type=int, default=6, help="FNO Fourier modes per dimension")
    parser.add_argument("--batches", type=int, default=3, help="synthetic global batches (ddp samples each)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--verify-steps", type=int, default=3)
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="relative tolerance of the verification (default 1e-5 in fp32, 5e-2 under --amp)",
    )
    args = parser.parse_args(argv)
    if args.height is None:
        args.height = 36 if args.model == "afno" else 37
    if args.tolerance is None:
        args.tolerance = 1e-5 if args.amp == "none" else 5e-2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    physicsnemo_shardext.initialize()  # gloo on CPU, NCCL on GPU; torchrun and SLURM variables alike
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ok = verify(args) if args.verify else True
        if not args.inference:
            last = train(args)
            if torch.distributed.get_rank() == 0:
                print(f"trained {args.batches * args.epochs} steps, last ddp-averaged loss {last:.6f}")
    finally:
        physicsnemo_shardext.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    physicsnemo_shardext.exit_rank(main())  # no interpreter teardown under torchrun: see exit_rank
