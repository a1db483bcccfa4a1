"""PhysicsNeMo's FNO and AFNO, unmodified, run domain-parallel: FNO matches the single process, AFNO is refused.

The models are built exactly as a user would build them and wrapped by
``check_conformance`` (parameters replicated with ``distribute_module``); only the
input is a ShardTensor. Outputs, the input gradient and **every** parameter
gradient must match the single-process run within 1e-4 (float32). The spectral
work (``torch.fft.rfft2``/``rfftn``/``irfft*``, mode slicing, complex ``einsum``,
``F.pad`` of the mode blocks, ``torch.zeros(...) + ...``) is handled by the
first-party ``fft`` and ``spectral`` plugins; the lift/projection (1x1 convs,
``linear``), activations and ``permute``/``reshape`` by the other plugins,
PhysicsNeMo's built-ins and the DTensor fallback.

Configurations (small on purpose):

* **FNO 2-D** (``FNO2D``): ``in_channels=2, out_channels=1, latent_channels=8,
  num_fno_layers=2, num_fno_modes=[5, 4], decoder_layers=1, decoder_layer_size=8,
  padding=0, coord_features=False`` on a ``1x2x17x13`` field sharded over H:
  ``[9, 8]`` on 2 ranks; ``[3, 5, 4, 5]`` on 4 ranks, where the 5 low and the
  5 high H-modes each straddle a rank boundary; and over H and W on a 2x2
  ``("h", "w")`` mesh (``H [9, 8]``, ``W [7, 6]``).
* **FNO 3-D** (``FNO3D``): ``in_channels=2, out_channels=1, latent_channels=8,
  num_fno_layers=1, num_fno_modes=2, decoder_layers=1, decoder_layer_size=8,
  padding=0, coord_features=False`` on ``1x2x9x6x6``, sharded over the first
  spatial dim: ``[5, 4]`` on 2 ranks, ``[3, 2, 2, 2]`` on 4 ranks.
* **AFNO** (``AFNO_CONFIG``): ``inp_shape=[32, 16], in_channels=2,
  out_channels=1, patch_size=[4, 4], embed_dim=8, depth=1, num_blocks=2`` on
  ``1x2x32x16``. AFNO patchifies (a stride-4 convolution), then works on the
  ``8x4`` patch grid, so shard boundaries must fall on patch boundaries (a
  boundary inside a patch has no meaning on the token grid): ``[16, 16]``,
  ``[8, 8, 8, 8]``, and ``H [16, 16]``, ``W [8, 8]`` on the 2x2 mesh.

``padding=0``: FNO's default domain padding (``F.pad`` on the far end of H/W
and the matching ``x[..., :-p, :-p]``) belongs to the padding family, not to
the spectral ops these tests are about.

Why ``coord_features=False`` (FNO's default is ``True``): FNO concatenates a
*plain*, full-size coordinate grid to the sharded input (``torch.cat`` on the
channel dim). The ``misc_ops`` plugin refuses a ``cat`` that mixes plain and
sharded tensors with ``MissingShardPatch``; the default configuration is
therefore tested for exactly that refusal.

Why AFNO is refused: its spectral block (``AFNO2DLayer``) allocates
``torch.zeros(...)`` buffers (plain, full-size) and writes the sharded spectrum
into them with slice assignment. The ``spectral`` plugin refuses
``plain[idx] = shard_tensor`` with ``MissingShardPatch`` rather than leave a
full-size buffer detached from the sharded autograd graph, so running AFNO
unmodified must raise that error, on every rank, before any wrong number can
come out. (Patch-aligned *uneven* splits, e.g. ``[12, 20]``, get through the
patch embedding's ``flatten(2)`` (``misc_ops``) but fail earlier, with a
RuntimeError in the DTensor fallback of ``x + self.pos_embed``, which assumes
``torch.chunk`` splits; they are not tested here.)
"""

from __future__ import annotations

import pytest
import torch
from physicsnemo.models.afno import AFNO
from physicsnemo.models.fno import FNO
from torch.distributed.tensor import Shard, distribute_module

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}  # float32, outputs and every gradient

FNO2D = dict(in_channels=2, out_channels=1, dimension=2, latent_channels=8, num_fno_layers=2, num_fno_modes=[5, 4],
             decoder_layers=1, decoder_layer_size=8, padding=0, coord_features=False)
FNO3D = dict(in_channels=2, out_channels=1, dimension=3, latent_channels=8, num_fno_layers=1, num_fno_modes=2,
             decoder_layers=1, decoder_layer_size=8, padding=0, coord_features=False)
AFNO_CONFIG = dict(inp_shape=[32, 16], in_channels=2, out_channels=1, patch_size=[4, 4], embed_dim=8, depth=1,
                   num_blocks=2)


