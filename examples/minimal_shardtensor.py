"""The smallest domain-parallel program: shard a tensor by hand and apply a patched op.

torchrun --nproc-per-node 2 examples/minimal_shardtensor.py
"""

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard

import physicsnemo_shardext

manager = physicsnemo_shardext.initialize()  # gloo on CPU, NCCL on GPU
mesh = manager.initialize_mesh((-1,), ("domain",))

torch.manual_seed(0)
full = torch.randn(10, 16, device=manager.device)  # same seed, same data on every rank
chunks = torch.tensor_split(full, mesh.size(), dim=0)
x = ShardTensor.from_local(
    chunks[mesh.get_local_rank()],
    mesh,
    [Shard(0)],
    sharding_shapes={0: [tuple(c.shape) for c in chunks]},  # explicit: "infer" needs CUDA
)
y = torch.nn.functional.gelu(x)  # handled by the first-party pointwise plugin
assert torch.allclose(y.full_tensor(), torch.nn.functional.gelu(full))
print(f"rank {manager.rank}: local rows {tuple(y.to_local().shape)}, matches single-process")

physicsnemo_shardext.shutdown()
physicsnemo_shardext.exit_rank(0)  # leave without interpreter teardown under torchrun (see exit_rank)
