"""Per-test isolation inside a reused rank: sandboxed registries, seeding, TF32 off.

Examples:
    ```python
    with rank_test_environment(seed=1234) as registry:
        ShardTensor.register_function_handler(F.conv2d, my_handler)  # undone on exit
    ```

    The same seed gives the same draws:

    >>> import torch
    >>> with deterministic(7):
    ...     a = torch.rand(3)
    >>> with deterministic(7):
    ...     b = torch.rand(3)
    >>> torch.equal(a, b), torch.backends.cuda.matmul.allow_tf32
    (True, False)
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

__all__ = ["DEFAULT_SEED", "deterministic", "registry_sandbox_context", "rank_test_environment", "seed_everything"]

#: Seed used on every rank unless the marker passes ``seed=``.
DEFAULT_SEED = 1234


def registry_sandbox_context() -> contextlib.AbstractContextManager[Any]:
    """A context manager restoring ShardTensor's registries and the plugin registry on exit.

    It is the framework's `physicsnemo_shardext.sandbox`, which yields the
    process-wide `PatchRegistry`.
    """
    from physicsnemo_shardext import sandbox

    return sandbox()


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if installed) and torch's generators identically."""
    import torch

    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a torch dependency in practice
        pass
    torch.manual_seed(seed)


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seed all generators and switch TF32 off (so ranks and the reference agree); restore TF32 after."""
    import torch

    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    seed_everything(seed)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


@contextlib.contextmanager
def rank_test_environment(seed: int = DEFAULT_SEED) -> Iterator[Any]:
    """Everything a test body gets on each rank; yields the sandbox's value (the registry)."""
    with registry_sandbox_context() as registry, deterministic(seed):
        yield registry