def _check(model: torch.nn.Module, x: torch.Tensor, spec: ShardSpec) -> None:
    report = check_conformance(model, [x], spec, **TOLERANCE)
    # FNO freezes its lift convs' biases (requires_grad=False): no gradient in either run.
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    compared = {k.split("'")[1] for k in report.max_abs_errors if k.startswith("gradient of parameter")}
    assert compared == names, f"parameters without a compared gradient: {sorted(names - compared)}"


# -- FNO 2-D ----------------------------------------------------------------------------------
@pytest.mark.multirank(2, timeout=60)
def test_fno2d_on_2_ranks_uneven(domain_mesh):
    _check(FNO(**FNO2D), torch.randn(1, 2, 17, 13), ShardSpec(domain_mesh, [Shard(2)], [9, 8]))


@pytest.mark.multirank(4, timeout=60)
def test_fno2d_on_4_ranks_modes_straddle_ranks(domain_mesh):
    _check(FNO(**FNO2D), torch.randn(1, 2, 17, 13), ShardSpec(domain_mesh, [Shard(2)], [3, 5, 4, 5]))


@pytest.mark.multirank(4, timeout=60)
def test_fno2d_encoder_on_2x2_spatial_mesh(spatial_mesh):
    # The whole spectral part (lift + 2 FNO layers) conforms on the pencil mesh: rfft2 ends with the
    # spectrum on frequency dims only ([Shard(W_f), Shard(H_f)]), so the channel-contracting einsum is local.
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [9, 8], 1: [7, 6]})
    _check(FNO(**FNO2D).spec_encoder, torch.randn(1, 2, 17, 13), spec)


@pytest.mark.multirank(4, timeout=60)
def test_fno2d_on_2x2_spatial_mesh_decoder_is_refused_not_wrong(spatial_mesh):
    # The spectral part conforms on this mesh (test above). FNO's decoder then flattens the H- and
    # W-sharded grid into points, giving nested (Shard(0), Shard(0)) placements; PhysicsNeMo's view
    # cannot reshape such points back into the grid, so the linear patch refuses them up front.
    model = distribute_module(FNO(**FNO2D), spatial_mesh)
    x = shard_tensor(torch.randn(1, 2, 17, 13), spatial_mesh, [Shard(2), Shard(3)], {0: [9, 8], 1: [7, 6]},
                     requires_grad=True)
    with pytest.raises(MissingShardPatch, match=r"nested sharding"):
        model(x)


@pytest.mark.multirank(2, timeout=60)
def test_fno2d_with_coordinate_features_is_refused_not_wrong(domain_mesh):
    model = distribute_module(FNO(**{**FNO2D, "coord_features": True}), domain_mesh)
    x = shard_tensor(torch.randn(1, 2, 17, 13), domain_mesh, [Shard(2)], [9, 8], requires_grad=True)
    with pytest.raises(MissingShardPatch, match=r"torch\.cat"):
        model(x)


# -- FNO 3-D ----------------------------------------------------------------------------------
@pytest.mark.multirank(2, timeout=60)
def test_fno3d_on_2_ranks_uneven(domain_mesh):
    _check(FNO(**FNO3D), torch.randn(1, 2, 9, 6, 6), ShardSpec(domain_mesh, [Shard(2)], [5, 4]))


@pytest.mark.multirank(4, timeout=60)
def test_fno3d_on_4_ranks_uneven(domain_mesh):
    _check(FNO(**FNO3D), torch.randn(1, 2, 9, 6, 6), ShardSpec(domain_mesh, [Shard(2)], [3, 2, 2, 2]))


# -- AFNO -------------------------------------------------------------------------------------
def _assert_afno_refused(mesh, placements, split_sizes, match: str = r"__setitem__.*plain") -> None:
    model = distribute_module(AFNO(**AFNO_CONFIG), mesh)
    x = shard_tensor(torch.randn(1, 2, 32, 16), mesh, placements, split_sizes, requires_grad=True)
    with pytest.raises(MissingShardPatch, match=match) as refusal:
        model(x)
    if "__setitem__" in str(refusal.value):
        assert "zeros_like" in str(refusal.value)  # the message says how to write the layer instead


@pytest.mark.multirank(2, timeout=60)
def test_afno_on_2_ranks_is_refused_not_wrong(domain_mesh):
    _assert_afno_refused(domain_mesh, [Shard(2)], [16, 16])


@pytest.mark.multirank(4, timeout=60)
def test_afno_on_4_ranks_is_refused_not_wrong(domain_mesh):
    _assert_afno_refused(domain_mesh, [Shard(2)], [8, 8, 8, 8])


@pytest.mark.multirank(4, timeout=60)
def test_afno_on_2x2_spatial_mesh_is_refused_not_wrong(spatial_mesh):
    # On H and W shards the patch embedding's flatten(2) already refuses (W rows would interleave).
    _assert_afno_refused(spatial_mesh, [Shard(2), Shard(3)], {0: [16, 16], 1: [8, 8]},
                         match=r"flatten.*interleave|__setitem__.*plain")
