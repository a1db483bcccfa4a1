"""DTensor redistribution of uneven shards inside PhysicsNeMo's fallback: gathered right, or refused.

An op without a shard patch runs through PhysicsNeMo's DTensor fallback, which
hands DTensor the ShardTensor's local block together with its spec. When the
op's sharding strategy needs a sharded dim whole (``sort``, ``topk``,
``median``, ``var``, ``std``, ``logsumexp`` along it), DTensor redistributes the
block assuming ``torch.chunk`` sizes. For any other split (7 rows as 5 + 2
instead of 4 + 3) PhysicsNeMo 2.2.2 then returns **wrong values without an
error** (measured for all six ops above).

This plugin wraps ``redistribute_local_tensor`` (the function through which
every DTensor redistribution passes, bound in three torch modules) with a check
made from the spec alone, without communication: for every mesh dim whose
placement changes from ``Shard(d)``, are the rows of every rank (as the
ShardTensor spec records them; the local block's size for a plain DTensor
spec) the sizes ``torch.chunk`` would give on ``d``? Every rank reads the same
sizes, so every rank takes the same path.

* Yes (every chunk-layout split, every DTensor of DTensor's own making): the
  original function runs, unchanged.
* No, the move is ``Shard(d) -> Replicate`` or ``Shard(d) -> Shard(e)`` and the
  spec is a ShardTensor spec recording every rank's rows: those rows are
  all-gathered with their true sizes (one all-gather over that mesh dim), then
  DTensor continues from ``Replicate`` (for ``Shard(e)``: a local split, no
  more communication). Forward values are then right; gradients come back
  through the fallback's backward (see ``fallback_fix``), in the input's own
  layout.
* No, and anything else (sizes unknown, one dim sharded over several mesh
  dims): ``MissingShardPatch`` naming the op's layout, instead of wrong numbers.

Refused (``MissingShardPatch``): every move of an uneven (non-``torch.chunk``) shard
without known per-rank sizes (a spec without sharding shapes) or of a dim sharded
over several mesh dims: DTensor would compute wrong values from it without an error.

Examples:
    A sort along a dim split 5 + 2 (``torch.chunk`` would say 4 + 3), on 2 ranks:

    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> full = torch.linspace(1, -1, 14).reshape(2, 7)
    >>> x = shard_tensor(full, mesh, [Shard(1)], [5, 2])
    >>> torch.equal(torch.sort(x, dim=1).values.full_tensor(), torch.sort(full, dim=1).values)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import Replicate, Shard

# The DTensor internals this family patches (`OWNERS`) and must agree with (torch.chunk's local shape).
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from physicsnemo_shardext import MissingShardPatch, PatchSet, hookimpl
from physicsnemo_shardext.primitives import all_gather_rows, spec_shard_shapes, spec_with_placements

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["OWNERS", "chunk_mismatches", "guarded_redistribute"]

#: Modules that bind their own name for ``redistribute_local_tensor``.
OWNERS = (dtensor_redistribute, dtensor_dispatch, dtensor_api)


def chunk_mismatches(local: torch.Tensor, current: DTensorSpec, target: DTensorSpec) -> list[tuple[int, int, int]]:
    """``(mesh_dim, tensor_dim, expected_rows)`` for each moved ``Shard`` whose local rows are not chunk-sized.

    Examples:
        A ``(7,)`` tensor held as 5 + 2 on 2 ranks, redistributed to ``Replicate``:

        >>> from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        >>> meta = TensorMeta(torch.Size([7]), (1,), torch.float32)
        >>> current = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        >>> target = DTensorSpec(mesh, (Replicate(),), tensor_meta=meta)
        >>> chunk_mismatches(torch.zeros([5, 2][rank]), current, target) == [[(0, 0, 4)], [(0, 0, 3)]][rank]
        True
        >>> chunk_mismatches(torch.zeros([4, 3][rank]), current, target)     # torch.chunk's rows
        []
    """
    moved = [
        (mesh_dim, placement.dim)
        for mesh_dim, (placement, wanted) in enumerate(zip(current.placements, target.placements))
        if isinstance(placement, Shard) and placement != wanted
    ]
    if not moved:
        return []
    expected, _ = compute_local_shape_and_global_offset(current.shape, current.mesh, current.placements)
    shapes = spec_shard_shapes(current)
    return [(m, d, expected[d]) for m, d in moved if _not_chunked(m, d, local, expected, current, shapes)]


def _chunk_sizes(total: int, parts: int) -> list[int]:
    """The rows DTensor's ``Shard`` (``torch.chunk``'s split) gives each of ``parts`` coordinates."""
    return [int(Shard.local_shard_size_and_offset(total, parts, c)[0]) for c in range(parts)]


def _nested(placements: Sequence[Any], dim: int) -> bool:
    """Whether tensor dim ``dim`` is sharded over several mesh dims (its recorded sizes are per mesh dim)."""
    return sum(isinstance(p, Shard) and p.dim == dim for p in placements) > 1


def _not_chunked(
    mesh_dim: int, dim: int, local: torch.Tensor, expected: Sequence[int], current: DTensorSpec, shapes: Any
) -> bool:
    # Decided from every rank's rows where the spec records them: a rank whose own block
    # happens to be chunk-sized (64 of 65/64/64/63) must take the same path as the others,
    # or the ranks issue different collectives and hang.
    if shapes and mesh_dim in shapes and not _nested(current.placements, dim):
        sizes = [shape[dim] for shape in shapes[mesh_dim]]
        return sizes != _chunk_sizes(current.shape[dim], len(sizes))
    return bool(local.shape[dim] != expected[dim])


def _describe(current: DTensorSpec, local: torch.Tensor) -> str:
    return (
        f"placements {tuple(current.placements)}, global shape {tuple(current.shape)}, local shape {tuple(local.shape)}"
    )


def guarded_redistribute(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap DTensor's ``redistribute_local_tensor``: gather uneven shards with their true sizes, or refuse.

    Examples:
        >>> guarded = guarded_redistribute(dtensor_redistribute.redistribute_local_tensor)
        >>> guarded.__wrapped__ is dtensor_redistribute.redistribute_local_tensor
        True

        What the plugin declares, per module of `OWNERS` (not run here):

        ```python
        dtensor_dispatch.redistribute_local_tensor = guarded_redistribute(dtensor_dispatch.redistribute_local_tensor)
        ```
    """

    def redistribute_local_tensor(
        local_tensor: torch.Tensor, current_spec: DTensorSpec, target_spec: DTensorSpec, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        mismatches = chunk_mismatches(local_tensor, current_spec, target_spec)
        if not mismatches:
            return original(local_tensor, current_spec, target_spec, *args, **kwargs)
        placements = list(current_spec.placements)
        shapes = spec_shard_shapes(current_spec)
        for mesh_dim, dim, expected in mismatches:
            gatherable = shapes and not _nested(current_spec.placements, dim)
            if not (isinstance(target_spec.placements[mesh_dim], (Replicate, Shard)) and gatherable):
                raise MissingShardPatch(
                    f"DTensor fallback: moving a shard from {current_spec.placements[mesh_dim]} to "
                    f"{target_spec.placements[mesh_dim]} on mesh dim {mesh_dim} with {local_tensor.shape[dim]} local "
                    f"rows where DTensor expects torch.chunk's {expected} ({_describe(current_spec, local_tensor)}); "
                    "DTensor would compute wrong values. This op needs a shard patch for uneven splits"
                )
            sizes = [shape[dim] for shape in shapes[mesh_dim]]
            local_tensor = all_gather_rows(local_tensor, current_spec.mesh, mesh_dim, dim, sizes)
            placements[mesh_dim] = Replicate()
        gathered = spec_with_placements(current_spec, placements)
        return original(local_tensor, gathered, target_spec, *args, **kwargs)

    redistribute_local_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    redistribute_local_tensor.__doc__ = original.__doc__
    return redistribute_local_tensor


@hookimpl
def shardext_requirements() -> dict[str, str]:
    """This plugin wraps DTensor internals of the torch that PhysicsNeMo 2.2 runs on."""
    return {"nvidia-physicsnemo": ">=2.2,<2.3", "torch": ">=2.6"}


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Wrap ``redistribute_local_tensor`` in every torch module that binds it."""
    for owner in OWNERS:
        patches.replace_attribute(
            owner,
            "redistribute_local_tensor",
            guarded_redistribute(owner.redistribute_local_tensor),
            reason="DTensor redistributes uneven (non-torch.chunk) shards from the fallback into wrong values: "
            "gather them with the true sizes (Shard->Replicate, Shard->Shard), refuse moves whose sizes are unknown",
        )
