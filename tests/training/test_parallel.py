"""Tests of physicsnemo_shardext.training.parallel: layouts, scattering, wrappers, optimizer groups, checkpoints.

Multi-rank tests run on 4 gloo CPU ranks (one pool for the module). Training
against the single-process reference is in tests/training/test_verification.py.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel
from training_models import PosCNN

from physicsnemo_shardext.training.parallel import (
    ParallelLayout,
    broadcast_parameters,
    build_layout,
    chunk_sizes,
    ddp_mean,
    factorize,
    load_checkpoint,
    param_groups,
    save_checkpoint,
    scatter_input,
    scatter_target,
    shard_spatial_parameters,
    unwrap_model,
    wrap_model,
)

# --------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("world", "ddp", "domain", "expected"),
    [
        (4, None, None, (1, 4)),
        (4, 2, None, (2, 2)),
        (4, None, 2, (2, 2)),
        (4, -1, 4, (1, 4)),
        (4, 4, -1, (4, 1)),
        (4, 1, 4, (1, 4)),
        (1, None, None, (1, 1)),
        (12, 3, None, (3, 4)),
    ],
)
def test_factorize(world, ddp, domain, expected):
    assert factorize(world, ddp, domain) == expected


@pytest.mark.parametrize(
    ("world", "ddp", "domain", "message"),
    [
        (6, 4, None, "cannot split 6 ranks with ddp 4: 4 does not divide 6"),
        (6, None, 4, "cannot split 6 ranks with domain 4: 4 does not divide 6"),
        (8, 2, 2, "cannot split 8 ranks as ddp 2 x domain 2: the product is 4"),
        (4, 0, None, "ddp must be positive"),
        (4, None, -3, "domain must be positive"),
        (0, None, None, "world_size must be positive, got 0"),
    ],
)
def test_factorize_rejects_what_does_not_multiply_out(world, ddp, domain, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        factorize(world, ddp, domain)


def test_chunk_sizes_follow_torch_chunk():
    for size in range(12):
        for parts in range(1, 5):
            sizes = chunk_sizes(size, parts)
            got = [c.shape[0] for c in torch.arange(size).chunk(parts)] if size else []
            assert sizes[: len(got)] == got and sum(sizes) == size and len(sizes) == parts


def test_unwrap_model_and_param_groups_of_plain_modules():
    layer = nn.Linear(2, 3)
    assert unwrap_model(torch.compile(layer)) is layer and unwrap_model(layer) is layer
    frozen = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    frozen[0].weight.requires_grad_(False)
    groups = param_groups(frozen, lr=0.5, weight_decay=0.0)
    assert len(groups) == 1 and len(groups[0]["params"]) == 3 and groups[0]["lr"] == 0.5


def test_build_layout_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="initialize"):
        build_layout()


# --------------------------------------------------------------------------- layouts on 4 ranks


@functools.cache
def _layout(ddp: int) -> ParallelLayout:
    """One layout per shape and worker (creating a mesh is collective; all ranks run the same tests)."""
    return build_layout(ddp=ddp)


@pytest.mark.multirank(4)
def test_build_layout_shapes_and_coordinates(rank, world_size):
    cases = [
        ((2, 2), (2, None)),
        ((4, 1), (4, None)),
        ((1, 4), (1, None)),
        ((1, 4), (None, None)),
        ((2, 2), (None, 2)),
        ((4, 1), (-1, 1)),
    ]
    for (ddp, domain), arguments in cases:
        layout = build_layout(*arguments)
        assert (layout.ddp_size, layout.domain_size, layout.world_size) == (ddp, domain, world_size)
        assert layout.mesh.mesh_dim_names == ("ddp", "domain") and layout.mesh.device_type == "cpu"
        assert tuple(layout.mesh.mesh.shape) == (ddp, domain)
        # row-major: consecutive ranks form a domain group
        assert (layout.ddp_rank, layout.domain_rank) == divmod(rank, domain)
        assert layout.domain_source_rank == rank - rank % domain
        assert layout.ddp_mesh.size() == ddp and layout.domain_mesh.size() == domain
        assert dist.get_process_group_ranks(layout.domain_mesh.get_group()) == [
            layout.domain_source_rank + k for k in range(domain)
        ]
    # the 2 x 2 case in full: (ddp_rank, domain_rank, domain_source_rank) per global rank
    expected = {0: (0, 0, 0), 1: (0, 1, 0), 2: (1, 0, 2), 3: (1, 1, 2)}[rank]
    layout = build_layout(ddp=2)
    assert (layout.ddp_rank, layout.domain_rank, layout.domain_source_rank) == expected
    with pytest.raises(ValueError, match="cannot split 4 ranks with ddp 3"):
        build_layout(ddp=3)
    with pytest.raises(ValueError, match="ddp 3 x domain 2: the product is 6"):
        build_layout(3, 2)


@pytest.mark.multirank(4)
def test_scatter_input_uneven_and_zero_size(rank):
    layout = _layout(2)
    batch = torch.randn(2, 3, 7, 5)  # identical on every rank (seeded per test)
    sample = batch[layout.ddp_rank : layout.ddp_rank + 1]
    for sizes in ([5, 2], [7, 0], None):
        xs = scatter_input(batch, layout, 2, sizes=sizes)
        rows = sizes or chunk_sizes(7, 2)
        start = sum(rows[: layout.domain_rank])
        assert type(xs).__name__ == "ShardTensor" and tuple(xs.placements) == (Shard(2),)
        assert xs.shape == (1, 3, 7, 5)
        assert torch.equal(xs.to_local(), sample[:, :, start : start + rows[layout.domain_rank]])
        assert not xs.requires_grad and xs.to_local().grad_fn is None
        assert torch.equal(xs.full_tensor(), sample)
    # negative dim and an explicit leaf
    xs = scatter_input(batch, layout, -1, requires_grad=True)
    assert xs.requires_grad and xs.is_leaf and tuple(xs.placements) == (Shard(3),)
    xs.sum().backward()
    assert xs.grad is not None


@pytest.mark.multirank(4)
def test_scatter_input_needs_one_sample_per_domain_group(rank):
    layout = _layout(2)
    for bad in (torch.randn(1, 3, 8), torch.randn(4, 3, 8)):
        with pytest.raises(ValueError, match=rf"batch size {bad.shape[0]}.*ddp size 2.*one sample per domain group"):
            scatter_input(bad, layout, 2)
        with pytest.raises(ValueError, match="one sample per domain group"):
            scatter_target(bad, layout)
    with pytest.raises(ValueError, match="non-batch dim"):
        scatter_input(torch.randn(2, 3, 8), layout, 0)
    with pytest.raises(ValueError, match=r"sizes \[5, 2\] do not split dim 2 of size 8"):
        scatter_input(torch.randn(2, 3, 8), layout, 2, sizes=[5, 2])


@pytest.mark.multirank(4)
def test_scatter_input_broadcast_takes_the_domain_source_ranks_batch(rank):
    layout = _layout(2)
    batch = torch.full((2, 1, 6), float(rank))  # differs on every rank
    xs = scatter_input(batch, layout, 2, broadcast=True)
    assert torch.all(xs.to_local() == layout.domain_source_rank)
    ys = scatter_target(batch, layout, broadcast=True)
    assert torch.all(ys.to_local() == layout.domain_source_rank)


@pytest.mark.multirank(4)
def test_scatter_target_is_this_groups_sample_replicated(rank):
    layout = _layout(2)
    targets = torch.randn(2, 1, 7, 5)
    ys = scatter_target(targets, layout)
    assert type(ys).__name__ == "ShardTensor" and tuple(ys.placements) == (Replicate(),)
    assert ys.shape == (1, 1, 7, 5) and not ys.requires_grad
    assert torch.equal(ys.to_local(), targets[layout.ddp_rank : layout.ddp_rank + 1])


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return gathered


@pytest.mark.multirank(4)
def test_broadcast_parameters_makes_each_domain_group_agree(rank):
    layout = _layout(2)
    torch.manual_seed(100 + rank)  # every rank starts with different weights and buffers
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].running_mean.normal_()
    before = torch.cat(
        [t.detach().reshape(-1) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    )
    broadcast_parameters(model, layout)
    after = torch.cat(
        [t.detach().reshape(-1) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    )
    originals, results = _gather(before), _gather(after)
    for r in range(4):
        source = r - r % 2
        assert torch.equal(results[r], originals[source]), f"rank {r} differs from its domain source {source}"
    assert not torch.equal(results[0], results[2])  # groups are independent


@pytest.mark.multirank(4)
def test_broadcast_parameters_skips_dtensors(rank):
    layout = _layout(2)
    model = PosCNN()
    shard_spatial_parameters(model, layout, ["pos_embed"], dim=2)
    local = model.pos_embed.to_local().clone()
    broadcast_parameters(model, layout)
    assert torch.equal(model.pos_embed.to_local(), local)


@pytest.mark.multirank(4)
def test_shard_spatial_parameters_by_name_and_pattern(rank):
    layout = _layout(2)
    torch.manual_seed(0)
    model = nn.Sequential(PosCNN())
    full = model[0].pos_embed.detach().clone()
    with pytest.raises(KeyError, match=r"no parameter matches \['nope', '\*\.missing'\]"):
        shard_spatial_parameters(model, layout, ["nope", "*.missing", "0.pos_embed"], dim=2)
    assert not isinstance(model[0].pos_embed, DTensor)  # nothing changed on error
    assert shard_spatial_parameters(model, layout, ["*.pos_embed"], dim=-2) == ["0.pos_embed"]
    param = model[0].pos_embed
    assert isinstance(param, nn.Parameter) and isinstance(param, DTensor) and param.requires_grad
    assert param.device_mesh == layout.domain_mesh and tuple(param.placements) == (Shard(2),)
    assert param.to_local().shape == (1, 4, (5, 4)[layout.domain_rank], 6)
    assert torch.equal(param.full_tensor(), full)
    assert shard_spatial_parameters(model, layout, ["0.pos_embed"], dim=2) == []  # already done


@pytest.mark.multirank(4)
def test_wrap_model_wrappers(rank):
    layout, single = _layout(2), _layout(1)

    def conv() -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1))

    assert isinstance(wrap_model(conv(), layout, "ddp"), DistributedDataParallel)
    plain = conv()
    assert wrap_model(plain, single, "ddp") is plain  # ddp size 1: DDP skipped
    assert wrap_model(plain, layout, "none") is plain
    sharded = PosCNN()
    assert wrap_model(sharded, single, "fsdp2", spatial_parameters=["pos_embed"], spatial_dim=2) is sharded
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    assert sharded.pos_embed.device_mesh.mesh_dim_names == ("ddp", "domain")  # FSDP2 + domain: 2-D
    with pytest.raises(ValueError, match="spatial_parameters=\\['pos_embed'\\] need wrapper='fsdp2'"):
        wrap_model(PosCNN(), layout, "ddp", spatial_parameters=["pos_embed"])
    with pytest.raises(ValueError, match="unknown wrapper 'fsdp'"):
        wrap_model(conv(), layout, "fsdp")


@pytest.mark.multirank(4)
def test_param_groups_split_by_mesh(rank):
    layout = _layout(2)
    torch.manual_seed(0)
    model = wrap_model(PosCNN(), layout, "fsdp2", spatial_parameters=["pos_embed"], spatial_dim=2)
    groups = param_groups(model, lr=1e-3)
    meshes = [{p.device_mesh.mesh_dim_names for p in g["params"]} for g in groups]
    # the module's own pos_embed comes first in parameters(), then c1 and c2's weights and biases
    assert meshes == [{("ddp", "domain")}, {("ddp",)}], meshes
    assert [len(g["params"]) for g in groups] == [1, 4] and all(g["lr"] == 1e-3 for g in groups)
    optimizer = torch.optim.Adam(groups, foreach=True)  # one mesh per group: foreach kernels work
    x = scatter_input(torch.randn(2, 2, 9, 6), layout, 2)
    model(x).sum().backward()
    optimizer.step()


@pytest.mark.multirank(4)
def test_ddp_mean(rank):
    layout = _layout(2)
    assert ddp_mean(float(layout.ddp_rank), layout) == pytest.approx(0.5)
    assert ddp_mean(torch.tensor(float(rank)), layout) == pytest.approx((layout.domain_rank * 2 + 2) / 2)
    # a loss on ShardTensors (a Replicate scalar): full_tensor first
    xs = scatter_input(torch.arange(2 * 6.0).reshape(2, 1, 6), layout, 2, sizes=[4, 2])
    loss = F.mse_loss(xs, torch.zeros(1, 1, 6))
    expected = (torch.arange(6.0).square().mean() + torch.arange(6.0, 12.0).square().mean()) / 2
    assert ddp_mean(loss, layout) == pytest.approx(float(expected))
    assert ddp_mean(4.0, _layout(1)) == 4.0
    with pytest.raises(ValueError, match="scalar"):
        ddp_mean(torch.ones(2), layout)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, layout: ParallelLayout, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.ddp_size, 2, 9, 6, generator=generator)
    y = torch.randn(layout.ddp_size, 1, 9, 6, generator=generator)
    out = model(scatter_input(x, layout, 2, sizes=[5, 4]))  # pos_embed splits like torch.chunk: 5/4
    F.mse_loss(out, scatter_target(y, layout)).backward()  # a Replicate ShardTensor target
    optimizer.step()
    optimizer.zero_grad()


def _full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.multirank(4, timeout=240)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_checkpoint_resume_equals_uninterrupted_training(rank, tmp_path, wrapper):
    layout = _layout(2)
    spatial = ["pos_embed"] if wrapper == "fsdp2" else []

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = wrap_model(PosCNN(), layout, wrapper, spatial_parameters=spatial, spatial_dim=2)
        return model, torch.optim.Adam(param_groups(model, lr=1e-2))

    path = Path(tmp_path) / f"ckpt-{wrapper}"
    model, optimizer = build(0)
    _train_step(model, optimizer, layout, seed=1)
    save_checkpoint(path, model, optimizer, layout, step=1)
    assert path.is_dir() == (wrapper == "fsdp2") and path.exists()
    _train_step(model, optimizer, layout, seed=2)
    uninterrupted = _full_parameters(model)

    resumed, resumed_optimizer = build(7)  # other weights, empty optimizer state
    assert load_checkpoint(path, resumed, resumed_optimizer, layout) == 1
    _train_step(resumed, resumed_optimizer, layout, seed=2)
    got = _full_parameters(resumed)
    assert got.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(got[name], value), f"{wrapper}: {name} differs after resuming"
    if wrapper == "ddp":  # a plain state dict without DDP's "module." prefix
        saved = torch.load(path, weights_only=True)
        assert set(saved["model"]) == set(unwrap_model(model).state_dict()) and saved["step"] == 1


# --------------------------------------------------------------------------- launching under SLURM

SLURM_CHILD = """
import torch, torch.distributed as dist
import physicsnemo_shardext
from physicsnemo_shardext.training.parallel import build_layout

manager = physicsnemo_shardext.initialize()
assert manager._initialization_method == "slurm", manager._initialization_method
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
layout = build_layout()
print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {manager.local_rank} "
      f"sum {value.item():g} layout {layout.ddp_size}x{layout.domain_size}", flush=True)
physicsnemo_shardext.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_initialize_under_slurm_variables(tmp_path):
    script = tmp_path / "slurm_child.py"
    script.write_text(SLURM_CHILD)
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}}
    env.pop("SLURM_NPROCS", None)
    env.pop("SLURM_LAUNCH_NODE_IPADDR", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={
                **env,
                "SLURM_PROCID": str(r),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out)
        assert proc.returncode == 0, out
    for r, out in enumerate(outputs):
        assert f"rank {r} of 2 local {r} sum 3 layout 1x2" in out, out
