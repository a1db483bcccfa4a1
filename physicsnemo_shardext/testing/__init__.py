"""Multi-rank testing for ShardTensor patches: pytest plugin, fixtures, sharding helpers, conformance.

pytest loads the light, torch-free ``physicsnemo_shardext_pytest`` through the
``pytest11`` entry point; it imports the implementation
(``physicsnemo_shardext.testing.pytest_plugin``) only once a collected test uses
the ``multirank`` marker or a fixture. The helpers below are imported lazily too.

Examples:
    A multi-rank conformance test:

    ```python
    import pytest, torch
    from torch.distributed.tensor import Shard
    from physicsnemo_shardext.testing import ShardSpec, check_conformance

    @pytest.mark.multirank(2)
    def test_conv_conforms(domain_mesh):
        conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        x = torch.randn(1, 3, 17, 8)
        report = check_conformance(conv, [x], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
        print(report.comms)
    ```

    The helpers load on first use:

    >>> import physicsnemo_shardext.testing as testing
    >>> testing.chunk_split_sizes(17, 2)
    [9, 8]
    >>> [case.id for case in testing.split_cases(17, 2, allow_empty=False)]
    ['balanced-9-8', 'uneven-6-11']
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # sharding helpers
    "chunk_split_sizes": "sharding",
    "even_split_sizes": "sharding",  # the old name of chunk_split_sizes
    "shard_tensor": "sharding",
    "sharding_shapes_for": "sharding",
    "SplitSizes": "sharding",
    "split_cases": "splits",
    "SplitCase": "splits",
    # Partial inputs
    "partial_tensor": "partial",
    "partial_values": "partial",
    # conformance
    "ShardSpec": "conformance",
    "check_conformance": "conformance",
    "measure_comms": "comm_measurement",
    "ConformanceError": "conformance",
    "check_delegation": "delegation",
    "partial_terms": "delegation",
    "ConformanceReport": "conformance",
    "Mismatch": "conformance",
    # models
    "redraw_zero_parameters": "model_init",
    "without_random_masks": "model_init",
    # communication accounting
    "CommCounter": "physicsnemo_shardext.ranks.comm_accounting",
    "CommStats": "physicsnemo_shardext.ranks.comm_accounting",
    "PhaseCommStats": "physicsnemo_shardext.ranks.comm_accounting",
    # activation all-gather detection
    "GatherRecorder": "physicsnemo_shardext.ranks.activation_gathers",
    "assert_no_activation_gather": "physicsnemo_shardext.ranks.activation_gathers",
    "smallest_activation_numel": "physicsnemo_shardext.ranks.activation_gathers",
    # per-test isolation
    "rank_test_environment": "isolation",
    "registry_sandbox_context": "isolation",
    "deterministic": "isolation",
    "DEFAULT_SEED": "isolation",
    # worker pool (for tooling; tests use the marker)
    "WorkerPool": "physicsnemo_shardext.ranks.worker_pool",
    "PoolOutcome": "physicsnemo_shardext.ranks.worker_pool",
    "mesh_for": "placeholders",
}

__all__ = sorted(_EXPORTS)


def _module_of(name: str) -> str:
    # The rank runner's names live in physicsnemo_shardext.ranks (runtime, not test kit); re-exported here.
    module = _EXPORTS[name]
    return module if "." in module else f"{__name__}.{module}"


if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ imports lazily
    from physicsnemo_shardext.ranks.activation_gathers import (
        GatherRecorder,
        assert_no_activation_gather,
        smallest_activation_numel,
    )
    from physicsnemo_shardext.ranks.comm_accounting import CommCounter, CommStats, PhaseCommStats
    from physicsnemo_shardext.ranks.worker_pool import PoolOutcome, WorkerPool
    from physicsnemo_shardext.testing.comm_measurement import measure_comms
    from physicsnemo_shardext.testing.conformance import (
        ConformanceError,
        ConformanceReport,
        Mismatch,
        ShardSpec,
        check_conformance,
    )
    from physicsnemo_shardext.testing.delegation import check_delegation, partial_terms
    from physicsnemo_shardext.testing.isolation import (
        DEFAULT_SEED,
        deterministic,
        rank_test_environment,
        registry_sandbox_context,
    )
    from physicsnemo_shardext.testing.model_init import redraw_zero_parameters, without_random_masks
    from physicsnemo_shardext.testing.partial import partial_tensor, partial_values
    from physicsnemo_shardext.testing.placeholders import mesh_for
    from physicsnemo_shardext.testing.sharding import (
        SplitSizes,
        chunk_split_sizes,
        even_split_sizes,
        shard_tensor,
        sharding_shapes_for,
    )
    from physicsnemo_shardext.testing.splits import SplitCase, split_cases


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_module_of(name)), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
