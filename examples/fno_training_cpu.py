"""Train PhysicsNeMo's FNO (or AFNO) domain-parallel with ShardTensor and check its loss tracks a single process.

Runs the same on a laptop CPU (gloo) and on GPUs (NCCL)::

    torchrun --nproc-per-node 2 examples/fno_training_cpu.py
    torchrun --nproc-per-node 4 examples/fno_training_cpu.py --height 37 --steps 20
    torchrun --nproc-per-node 2 examples/fno_training_cpu.py --model afno --height 36

The task is synthetic: map a random 2-channel field to a fixed smoothing of it
(a low-pass filter plus a product of the channels), an operator an FNO learns
quickly. Each rank holds a horizontal band of every sample (bands are uneven
when the height does not divide; for AFNO they follow patch rows). The model is
``physicsnemo.models.fno.FNO`` with its default options, or
``physicsnemo.models.afno.AFNO``, unmodified: ``import physicsnemo_shardext``
installs the plugins that make its ``rfft2``/``irfft2``, spectral mode slicing,
complex ``einsum``, coordinate features and AFNO's buffers work on the sharded field, and ``physicsnemo_shardext.initialize()`` brings up
``DistributedManager`` on CPU, where PhysicsNeMo 2.2.2's own initializer fails.

Every rank also trains an identical copy of the model on the full samples with
the same seed (the single-process run), and prints both loss curves; the script
exits with status 1 if the two ever differ by more than ``--tolerance``
(relative), or if the weights drift apart.
"""

from __future__ import annotations

