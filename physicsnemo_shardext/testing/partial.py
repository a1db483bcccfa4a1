"""Build ``Partial`` inputs from a full tensor, for tests of how handlers treat pending reductions.

A handler that only supports ``Shard``/``Replicate`` inputs should refuse a
``Partial`` one (``MissingShardPatch``) or delegate it; to test that, it needs a
``Partial`` ShardTensor (or DTensor) whose pending reduction is a known tensor.
`partial_tensor` makes one from a full tensor (identical on all ranks): each
rank's local value is a term such that reducing the terms over the mesh gives
back the full tensor. `partial_values` computes those terms without a mesh.

Examples:
    In a ``@pytest.mark.multirank(2)`` test:

    ```python
    xp = partial_tensor(full, domain_mesh, [Partial("sum")])
    with pytest.raises(MissingShardPatch, match="Partial"):
        my_op(xp)
    assert torch.allclose(xp.full_tensor(), full)
    ```

    The terms, here for a pending ``max`` over 3 ranks:

    >>> import torch
    >>> full = torch.tensor([1.0, -2.0, 5.0])
    >>> terms = partial_values(full, "max", 3)
    >>> torch.equal(torch.stack(terms).amax(0), full), any(torch.equal(t, full) for t in terms)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor.placement_types import Partial, Placement

from physicsnemo_shardext.testing.sharding import (
    SplitSizes,
    chunk_split_sizes,
    local_block,
    normalize_split_sizes,
    sharding_shapes_for,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["REDUCE_OPS", "partial_tensor", "partial_values"]

#: The ``Partial`` reductions `partial_tensor` can build ("avg" needs NCCL to be reduced).
REDUCE_OPS = ("sum", "avg", "max", "min")


def partial_values(full: torch.Tensor, reduce_op: str, parts: int, *, seed: int = 0) -> list[torch.Tensor]:
    """``parts`` tensors shaped like ``full`` whose ``reduce_op`` over the list is ``full``.

    The terms are drawn from a generator seeded with ``seed`` (so every rank draws the
    same ones) and none of them is ``full`` itself where that is possible:

    * ``sum``: random positive shares of ``full`` (equal to it up to rounding); integer
      and bool tensors put ``full`` in the first term and zeros in the others;
    * ``avg``: the ``sum`` terms times ``parts``;
    * ``max`` / ``min``: each element is ``full`` in one randomly chosen term, and is
      lowered (raised) by a positive amount in the others; exact.

    Examples:
        >>> import torch
        >>> full = torch.arange(6.0).reshape(2, 3)
        >>> terms = partial_values(full, "sum", 2)
        >>> torch.allclose(terms[0] + terms[1], full), torch.equal(terms[0], full)
        (True, False)
        >>> ints = partial_values(torch.tensor([3, 4]), "sum", 2)
        >>> [t.tolist() for t in ints]
        [[3, 4], [0, 0]]
    """
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"Partial({reduce_op!r}) is not supported here; use one of {REDUCE_OPS}")
    if parts < 1:
        raise ValueError(f"parts must be positive, got {parts}")
    full = full.detach()
    generator = torch.Generator().manual_seed(seed)
    floating = full.is_floating_point() or full.is_complex()
    if reduce_op in ("sum", "avg"):
        if floating:
            real = torch.empty(0, dtype=full.dtype).real.dtype
            weights = torch.rand((parts, *full.shape), generator=generator, dtype=real) + 0.1
            shares = (weights / weights.sum(0)).to(full.device)
            terms = [full * shares[k] for k in range(parts)]
        else:
            terms = [full.clone() if k == 0 else torch.zeros_like(full) for k in range(parts)]
        if reduce_op == "avg":
            if not floating:
                raise ValueError("Partial('avg') needs a floating-point tensor")
            terms = [term * parts for term in terms]
        return terms
    if full.is_complex() or full.dtype == torch.bool:
        raise ValueError(f"Partial({reduce_op!r}) needs a real, ordered dtype, got {full.dtype}")
    holder = torch.randint(parts, tuple(full.shape), generator=generator).to(full.device)
    if floating:
        offsets = torch.rand((parts, *full.shape), generator=generator).to(full.dtype) + 0.5
    else:
        offsets = torch.randint(1, 4, (parts, *full.shape), generator=generator).to(full.dtype)
    offsets = offsets.to(full.device)
    sign = -1 if reduce_op == "max" else 1
    return [torch.where(holder == k, full, full + sign * offsets[k]) for k in range(parts)]


def _reduce_op(placements: Sequence[Placement]) -> str:
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    if not ops:
        raise ValueError("partial_tensor needs at least one Partial placement (use shard_tensor otherwise)")
    if len(ops) > 1:
        raise ValueError(f"all Partial placements must reduce alike, got {sorted(ops)}")
    return ops.pop()


def partial_tensor(
    full: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    sizes_by_mesh_dim: SplitSizes = None,
    *,
    seed: int = 0,
    requires_grad: bool = False,
    dtensor: bool = False,
) -> Any:
    """A ShardTensor (or DTensor) with ``Partial`` placements whose reduction over ``mesh`` is ``full``.

    Args:
        full: the tensor the pending reduction gives, the same on every rank.
        mesh: the device mesh.
        placements: one per mesh dim; ``Partial(op)`` (``op`` in `REDUCE_OPS`, the same on
            every Partial mesh dim), ``Shard(d)`` or ``Replicate()``. Default: ``Partial("sum")``
            on every mesh dim.
        sizes_by_mesh_dim: split sizes of the ``Shard`` mesh dims, as for `shard_tensor`.
        seed: seeds the draw of the terms (`partial_values`); the same on every rank.
        requires_grad: make the result a leaf that requires grad.
        dtensor: return a plain ``DTensor`` instead of a ShardTensor (``Shard`` mesh dims must
            then split like ``torch.chunk``).

    Returns:
        The distributed tensor. Each rank's local value is its term (of its shard, on
        ``Shard`` mesh dims); ``full_tensor()`` equals ``full`` (up to rounding for ``sum``).

    Examples:
        On a 2-D ``spatial_mesh``: rows sharded over ``h``, a pending max over ``w``:

        ```python
        xp = partial_tensor(full, spatial_mesh, [Shard(2), Partial("max")], {0: [3, 5]})
        assert torch.equal(xp.full_tensor(), full)
        ```
    """
    placements = list(placements) if placements is not None else [Partial("sum")] * mesh.ndim
    reduce_op = _reduce_op(placements)
    sizes = normalize_split_sizes(full.shape, tuple(mesh.shape), placements, sizes_by_mesh_dim)
    local, coordinate = local_block(full, mesh, placements, sizes)
    partial_dims = [mesh_dim for mesh_dim, p in enumerate(placements) if isinstance(p, Partial)]
    for step, mesh_dim in enumerate(partial_dims):
        # Every rank with this rank's shard draws the same terms; it keeps its own.
        local = partial_values(local, reduce_op, mesh.size(mesh_dim), seed=seed + step)[coordinate[mesh_dim]]
    local = local.contiguous().clone()
    if dtensor:
        from torch.distributed.tensor import DTensor

        for mesh_dim, mesh_sizes in sizes.items():
            tensor_dim = placements[mesh_dim].dim  # type: ignore[attr-defined]
            if list(mesh_sizes) != chunk_split_sizes(full.shape[tensor_dim], mesh.size(mesh_dim)):
                raise ValueError(f"a DTensor cannot hold the split {list(mesh_sizes)} of mesh dim {mesh_dim}")
        result = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    else:
        from physicsnemo.domain_parallel import ShardTensor

        shapes = sharding_shapes_for(full.shape, placements, sizes, coordinate)
        result = ShardTensor.from_local(local, mesh, placements, sharding_shapes=shapes)
    if requires_grad:
        result.requires_grad_(True)
    return result
