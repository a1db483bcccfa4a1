"""PhysicsNeMo's ``AFNO2DLayer`` on a sharded field: its scratch buffers are allocated sharded.

``AFNO2DLayer.forward`` (the spectral filter of ``physicsnemo.models.afno.AFNO``)
transforms its input with ``rfft2``, then allocates three buffers with
``torch.zeros(...)`` of the spectrum's *global* shape and fills the kept modes
with a block-diagonal complex MLP, before ``irfft2`` brings the result back.
Plain buffers cannot hold a sharded spectrum: written into one, the modes become
a full replicated copy on every rank (what ``indexing_einsum``'s slice assignment into a
plain tensor does: gather, then compute redundantly), and with parameters
distributed by ``distribute_module`` the next einsum mixes the plain buffer with a
DTensor weight, which DTensor rejects.

This plugin wraps the layer's ``forward``: for a ShardTensor input it runs
PhysicsNeMo's own forward inside
`sharded_allocations`, so the
buffers are allocated sharded exactly like the spectrum they mirror. Every op
inside then runs on the local spectrum through the ``fft``, ``indexing_einsum`` and
``layout_ops`` plugins: two all-to-alls for ``rfft2`` and two for ``irfft2`` on a
1-D mesh, none for the block MLP, whose weight gradients are all-reduced in
backward. Plain-tensor inputs call the original forward unchanged. Under
``torch.compile`` the sharded filter runs eagerly behind one graph break (the rest
of the model is compiled); see ``physicsnemo_shardext.primitives.compilation``.

The plugin waits for ``physicsnemo.nn.module.afno_layers`` (``shardext_import_after``):
importing ``physicsnemo_shardext`` does not import ``physicsnemo.nn``, and the wrapper
is installed right after a program imports the layer's module, before any layer exists.

Refused: nothing here; the layer's ops inside are handled, delegated or refused by
the families above (this plugin only changes where its scratch buffers live).

Examples:
    One layer on tokens ``(B, h, w, D)`` split 3/2 on ``h``, on 2 ranks:

    >>> import torch
    >>> from physicsnemo.nn.module.afno_layers import AFNO2DLayer
    >>> from torch.distributed.tensor import Shard
    >>> from physicsnemo_shardext.testing import shard_tensor
    >>> _ = torch.manual_seed(0)                  # the same weights on both ranks
    >>> layer = AFNO2DLayer(hidden_size=4, num_blocks=2)
    >>> full = torch.linspace(-1, 1, 5 * 6 * 4).reshape(1, 5, 6, 4)
    >>> y = layer(shard_tensor(full, mesh, [Shard(1)], [3, 2]))
    >>> y.placements, y.to_local().shape[1] == [3, 2][rank]
    ((Shard(dim=1),), True)
    >>> torch.allclose(y.full_tensor(), layer(full), atol=1e-5)
    True

    A whole model (not run here):

    ```python
    model = distribute_module(AFNO(inp_shape=[32, 16], in_channels=2, out_channels=1,
                                   patch_size=[4, 4], embed_dim=8, depth=1, num_blocks=2), mesh)
    y = model(x_shard)          # same numbers as the single-process model, H still split 12/20
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_shardext import PatchSet, hookimpl
from physicsnemo_shardext.patches import shardext_requirements  # noqa: F401 - the shared hook, found here by pluggy
from physicsnemo_shardext.primitives import sharded_allocations

__all__ = ["AFNO_LAYERS", "shard_aware_forward"]

AFNO_LAYERS = "physicsnemo.nn.module.afno_layers"
"""The module this plugin patches. Importing it costs seconds (``physicsnemo.nn``), so the
plugin loads once a program imports it (``shardext_import_after``), never before."""


def shard_aware_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a layer's ``forward`` so that a ShardTensor input runs it with sharded scratch buffers.

    Examples:
        >>> import torch
        >>> class Layer(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x + torch.zeros(x.shape)      # a scratch buffer of the global shape
        >>> forward = shard_aware_forward(Layer.forward)
        >>> forward.__wrapped__ is Layer.forward, forward(Layer(), torch.ones(2)).tolist()
        (True, [1.0, 1.0])

        What the plugin declares (not run here):

        ```python
        AFNO2DLayer.forward = shard_aware_forward(AFNO2DLayer.forward)
        ```
    """

    # Under torch.compile the sharded filter runs eagerly, behind one graph break: the
    # allocation scope is a TorchFunctionMode that remembers ShardTensors, which Dynamo
    # cannot trace faithfully, and every op inside is an eager handler anyway.
    @torch.compiler.disable(recursive=True)
    def sharded_forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        with sharded_allocations():
            return original(self, x, *args, **kwargs)

    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, ShardTensor):
            return original(self, x, *args, **kwargs)
        return sharded_forward(self, x, *args, **kwargs)

    forward.__doc__ = (
        original.__doc__ or ""
    ) + "\n\n(ShardTensor inputs: scratch buffers sharded, physicsnemo-shardext.)"
    forward.__wrapped__ = original  # type: ignore[attr-defined]
    forward.__name__ = getattr(original, "__name__", "forward")
    forward.__qualname__ = getattr(original, "__qualname__", "forward")
    return forward


@hookimpl
def shardext_import_after() -> list[str]:
    """Load once ``physicsnemo.nn.module.afno_layers`` is imported (before any AFNO2DLayer exists).

    Examples:
        >>> shardext_import_after()
        ['physicsnemo.nn.module.afno_layers']
    """
    return [AFNO_LAYERS]


@hookimpl
def shardext_declare_patches(patches: PatchSet) -> None:
    """Wrap ``AFNO2DLayer.forward`` (the current one, so that removing the plugin restores it exactly)."""
    from physicsnemo.nn.module.afno_layers import AFNO2DLayer  # imported already: see shardext_import_after

    patches.replace_attribute(
        AFNO2DLayer,
        "forward",
        shard_aware_forward(AFNO2DLayer.forward),
        reason="AFNO2DLayer fills plain torch.zeros buffers with the spectrum: allocate them sharded "
        "like the spectrum for ShardTensor inputs",
    )