import argparse
import copy

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.models.afno import AFNO
from physicsnemo.models.fno import FNO
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import physicsnemo_shardext


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A small 2-D FNO (FNO's defaults: domain padding, coordinate features) or AFNO; 2 channels in, 1 out."""
    if args.model == "afno":
        return AFNO(
            inp_shape=[args.height, args.width],
            in_channels=2,
            out_channels=1,
            patch_size=[args.patch, args.patch],
            embed_dim=args.latent,
            depth=2,
            num_blocks=2,
        )
    return FNO(
        in_channels=2,
        out_channels=1,
        dimension=2,
        latent_channels=args.latent,
        num_fno_layers=2,
        num_fno_modes=args.modes,
        decoder_layers=1,
        decoder_layer_size=16,
    )


def shard_heights(args: argparse.Namespace, world_size: int) -> list[int]:
    """Rows per rank: as even as possible, in whole patches for AFNO (a split inside a patch means nothing)."""
    unit = args.patch if args.model == "afno" else 1
    units = args.height // unit
    return [unit * (units // world_size + (r < units % world_size)) for r in range(world_size)]


def scatter_rows(full: torch.Tensor, mesh: DeviceMesh, heights: list[int]) -> ShardTensor:
    """This rank's band of ``full`` (the same on every rank) as a ShardTensor sharded on H with ``heights``."""
    rank = mesh.get_local_rank()
    start = sum(heights[:rank])
    local = full[:, :, start : start + heights[rank]].contiguous()
    shapes = {0: tuple(torch.Size([*full.shape[:2], h, *full.shape[3:]]) for h in heights)}
    return ShardTensor.from_local(local, mesh, [Shard(2)], sharding_shapes=shapes)


def replicated(full: torch.Tensor, mesh: DeviceMesh) -> ShardTensor:
    """``full`` (the same on every rank) as a Replicate ShardTensor: what a target should be."""
    return ShardTensor.from_local(full, mesh, [Replicate()])


def make_dataset(
    samples: int, height: int, width: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs (field, target): target = low-pass(channel 0) + 0.5 * channel 0 * channel 1."""
    pairs = []
    for _ in range(samples):
        field = torch.randn(1, 2, height, width, device=device)
        spectrum = torch.fft.rfft2(field[:, :1])
        keep = torch.zeros_like(spectrum.real)
        keep[..., :4, :4] = keep[..., -4:, :4] = 1.0  # the lowest modes, both signs of the H frequency
        target = torch.fft.irfft2(spectrum * keep, s=(height, width)) + 0.5 * field[:, :1] * field[:, 1:]
        pairs.append((field, target))
    return pairs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("fno", "afno"), default="fno")
    parser.add_argument("--height", type=int, default=33, help="grid height, the sharded dimension")
    parser.add_argument("--width", type=int, default=24)
    parser.add_argument("--patch", type=int, default=4, help="AFNO patch size (height and width must divide)")
    parser.add_argument("--latent", type=int, default=8, help="FNO latent channels / AFNO embedding size")
    parser.add_argument("--modes", type=int, default=6, help="Fourier modes kept per dimension")
    parser.add_argument("--samples", type=int, default=2, help="synthetic samples, one per step (cycled)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max relative loss difference")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    manager = physicsnemo_shardext.initialize()  # gloo on CPU, NCCL on GPU
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    mesh = manager.initialize_mesh((-1,), ("domain",))
    device = manager.device

    torch.manual_seed(0)  # same model and data on every rank, and for both runs
    reference_model = build_model(args).to(device)
    # Parameters stay plain, as PhysicsNeMo's guidance says (ShardTensor promotes them where
    # they meet a sharded activation); they only need to start equal on every rank.
    sharded_model = copy.deepcopy(reference_model)
    with torch.no_grad():
        for tensor in [*sharded_model.parameters(), *sharded_model.buffers()]:
            torch.distributed.broadcast(tensor, src=0)
    data = make_dataset(args.samples, args.height, args.width, device)
    heights = shard_heights(args, manager.world_size)
    # The field sharded on H, the target replicated.
    sharded_data = [(scatter_rows(x, mesh, heights), replicated(y, mesh)) for x, y in data]
    reference_opt = torch.optim.Adam(reference_model.parameters(), lr=args.lr)
    sharded_opt = torch.optim.Adam(sharded_model.parameters(), lr=args.lr)

    worst = 0.0
    curves: list[tuple[float, float]] = []
    for step in range(args.steps):
        field, target = data[step % len(data)]
        sharded_field, sharded_target = sharded_data[step % len(data)]
        reference_loss = ((reference_model(field) - target) ** 2).mean()
        sharded_loss = ((sharded_model(sharded_field) - sharded_target) ** 2).mean()
        reference_opt.zero_grad()
        sharded_opt.zero_grad()
        reference_loss.backward()
        sharded_loss.backward()
        reference_opt.step()
        sharded_opt.step()

        loss = sharded_loss.full_tensor().item() if isinstance(sharded_loss, ShardTensor) else float(sharded_loss)
        relative = abs(loss - reference_loss.item()) / max(abs(reference_loss.item()), 1e-12)
        worst = max(worst, relative)
        curves.append((loss, reference_loss.item()))
        if manager.rank == 0:
            print(
                f"step {step:3d}: loss sharded {loss:.6f} single-process {reference_loss.item():.6f} rel.diff {relative:.2e}"
            )

    # The weights after training must agree too (a wrong gradient can hide behind a similar loss).
    weight_error = max(
        (p - q).abs().max().item() for p, q in zip(sharded_model.parameters(), reference_model.parameters())
    )
    local_heights = [s[2] for s in sharded_data[0][0]._spec.sharding_shapes()[0]]
    ok = worst <= args.tolerance and weight_error <= args.tolerance
    if manager.rank == 0:
        reports = physicsnemo_shardext.get_registry().reports()
        plugins = ", ".join(r.plugin.name for r in reports if r.status.value == "loaded")
        print(
            f"{args.model}: ranks {manager.world_size} ({device.type}), shard heights {local_heights}, plugins: {plugins}"
        )
        print(f"loss curve sharded:        {' '.join(f'{a:.4f}' for a, _ in curves)}")
        print(f"loss curve single-process: {' '.join(f'{b:.4f}' for _, b in curves)}")
        print(
            f"loss {curves[0][1]:.4f} -> {curves[-1][1]:.4f}; worst relative loss difference {worst:.2e}, "
            f"max weight difference {weight_error:.2e} -> {'TRACKS' if ok else 'DIVERGES'} (tol {args.tolerance})"
        )
    physicsnemo_shardext.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    physicsnemo_shardext.exit_rank(main())  # no interpreter teardown under torchrun: see exit_rank
