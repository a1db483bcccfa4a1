"""Train a small CNN domain-parallel with ShardTensor and compare it with a single process.

Runs the same on a laptop CPU (gloo) and on GPUs (NCCL)::

    torchrun --nproc-per-node 2 examples/domain_parallel_cpu.py
    torchrun --nproc-per-node 4 examples/domain_parallel_cpu.py --height 37 --steps 5

Each rank holds a horizontal band of one image (bands are uneven when the
height does not divide). ``import physicsnemo_shardext`` installs the
plugins (here the first-party pointwise activations), and
``physicsnemo_shardext.initialize()`` brings up ``DistributedManager`` on
CPU, where PhysicsNeMo 2.2.2's own initializer fails. Every rank also runs
the model on the full image, so the script can report how far the sharded
loss, output and gradients are from the single-process run.
"""

from __future__ import annotations

import argparse
import copy

import torch
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
from torch.distributed.tensor import Replicate, Shard

import physicsnemo_shardext


def build_model(channels: int) -> torch.nn.Module:
    """A small conv net whose activations are handled by the first-party pointwise plugin."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, channels, 3, padding=1),
        torch.nn.GELU(),
        torch.nn.Conv2d(channels, channels, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv2d(channels, 1, 3, padding=1),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=33, help="image height, the sharded dimension")
    parser.add_argument("--width", type=int, default=24)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    manager = physicsnemo_shardext.initialize()  # gloo on CPU, NCCL on GPU
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    mesh = manager.initialize_mesh((-1,), ("domain",))
    device = manager.device

    torch.manual_seed(0)  # same model, data and target on every rank
    image = torch.randn(1, 3, args.height, args.width, device=device)
    target = torch.randn(1, 1, args.height, args.width, device=device)
    reference_model = build_model(args.channels).to(device)
    # Parameters stay plain (ShardTensor promotes them where they meet a sharded activation
    # and reduces their gradients over the mesh); they only need to start equal on every rank.
    sharded_model = copy.deepcopy(reference_model)
    with torch.no_grad():
        for tensor in [*sharded_model.parameters(), *sharded_model.buffers()]:
            torch.distributed.broadcast(tensor, src=0)

    sharded_image = scatter_tensor(image, 0, mesh, (Shard(2),))  # the input sharded on H
    sharded_target = scatter_tensor(target, 0, mesh, (Replicate(),))  # the target replicated
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=0.05)
    sharded_opt = torch.optim.SGD(sharded_model.parameters(), lr=0.05)

    worst = 0.0
    for step in range(args.steps):
        reference_loss = ((reference_model(image) - target) ** 2).mean()
        sharded_output = sharded_model(sharded_image)
        sharded_loss = ((sharded_output - sharded_target) ** 2).mean()
        reference_opt.zero_grad()
        sharded_opt.zero_grad()
        reference_loss.backward()
        sharded_loss.backward()
        grad_error = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(sharded_model.parameters(), reference_model.parameters())
        )
        loss_value = sharded_loss.full_tensor().item() if isinstance(sharded_loss, ShardTensor) else float(sharded_loss)
        loss_error = abs(loss_value - reference_loss.item())
        worst = max(worst, loss_error, grad_error)
        if manager.rank == 0:
            print(
                f"step {step}: loss sharded {loss_value:.6f} single-process {reference_loss.item():.6f} "
                f"|dloss| {loss_error:.2e} max|dgrad| {grad_error:.2e}"
            )
        reference_opt.step()
        sharded_opt.step()

    output_error = (sharded_model(sharded_image).full_tensor() - reference_model(image)).abs().max().item()
    worst = max(worst, output_error)
    local_heights = [s[2] for s in sharded_image._spec.sharding_shapes()[0]]
    registry = physicsnemo_shardext.get_registry()
    if manager.rank == 0:
        plugins = ", ".join(f"{r.plugin.name} ({r.plugin.distribution})" for r in registry.reports())
        print(f"ranks {manager.world_size} ({device.type}), shard heights {local_heights}, plugins: {plugins}")
        verdict = "MATCH" if worst <= args.tolerance else "MISMATCH"
        print(
            f"final output max|diff| {output_error:.2e}; worst difference {worst:.2e} -> {verdict} (tol {args.tolerance})"
        )
    physicsnemo_shardext.shutdown()
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    physicsnemo_shardext.exit_rank(main())  # no interpreter teardown under torchrun: see exit_rank
