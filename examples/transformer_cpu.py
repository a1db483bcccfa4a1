"""Train a transformer domain-parallel: a ViT on a sharded image, or a causal language model on a sharded sequence.

The same script runs on a laptop CPU (gloo) and on GPUs (NCCL)::

    torchrun --nproc-per-node 2 examples/transformer_cpu.py --model vit
    torchrun --nproc-per-node 4 examples/transformer_cpu.py --model lm --ddp 2
    torchrun --nproc-per-node 4 examples/transformer_cpu.py --model vit --height 40   # 4 ranks, uneven rows

Neither model knows it is sharded. The ViT is timm's ``VisionTransformer``
(patch embedding, ``flatten(2).transpose(1, 2)`` into tokens, self-attention
blocks, average pool, class head) on an image whose rows are split over the
domain ranks in whole patch rows. The language model is a small decoder written
here: token embedding, causal ``F.scaled_dot_product_attention``, MLP, a
next-token cross-entropy over a sequence split over the domain ranks (unevenly
when the length does not divide). What the first-party plugins do for them:
the ``attention`` family runs the self-attention as a ring (K/V blocks passed
around the domain ranks, memory ``O(L/N)``), ``linear`` the embedding lookup,
``losses`` the pooling and the loss over the sharded tokens.

The script first runs a few seeded steps both ways with
`physicsnemo_shardext.training.verification.verify_training` (losses, every first-step
gradient, final parameters against one process) and exits with status 1 on a
mismatch; then it trains and logs the ddp-averaged loss.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import physicsnemo_shardext
from physicsnemo_shardext.training.parallel import build_layout, ddp_mean, scatter_input, scatter_target, wrap_model
from physicsnemo_shardext.training.verification import verify_training


# --8<-- [start:models]
class CausalLM(torch.nn.Module):
    """A one-block decoder: token and learned position embeddings, causal self-attention, MLP, LM head."""

    def __init__(
        self,
        vocab: int,
        width: int = 32,
        heads: int = 4,
        length: int = 256,
        mlp_ratio: int = 4,
        position_scale: float = 0.02,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.tokens = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(position_scale * torch.randn(1, length, width))
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        hidden = mlp_ratio * width
        self.mlp = torch.nn.Sequential(
            torch.nn.LayerNorm(width), torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width)
        )
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.position[:, : ids.shape[1]]
        batch, length, width = x.shape
        q, k, v = (
            t.reshape(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the ring, on any backend
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return self.head(x + self.mlp(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits ``(B, L, V)`` (sharded on L) against the next tokens ``(B, L)``."""
    return F.cross_entropy(logits.transpose(1, 2), targets)


def vision_transformer(args: argparse.Namespace) -> torch.nn.Module:
    """timm's ViT, unmodified: no class token (a global token would sit on one rank), average pooling."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=(args.height, args.width),
        patch_size=args.patch,
        in_chans=3,
        num_classes=4,
        embed_dim=32,
        depth=2,
        num_heads=4,
        class_token=False,
        global_pool="avg",
    )


# --8<-- [end:models]


def make_batches(args: argparse.Namespace, samples: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches, the same on every rank (a fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    if args.model == "lm":
        ids = torch.randint(0, args.vocab, (args.batches, samples, args.length + 1), generator=g)
        return [(seq[:, :-1], seq[:, 1:]) for seq in ids]  # inputs and their next tokens
    images = torch.randn(args.batches, samples, 3, args.height, args.width, generator=g)
    return [(image, image.mean((2, 3)).repeat(1, 2)[:, :4]) for image in images]  # regress channel means


def split(total: int, parts: int, unit: int = 1) -> list[int]:
    """Rows per domain rank, as even as possible in whole units (patch rows for the ViT)."""
    units = total // unit
    return [unit * (units // parts + (r < units % parts)) for r in range(parts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["vit", "lm"], default="vit")
    parser.add_argument("--ddp", type=int, default=1, help="data-parallel replicas (the rest is the domain axis)")
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--length", type=int, default=99, help="LM sequence length")
    parser.add_argument("--vocab", type=int, default=17)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    manager = physicsnemo_shardext.initialize()
    # --8<-- [start:train]
    layout = build_layout(ddp=args.ddp)  # ("ddp", "domain") mesh; domain = world size / ddp
    if args.model == "lm":
        make_model: Callable[[], torch.nn.Module] = lambda: CausalLM(args.vocab, length=args.length)  # noqa: E731
        shard_dim, sizes, loss_fn = 1, split(args.length, layout.domain_size), next_token_loss
    else:
        make_model = lambda: vision_transformer(args)  # noqa: E731
        shard_dim, sizes, loss_fn = 2, split(args.height, layout.domain_size, args.patch), F.mse_loss
    batches = [(x.to(manager.device), y.to(manager.device)) for x, y in make_batches(args, layout.ddp_size)]
    wrapper = "ddp" if layout.ddp_size > 1 else "none"

    # SGD for the check: the key bias of self-attention has a gradient of exactly zero in theory (a
    # softmax does not see a constant added to every score), and Adam would turn its rounding noise
    # (~1e-9) into full-size steps on both sides. Every first-step gradient is compared anyway.
    report = verify_training(
        make_model,
        batches,
        layout,
        shard_dim=shard_dim,
        sizes=sizes,
        loss_fn=loss_fn,
        wrapper=wrapper,
        optimizer="sgd",
        lr=0.1,
        steps=3,
        rtol=1e-4,
    )
    if manager.rank == 0:
        print(
            f"{args.model}: ranks {manager.world_size} ({manager.device.type}), ddp {layout.ddp_size}, "
            f"domain split {sizes}"
        )
        print(report.format())

    torch.manual_seed(0)
    model = wrap_model(make_model().to(manager.device), layout, wrapper)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        loss = loss_fn(model(scatter_input(x, layout, shard_dim, sizes=sizes)), scatter_target(y, layout))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        logged = ddp_mean(loss, layout)  # the global-batch loss, the same on every rank
        if manager.rank == 0:
            print(f"step {step}: loss {logged:.5f}")
    # --8<-- [end:train]
    physicsnemo_shardext.shutdown()
    physicsnemo_shardext.exit_rank(0 if report.ok else 1)  # no interpreter teardown under torchrun


if __name__ == "__main__":
    main()
