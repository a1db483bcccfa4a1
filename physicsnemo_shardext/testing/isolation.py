"""Per-test isolation inside a reused rank: sandboxed registries, seeding, TF32 off, upstream warnings.

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
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = [
    "DEFAULT_SEED",
    "RANK_TASK_ENVIRONMENT",
    "UPSTREAM_WARNINGS",
    "deterministic",
    "rank_task_environment",
    "rank_test_environment",
    "registry_sandbox_context",
    "seed_everything",
    "upstream_warnings_filtered",
]

#: Seed used on every rank unless the marker passes ``seed=``.
DEFAULT_SEED = 1234

#: Warnings that dependencies raise on behalf of every sharded test, which a test author
#: cannot act on: ``(message regex, category)``. PhysicsNeMo gathers a shard with
#: ``torch.distributed._functional_collectives.all_gather_tensor`` (its
#: ``_shard_redistribute._to_replicate_tensor``, i.e. every ``full_tensor()`` and every
#: redistribution from ``Shard`` to ``Replicate``), which torch deprecated in favour of
#: ``all_gather_single``. pytest resets the warning registry for each test, so it came
#: back in every test that compared a result.
UPSTREAM_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"`torch\.distributed\._functional_collectives\.all_gather_tensor` is deprecated", FutureWarning),
)


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
    from physicsnemo_shardext.comparison import exact_float32

    with exact_float32():
        seed_everything(seed)
        yield


@contextlib.contextmanager
def upstream_warnings_filtered() -> Iterator[None]:
    """Ignore exactly the `UPSTREAM_WARNINGS` inside the block; every other warning is untouched.

    Examples:
        >>> import warnings
        >>> message = "`torch.distributed._functional_collectives.all_gather_tensor` is deprecated. Please use ..."
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")       # as pytest's -W always (or error) would
        ...     with upstream_warnings_filtered():
        ...         warnings.warn(message, FutureWarning)
        ...         warnings.warn("something else", FutureWarning)
        >>> [str(w.message) for w in caught]
        ['something else']
    """
    with warnings.catch_warnings():
        for message, category in UPSTREAM_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


@contextlib.contextmanager
def rank_test_environment(seed: int = DEFAULT_SEED) -> Iterator[Any]:
    """Everything a test body gets on each rank; yields the sandbox's value (the registry)."""
    with registry_sandbox_context() as registry, deterministic(seed), upstream_warnings_filtered():
        yield registry


#: What a multirank test's `RankTask` names as its environment (``ranks`` knows nothing of pytest).
RANK_TASK_ENVIRONMENT = "physicsnemo_shardext.testing.isolation:rank_task_environment"


@contextlib.contextmanager
def rank_task_environment(kwargs: dict[str, Any], seed: int) -> Iterator[dict[str, Any]]:
    """A test body's setup on a pooled rank: `rank_test_environment`, fixtures built, a pytest skip reported.

    Placeholder fixtures (the mesh, the rank) are materialized here; a ``monkeypatch``
    fixture's changes on this rank are undone afterwards, since its teardown runs in
    the pytest process on the pickled original and a long-lived rank would keep them.

    Examples:
        >>> with rank_task_environment({"n": 3}, seed=7) as arguments:
        ...     arguments
        {'n': 3}
    """
    from _pytest.outcomes import Skipped

    from physicsnemo_shardext.ranks.worker import TaskSkipped
    from physicsnemo_shardext.testing.placeholders import materialize

    with rank_test_environment(seed) as registry:
        arguments = materialize(kwargs, registry)
        try:
            yield arguments
        except Skipped as skipped:
            raise TaskSkipped(str(getattr(skipped, "msg", skipped))) from skipped
        finally:
            _undo_monkeypatches(arguments)


def _undo_monkeypatches(arguments: dict[str, Any]) -> None:
    import pytest

    for value in arguments.values():
        if isinstance(value, pytest.MonkeyPatch):
            value.undo()
