"""Tests of physicsnemo_shardext.training.distributed, the CPU/gloo-capable bootstrap."""

import subprocess
import sys

import torch
import torch.distributed as dist

from physicsnemo_shardext.training import distributed

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.tensor import Shard
from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
import physicsnemo_shardext

manager = physicsnemo_shardext.initialize()
assert manager is DistributedManager() or manager.rank == DistributedManager().rank
assert DistributedManager.is_initialized() and manager.distributed
assert (manager.rank, manager.world_size) == (dist.get_rank(), 2)
# NCCL exactly when every rank of the node has a GPU (2 ranks here).
assert dist.get_backend() == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
if torch.cuda.device_count() >= 2 or not torch.cuda.is_available():
    assert manager._initialization_method == "env"      # PhysicsNeMo's own path ran
assert torch.nn.functional.conv2d in ShardTensor._function_registry   # built-ins present on CPU
mesh = manager.initialize_mesh((-1,), ("domain",))
full = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(2, 7, 3)
sharded = scatter_tensor(full if manager.rank == 0 else None, 0, mesh, (Shard(1),))
expected = torch.tensor_split(full, [4], dim=1)[manager.rank]
assert torch.equal(sharded.to_local().cpu(), expected), (sharded.to_local(), expected)
assert torch.equal(sharded.full_tensor().cpu(), full)
physicsnemo_shardext.shutdown()
assert not DistributedManager.is_initialized() and not dist.is_initialized()
physicsnemo_shardext.shutdown()   # twice is harmless
print(f"rank {manager.rank} OK")
"""


def test_torchrun_bootstrap_with_scatter_tensor(tmp_path):
    script = tmp_path / "bootstrap.py"
    script.write_text(TORCHRUN_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 OK" in result.stdout and "rank 1 OK" in result.stdout


def test_cpu_device_id_is_dropped_only_inside_the_bootstrap(monkeypatch):
    seen = {}

    def fake_init(*args, **kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with distributed._tolerate_cpu_device_id():
        dist.init_process_group("gloo", rank=0, world_size=1, device_id=torch.device("cpu"))
        assert "device_id" not in seen
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        assert seen["device_id"] == torch.device("cuda", 0)  # accelerators pass through unchanged
    assert dist.init_process_group is fake_init


def test_is_cpu_device_id():
    assert distributed.is_cpu_device_id("cpu") and distributed.is_cpu_device_id(torch.device("cpu"))
    assert not distributed.is_cpu_device_id(None) and not distributed.is_cpu_device_id(0)
    assert not distributed.is_cpu_device_id(torch.device("cuda", 1))


MORE_RANKS_THAN_GPUS = """
import warnings
import torch
import torch.distributed as dist

torch.cuda.is_available = lambda: True      # pretend: a node with one GPU ...
torch.cuda.device_count = lambda: 1         # ... and torchrun starting two ranks on it
import physicsnemo_shardext

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    manager = physicsnemo_shardext.initialize()
told = [str(w.message) for w in caught if "visible GPU" in str(w.message)]
assert dist.get_backend() == "gloo" and manager.device.type == "cpu", (dist.get_backend(), manager.device)
assert told and "2 ranks on this node but 1 visible GPU(s)" in told[0], told
# PhysicsNeMo's mesh follows the manager's cuda flag: a CUDA mesh here set cuda:1 on rank 1
# (seen on a one-GPU host: "invalid device ordinal").
assert manager.cuda is False and manager.initialize_mesh((-1,), ("domain",)).device_type == "cpu"
total = torch.ones(1)
dist.all_reduce(total)
assert total.item() == 2
physicsnemo_shardext.shutdown()
print(f"rank {manager.rank} fell back to gloo")
"""


def test_more_ranks_than_gpus_falls_back_to_gloo_with_a_warning(tmp_path):
    script = tmp_path / "more_ranks.py"
    script.write_text(MORE_RANKS_THAN_GPUS)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "rank 0 fell back to gloo" in result.stdout and "rank 1 fell back to gloo" in result.stdout
