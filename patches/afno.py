"""PhysicsNeMo's ``AFNO2DLayer`` on a sharded field: its scratch buffers are allocated sharded.

``AFNO2DLayer.forward`` (the spectral filter of ``physicsnemo.models.afno.AFNO``)
transforms its input with ``rfft2``, then allocates three buffers with
``torch.zeros(...)`` of the spectrum's *global* shape and fills the kept modes
with a block-diagonal complex MLP, before ``irfft2`` brings the result back.
Plain buffers cannot hold a sharded spectrum: written into one, the modes become
a full replicated copy on every rank (what ``spectral``'s slice assignment into a
plain tensor does: gather, then compute redundantly), and with parameters
distributed by ``distribute_module`` the next einsum mixes the plain buffer with a
DTensor weight, which DTensor rejects.

This plugin wraps the layer's ``forward``: for a ShardTensor input it runs
PhysicsNeMo's own forward inside
:class:`~physicsnemo_shardext.primitives.allocation.sharded_allocations`, so the
buffers are allocated sharded exactly like the spectrum they mirror. Every op
inside then runs on the local spectrum through the ``fft``, ``spectral`` and
``misc_ops`` plugins: two all-to-alls for ``rfft2`` and two for ``irfft2`` on a
1-D mesh, none for the block MLP, whose weight gradients are all-reduced in
backward. Plain-tensor inputs call the original forward unchanged.

Example (2 ranks, AFNO on a 1x2x32x16 field split 12/20 on H)::

    model = distribute_module(AFNO(inp_shape=[32, 16], in_channels=2, out_channels=1,
                                   patch_size=[4, 4], embed_dim=8, depth=1, num_blocks=2), mesh)
    y = model(x_shard)          # same numbers as the single-process model, H still split 12/20
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.nn.module.afno_layers import AFNO2DLayer

from physicsnemo_shardext import hookimpl
from physicsnemo_shardext.primitives.allocation import sharded_allocations

__all__ = ["shard_aware_forward"]


def shard_aware_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a layer's ``forward`` so that a ShardTensor input runs it with sharded scratch buffers.

    Example::

        AFNO2DLayer.forward = shard_aware_forward(AFNO2DLayer.forward)   # what the plugin declares
    """

    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, ShardTensor):
            return original(self, x, *args, **kwargs)
        with sharded_allocations():
            return original(self, x, *args, **kwargs)

    forward.__doc__ = (original.__doc__ or "") + "\n\n(ShardTensor inputs: scratch buffers sharded, physicsnemo-shardext.)"
    forward.__wrapped__ = original  # type: ignore[attr-defined]
    forward.__name__ = getattr(original, "__name__", "forward")
    forward.__qualname__ = getattr(original, "__qualname__", "forward")
    return forward


@hookimpl
def shardext_requirements() -> dict[str, str]:
    """This plugin wraps PhysicsNeMo 2.2's AFNO2DLayer."""
    return {"nvidia-physicsnemo": ">=2.2,<2.3"}


@hookimpl
def shardext_declare_patches(patches: Any) -> None:
    """Wrap ``AFNO2DLayer.forward`` (the current one, so that removing the plugin restores it exactly)."""
    patches.replace_attribute(
        AFNO2DLayer,
        "forward",
        shard_aware_forward(AFNO2DLayer.forward),
        reason="AFNO2DLayer fills plain torch.zeros buffers with the spectrum: allocate them sharded "
        "like the spectrum for ShardTensor inputs",
    )
