"""The communication of a sharded run: collectives and bytes of one forward and one backward.

`measure_comms` runs ``fn`` once on sharded inputs (fresh copies, built as
`check_conformance` builds them) with one `CommCounter` around the forward and another
around the backward; `check_conformance` calls it for its report's ``comms`` unless
``count_comms=False``. Setup work (sharding, ``distribute_module``, the cotangents) is
not counted.

Examples:
    On every rank of a ``@pytest.mark.multirank(2)`` test:

    ```python
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    stats = measure_comms(conv, [torch.randn(1, 3, 17, 8)], ShardSpec(domain_mesh, [Shard(2)], [10, 7]))
    assert stats.forward.total_calls >= 1      # the halo exchange
    ```

    What it returns for a run that communicates nothing:

    >>> str(PhaseCommStats())
    'forward: no collectives; backward: no collectives'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from physicsnemo_shardext.ranks.comm_accounting import CommCounter, PhaseCommStats
from physicsnemo_shardext.testing.autocast_tolerance import _autocast_region, _resolve_autocast
from physicsnemo_shardext.testing.conformance_runs import (
    ParamMode,
    ShardSpec,
    _cotangent_for,
    _prepare_callable,
    _sharded_inputs,
    _specs_for,
    _tensor_leaves,
    _to_mesh_device,
)

__all__ = ["measure_comms"]


def measure_comms(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    shardings: ShardSpec | Sequence[ShardSpec | None],
    *,
    params: ParamMode = "distribute",
    kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    autocast: torch.dtype | tuple[str, torch.dtype] | None = None,
) -> PhaseCommStats:
    """Count collectives and payload bytes of one sharded forward and one backward (fresh copies).

    Setup work (sharding the inputs, ``distribute_module``, building the cotangent) is
    not counted. ``autocast`` runs the forward under ``torch.autocast`` as in
    `check_conformance`.

    Examples:
        ```python
        stats = measure_comms(conv, [x], ShardSpec(mesh, [Shard(2)]))
        print(stats.forward.counts, stats.backward.total_bytes)
        ```
    """
    kwargs = kwargs or {}
    specs = _specs_for(inputs, shardings)
    mesh = next(s for s in specs if s is not None).mesh
    amp = _resolve_autocast(autocast, mesh)
    fn, inputs = _to_mesh_device(fn, inputs, mesh)
    sharded = _prepare_callable(fn, mesh, params)
    sh_inputs = _sharded_inputs(inputs, specs)
    stats = PhaseCommStats()
    with CommCounter() as forward, _autocast_region(amp):
        outputs = _tensor_leaves(sharded(*sh_inputs, **kwargs))
    stats.forward = forward.stats
    differentiable = [o for o in outputs if o.requires_grad]
    if differentiable:
        # Cotangents are built outside the counter; they need no communication.
        cots = [_cotangent_for(o, o.shape, seed + i) for i, o in enumerate(differentiable)]
        with CommCounter() as backward:
            torch.autograd.backward(differentiable, cots)
        stats.backward = backward.stats
    return stats
