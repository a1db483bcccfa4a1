"""PhysicsNeMo's transformer models (Transolver, GeoTransolver, FLARE, DiT), unmodified, domain-parallel.

These are the transformer models PhysicsNeMo 2.2 itself tests domain-parallel
(``test/domain_parallel/models/test_{transolver,geotransolver,flare,dit}.py`` in
its repository): point clouds / token sequences sharded on the token dim
(``Shard(1)`` of ``(B, N, C)``) on a 1-D domain mesh, global tokens replicated,
parameters replicated. Each test runs the model with
:func:`~physicsnemo_shardext.testing.check_conformance`: output, input gradients
and **every** parameter gradient against the single-process run (float32,
``rtol=atol=1e-4``).

Parameters: PhysicsNeMo's own tests use the DDP strategy (plain parameters, the
sharded activations auto-promote them); that is ``params="plain"`` here, where
``check_conformance`` checks each parameter gradient summed over the ranks (what
DDP's all-reduce gives). ``params="distribute"`` (``distribute_module``, every
parameter gradient must come back ``Replicate`` and complete) is tested too.

Small configurations (CPU, 2 cores): ``n_layers=1, n_hidden=16, n_head=2,
slice_num=4, mlp_ratio=1``, 16 points (``fx`` 3 features, ``embedding`` 5),
GeoTransolver with a 13- or 14-point geometry cloud and 2 global tokens of 4 features.

What runs where (PhysicsNeMo 2.2.2, torch 2.14):

* **Transolver** and **GeoTransolver (GALE)**: CPU and GPU. The physics attention
  contracts the sharded points into slice tokens (``torch.matmul`` over ``N``: a
  ``Partial(sum)`` result), projects them (``F.linear`` of a ``Partial`` input),
  all-reduces, attends among the replicated slices and maps back with
  ``torch.einsum("bths,bhsd->bthd", ...)``. **Uneven** shards run too: the
  ``indexing_einsum`` family's ``torch.matmul`` handler computes the contraction
  over the sharded points locally and all-reduces the slice tokens (DTensor's
  fallback sized the local blocks as even chunks and failed: ``RuntimeError: The
  expanded size of the tensor (8) must match the existing size (9)``; without the
  package Transolver fails earlier, at ``torch.cat((embedding, fx), -1)`` on
  uneven shards).
* 2-D meshes: the physics attention calls ``qkv.redistribute(placements=[Replicate()])``
  (one placement), so PhysicsNeMo's Transolver family runs on a 1-D domain mesh
  only (``ValueError: Number of placements must match mesh dimensions`` on a 2x2
  mesh, with and without this package). The 2x2 case that is meaningful is
  PhysicsNeMo's own ``(ddp, domain)`` layout: each ddp replica runs the model on
  its 1-D ``"domain"`` submesh (tested).
* **FLARE** and **GeoTransolver (GALE_FA)**: CPU and GPU. FLARE attention's first
  pass is ``scaled_dot_product_attention(global queries (replicated), K/V
  sharded)``; PhysicsNeMo's handler (``ReplicatedQSDPA``) computes it with the
  CUDA-only ``aten._scaled_dot_product_efficient_attention``; on CPU the attention
  family's ``replicated_query_attention`` runs it (per-rank partial softmax sums,
  three small all-reduces).
* **DiT** with the ``timm`` backend: CPU and GPU; the sequence-sharded q, k and v
  go to the attention family's ring (PhysicsNeMo's own ring needs CUDA streams).
  The ``natten2d`` backends need NATTEN's (CUDA) kernels and PhysicsNeMo's halo
  wrapper around them: CUDA-only.
* A **ViT** encoder (timm, 1-D and 2x2 meshes) and a **causal language model**
  (embedding, causal SDPA, cross-entropy training against one process) run too.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from physicsnemo.models.dit import DiT
from physicsnemo.models.flare import FLARE
from physicsnemo.models.geotransolver import GeoTransolver
from physicsnemo.models.transolver import Transolver
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_shardext.testing import ShardSpec, check_conformance

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}  # float32, outputs and every gradient

CUDA_ONLY_NATTEN = (
    "CUDA-only: the natten2d backends need NATTEN's neighborhood-attention kernels (CUDA builds) behind "
    "PhysicsNeMo's halo-exchanging na2d wrapper"
)


def transolver(**overrides) -> Transolver:
    config = dict(
        structured_shape=None,
        n_layers=1,
        n_hidden=16,
        dropout=0.0,
        n_head=2,
        time_input=False,
        act="gelu",
        mlp_ratio=1,
        functional_dim=3,
        embedding_dim=5,
        out_dim=2,
        slice_num=4,
        ref=1,
        unified_pos=False,
        use_te=False,
    )
    config.update(overrides)
    return Transolver(**config)


def geotransolver(**overrides) -> GeoTransolver:
    config = dict(
        functional_dim=3,
        out_dim=2,
        geometry_dim=3,
        global_dim=4,
        n_layers=1,
        n_hidden=16,
        dropout=0.0,
        n_head=2,
        act="gelu",
        mlp_ratio=1,
        slice_num=4,
        use_te=False,
        time_input=False,
        plus=False,
        include_local_features=False,
        structured_shape=None,
        attention_type="GALE",
    )
    config.update(overrides)
    return GeoTransolver(**config)


def flare(**overrides) -> FLARE:
    config = dict(
        functional_dim=3,
        out_dim=2,
        embedding_dim=5,
        n_layers=1,
        n_hidden=16,
        dropout=0.0,
        n_head=2,
        act="gelu",
        mlp_ratio=1,
        slice_num=4,
        unified_pos=False,
        structured_shape=None,
        time_input=False,
        use_te=False,
    )
    config.update(overrides)
    return FLARE(**config)


def _check(model: torch.nn.Module, inputs: list, specs, **kwargs):
    report = check_conformance(model, inputs, specs, **TOLERANCE, **kwargs)
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    compared = {k.split("'")[1] for k in report.max_abs_errors if k.startswith("gradient of parameter")}
    assert compared == names, f"parameters without a compared gradient: {sorted(names - compared)}"
    assert report.output_placements[0] == (Shard(1),), report.output_placements
    return report


def _points(n: int = 16) -> list[torch.Tensor]:
    return [torch.randn(1, n, 3), torch.randn(1, n, 5)]  # fx, embedding


def _geo_inputs(mesh, points: list[int], geometry: list[int]) -> tuple[list, list]:
    # Positional order of GeoTransolver.forward: local_embedding, local_positions, global_embedding, geometry.
    inputs = [torch.randn(1, sum(points), 3), None, torch.randn(1, 2, 4), torch.randn(1, sum(geometry), 3)]
    specs = [
        ShardSpec(mesh, [Shard(1)], points),
        None,
        ShardSpec(mesh, [Replicate()]),
        ShardSpec(mesh, [Shard(1)], geometry),
    ]
    return inputs, specs


# -- Transolver ---------------------------------------------------------------------------------
@pytest.mark.multirank(2, timeout=120)
def test_transolver_on_2_ranks_ddp_params(domain_mesh):
    # PhysicsNeMo's own strategy: plain (DDP) parameters, points sharded 8/8.
    _check(transolver(), _points(), ShardSpec(domain_mesh, [Shard(1)], [8, 8]), params="plain")


@pytest.mark.multirank(2, timeout=120)
def test_transolver_on_2_ranks_distributed_params(domain_mesh):
    # distribute_module parameters: every gradient Replicate and complete (the slice-token projection
    # takes a Partial input, whose weight gradient must come back reduced too).
    _check(transolver(), _points(), ShardSpec(domain_mesh, [Shard(1)], [8, 8]))


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("params", ["plain", "distribute"])
def test_transolver_on_2_ranks_uneven(domain_mesh, params):
    _check(transolver(), _points(), ShardSpec(domain_mesh, [Shard(1)], [9, 7]), params=params)


@pytest.mark.multirank(4, timeout=120)
def test_transolver_on_4_ranks_uneven_with_an_empty_shard(domain_mesh):
    _check(transolver(), _points(), ShardSpec(domain_mesh, [Shard(1)], [7, 0, 5, 4]), params="plain")


@pytest.mark.multirank(4, timeout=120)
def test_transolver_on_4_ranks(domain_mesh):
    _check(transolver(), _points(), ShardSpec(domain_mesh, [Shard(1)], [4, 4, 4, 4]), params="plain")


@pytest.mark.multirank(2, timeout=120)
def test_transolver_structured_2d_on_2_ranks(domain_mesh):
    # structured_shape=(8, 4): the flattened grid's 32 points split 16/16 (4 grid rows each); the
    # structured physics attention reshapes to the grid and runs a 3x3 conv (halo) on it.
    model = transolver(structured_shape=(8, 4))
    _check(model, _points(32), ShardSpec(domain_mesh, [Shard(1)], [16, 16]), params="plain")


@pytest.mark.multirank(4, timeout=120)
def test_transolver_on_2x2_ddp_domain_mesh(ddp_domain_mesh):
    # PhysicsNeMo's (ddp, domain) layout: each ddp replica runs the model on its 1-D "domain" submesh
    # (the physics attention itself assumes a 1-D domain mesh).
    spec = ShardSpec(ddp_domain_mesh["domain"], [Shard(1)], [8, 8])
    _check(transolver(), _points(), spec, params="plain")


# -- GeoTransolver ------------------------------------------------------------------------------
@pytest.mark.multirank(2, timeout=120)
def test_geotransolver_gale_on_2_ranks_ddp_params(domain_mesh):
    # Points 8/8, an independent geometry cloud 7/7 on the same mesh, 2 replicated global tokens.
    inputs, specs = _geo_inputs(domain_mesh, [8, 8], [7, 7])
    _check(geotransolver(), inputs, specs, params="plain")


@pytest.mark.multirank(2, timeout=120)
def test_geotransolver_gale_on_2_ranks_distributed_params(domain_mesh):
    inputs, specs = _geo_inputs(domain_mesh, [8, 8], [7, 7])
    _check(geotransolver(), inputs, specs)


@pytest.mark.multirank(2, timeout=120)
def test_geotransolver_gale_on_2_ranks_uneven(domain_mesh):
    inputs, specs = _geo_inputs(domain_mesh, [9, 7], [6, 7])
    _check(geotransolver(), inputs, specs, params="plain")


@pytest.mark.multirank(4, timeout=120)
@pytest.mark.parametrize(
    ("points", "geometry"), [([4, 4, 4, 4], [3, 3, 3, 3]), ([6, 2, 0, 8], [5, 1, 4, 3])], ids=["even", "uneven"]
)
def test_geotransolver_gale_on_4_ranks(domain_mesh, points, geometry):
    inputs, specs = _geo_inputs(domain_mesh, points, geometry)
    _check(geotransolver(), inputs, specs, params="plain")


@pytest.mark.multirank(2, timeout=120)
def test_geotransolver_gale_fa_on_2_ranks(domain_mesh):
    inputs, specs = _geo_inputs(domain_mesh, [8, 8], [7, 7])
    _check(geotransolver(attention_type="GALE_FA"), inputs, specs, params="plain")


# -- FLARE --------------------------------------------------------------------------------------
@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("split", [[8, 8], [9, 7]], ids=["even", "uneven"])
def test_flare_on_2_ranks(domain_mesh, split):
    _check(flare(), _points(), ShardSpec(domain_mesh, [Shard(1)], split), params="plain")


@pytest.mark.multirank(4, timeout=120)
@pytest.mark.parametrize("params", ["plain", "distribute"])
def test_flare_on_4_ranks_uneven(domain_mesh, params):
    _check(flare(), _points(), ShardSpec(domain_mesh, [Shard(1)], [5, 0, 7, 4]), params=params)


# -- DiT ----------------------------------------------------------------------------------------
def _dit(backend: str) -> DiT:
    return DiT(
        input_size=(8, 8),
        in_channels=2,
        out_channels=2,
        patch_size=2,
        hidden_size=16,
        depth=1,
        num_heads=2,
        attention_backend=backend,
        attn_kwargs={"attn_kernel": 3} if "natten" in backend else {},
    )


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("split", [[4, 4], [6, 2]], ids=["even", "uneven"])
def test_dit_timm_on_2_ranks(domain_mesh, split):
    # 8x8 image, 2x2 patches: a 4x4 token grid, H split 4/4 or 6/2 pixels (2+2 or 3+1 token rows);
    # t replicated. Sequence-sharded self-attention runs as the attention family's ring on gloo.
    specs = [ShardSpec(domain_mesh, [Shard(2)], split), ShardSpec(domain_mesh, [Replicate()])]
    check_conformance(_dit("timm"), [torch.randn(1, 2, 8, 8), torch.rand(1)], specs, **TOLERANCE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_ONLY_NATTEN)
@pytest.mark.multirank(2, timeout=120)
def test_dit_natten_on_2_ranks(domain_mesh):
    pytest.importorskip("natten", reason=CUDA_ONLY_NATTEN)
    specs = [ShardSpec(domain_mesh, [Shard(2)], [4, 4]), ShardSpec(domain_mesh, [Replicate()])]
    check_conformance(_dit("natten2d"), [torch.randn(1, 2, 8, 8), torch.rand(1)], specs, **TOLERANCE)


# -- the two ops these models exposed -----------------------------------------------------------
@pytest.mark.multirank(2, timeout=60)
def test_einsum_with_a_replicated_shardtensor_operand(domain_mesh):
    # Transolver's deslice: slice weights sharded on the points (uneven 9/7), attended slice tokens a
    # Replicate ShardTensor. Each rank uses the tokens for its own points only, so their gradient is
    # the sum over the ranks (the spectral plugin's einsum used to leave it unreduced).
    weights, tokens = torch.randn(1, 16, 2, 4), torch.randn(1, 2, 4, 8)
    specs = [ShardSpec(domain_mesh, [Shard(1)], [9, 7]), ShardSpec(domain_mesh, [Replicate()])]
    check_conformance(lambda w, t: torch.einsum("bths,bhsd->bthd", w, t), [weights, tokens], specs, **TOLERANCE)


@pytest.mark.multirank(2, timeout=60)
def test_fallback_gradient_of_a_partial_input(domain_mesh):
    # A pending sum (Partial) through an op without a shard patch: the gradient of each rank's summand is
    # the whole (Replicate) gradient; the fallback's backward used to try to redistribute it to Partial.
    x = torch.randn(1, 16, 2, 4)

    def normalize_over_points(w):  # physics attention's slice normalization
        return w / (w.sum(1, keepdim=True) + 1.0)  # the sum is Partial(sum); the division takes the fallback

    check_conformance(normalize_over_points, [x], ShardSpec(domain_mesh, [Shard(1)], [9, 7]), **TOLERANCE)


# -- a ViT-style encoder (timm) on a sharded image ------------------------------------------------
def _vit(**overrides) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    config = dict(
        img_size=16,
        patch_size=4,
        in_chans=2,
        num_classes=3,
        embed_dim=16,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        class_token=False,
        global_pool="avg",
    )
    config.update(overrides)
    return VisionTransformer(**config)


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("split", [[8, 8], [12, 4], [16, 0]], ids=["even", "uneven", "empty"])
def test_vit_encoder_on_2_ranks(domain_mesh, split):
    # 16x16 image, 4x4 patches; H split on patch rows: the patch embedding (a strided conv) keeps the
    # split, tokens (flatten + transpose) are sharded on the sequence, self-attention is the ring,
    # the average pool sums over the ranks; the class logits come back Replicate.
    report = check_conformance(
        _vit(),
        [torch.randn(1, 2, 16, 16)],
        ShardSpec(domain_mesh, [Shard(2)], split),
        expected_placements=[Replicate()],
        **TOLERANCE,
    )
    assert len([k for k in report.max_abs_errors if k.startswith("gradient of parameter")]) == len(
        list(_vit().parameters())
    )


@pytest.mark.multirank(4, timeout=120)
def test_vit_encoder_on_4_ranks(domain_mesh):
    check_conformance(
        _vit(),
        [torch.randn(1, 2, 16, 16)],
        ShardSpec(domain_mesh, [Shard(2)], [4, 8, 0, 4]),
        expected_placements=[Replicate()],
        **TOLERANCE,
    )


# -- a causal sequence model ------------------------------------------------------------------------
def _example_model() -> type:
    """The decoder of examples/transformer_cpu.py (one model for the example and this test)."""
    name = "shardext_example_transformer_cpu"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "examples" / "transformer_cpu.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].CausalLM


#: A one-block decoder (token + learned position embedding, causal self-attention, MLP, LM head), small.
CausalLM = functools.partial(_example_model(), vocab=11, width=16, heads=2, length=32, mlp_ratio=2, position_scale=0.1)


@pytest.mark.multirank(2, timeout=120)
@pytest.mark.parametrize("split", [[16, 16], [21, 11]], ids=["even", "uneven"])
def test_causal_lm_on_2_ranks(domain_mesh, split):
    ids = torch.randint(0, 11, (2, 32), generator=torch.Generator().manual_seed(0))
    check_conformance(CausalLM(), [ids], ShardSpec(domain_mesh, [Shard(1)], split), **TOLERANCE)


@pytest.mark.multirank(4, timeout=180)
def test_causal_lm_trains_like_single_process_on_a_2x2_layout(rank):
    # ddp 2 x domain 2, DDP, SGD, next-token cross-entropy: losses, every first-step gradient and
    # the final parameters against one process on the global batch. (Not Adam: the key bias has a
    # zero gradient in theory, and Adam turns its rounding noise into full-size steps on both sides.)
    from physicsnemo_shardext.training.parallel import build_layout
    from physicsnemo_shardext.training.verification import verify_training

    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 11, (2, 32), generator=g), torch.randint(0, 11, (2, 32), generator=g)) for _ in range(2)
    ]

    def next_token_loss(logits, targets):
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets)

    report = verify_training(
        CausalLM,
        batches,
        build_layout(ddp=2),
        shard_dim=1,
        sizes=[19, 13],
        loss_fn=next_token_loss,
        wrapper="ddp",
        optimizer="sgd",
        lr=0.1,
        steps=3,
        rtol=1e-4,
    )
    assert report.ok, report.format()
    assert len(report.gradients) == len(list(CausalLM().parameters()))


@pytest.mark.multirank(4, timeout=180)
def test_vit_encoder_on_a_2x2_mesh(spatial_mesh):
    # H over mesh dim 0 (patch rows 8/8), W over mesh dim 1 (12/4): flattening the patch grid into
    # tokens moves W's shard onto the token dim with one all-to-all; everything after is 1-D.
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: [8, 8], 1: [12, 4]})
    check_conformance(_vit(), [torch.randn(1, 2, 16, 16)], spec, expected_placements=None, **TOLERANCE)


@pytest.mark.multirank(4, timeout=180)
def test_dit_timm_on_4_ranks(domain_mesh):
    specs = [ShardSpec(domain_mesh, [Shard(2)], [2, 4, 0, 2]), ShardSpec(domain_mesh, [Replicate()])]
    check_conformance(_dit("timm"), [torch.randn(1, 2, 8, 8), torch.rand(1)], specs, **TOLERANCE)
