"""PhysicsNeMo's model families at small sizes, each with the dims a sample can be split along.

Every entry of `ZOO` builds one model of PhysicsNeMo 2.2 (``physicsnemo.models``
and ``physicsnemo.experimental.models``) with its inputs, and says which input dims
are split across ranks: an uneven split for 2 ranks and, for 2-D fields, a split
of two dims for a 2x2 mesh. `tests/models/test_model_zoo.py` runs each against
single-process (output, every parameter and input gradient, zero-initialised
parameters re-drawn); `docs/models.md` has the table of results. A factory also
works with ``shardext verify``:

    shardext verify examples/model_zoo.py:songunet --shard 2 --ranks 2

Examples:
    >>> entry = ZOO["songunet"]
    >>> model, inputs = entry.build()
    >>> [tuple(x.shape) for x in inputs], entry.dims, entry.split
    ([(1, 2, 16, 16), (1,)], (2, 3), (10, 6))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

warnings.filterwarnings("ignore", message=".*physicsnemo.experimental.*")

Built = tuple[nn.Module, list[torch.Tensor]]


@dataclass(frozen=True)
class ZooModel:
    """One model family: how to build it, how its input is split, and what to expect.

    Attributes:
        family: PhysicsNeMo's module (``physicsnemo.models.<family>``).
        build: returns the model and its inputs (seeded, the same on every rank).
        dims: the dims of the sharded inputs that are split: the first on a 1-D
            mesh, both on a 2x2 mesh (``()`` when not domain-parallel).
        split: the local sizes of ``dims[0]`` on 2 ranks (uneven).
        split_2d: local sizes of ``dims[0]`` and ``dims[1]`` on a 2x2 mesh, or
            ``None`` where the model is not 2-D.
        sharded: which inputs are split (the others are replicated).
        outcome: ``"match"``, ``"refused"`` (a ``MissingShardPatch`` naming an op)
            or ``"not domain-parallel"``.
        note: the refused op or the reason, for the table.
        rtol, atol: the comparison's tolerances (float32).
        kwargs: keyword arguments of the model's forward.
        params: ``check_conformance``'s parameter mode: ``"distribute"`` (``Replicate``
            DTensor parameters) or ``"plain"`` (DDP's plain parameters).
        expected_placements: the output placements to check (``"input"``: the first
            sharded input's; ``None``: not checked, where the output has other dims).
        placements_2d: the same on the 2x2 mesh.
        refused_2d: on the 2x2 mesh, the ``MissingShardPatch`` expected (op name, ``:``, why).
        slow: a long cell (over about 20 s on 2 CPU cores), run with ``--run-slow``.
    """

    family: str
    build: Callable[[], Built]
    dims: tuple[int, ...]
    split: tuple[int, ...] = ()
    split_2d: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    sharded: tuple[int, ...] = (0,)
    outcome: str = "match"
    note: str = ""
    rtol: float = 1e-4
    atol: float = 1e-4
    kwargs: dict[str, Any] = field(default_factory=dict)
    params: str = "distribute"
    expected_placements: Any = "input"
    placements_2d: Any = "input"
    refused_2d: str = ""
    slow: bool = False

    def specs(self, mesh: Any, inputs: list[torch.Tensor], two_d: bool = False) -> list[Any]:
        """The `ShardSpec` of each input on ``mesh`` (1-D, or 2x2 when ``two_d``); ``None`` for replicated ones."""
        from physicsnemo_shardext.testing import ShardSpec

        if two_d:
            assert self.split_2d is not None, f"{self.family}: no 2-D split"
            spec = ShardSpec(mesh, [Shard(self.dims[0]), Shard(self.dims[1])],
                             {0: list(self.split_2d[0]), 1: list(self.split_2d[1])})
        else:
            spec = ShardSpec(mesh, [Shard(self.dims[0])], list(self.split))
        return [spec if i in self.sharded else None for i in range(len(inputs))]


def _seeded(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def songunet() -> Built:
    """SongUNet (CorrDiff's and StormCast's backbone) with attention at 8x8 and in the bottleneck."""
    from physicsnemo.models.diffusion_unets import SongUNet

    torch.manual_seed(0)
    model = SongUNet(img_resolution=16, in_channels=2, out_channels=2, model_channels=8, channel_mult=[1, 2],
                     num_blocks=1, attn_resolutions=[8], dropout=0.0, embedding_type="positional")
    x, noise = _seeded((1, 2, 16, 16), (1,))
    return model, [x, noise]


def dhariwalunet() -> Built:
    """DhariwalUNet (ADM) with attention at 8x8."""
    from physicsnemo.models.diffusion_unets import DhariwalUNet

    torch.manual_seed(0)
    # 64 channels at 8x8: one attention head (DhariwalUNet's heads are channels // 64)
    model = DhariwalUNet(img_resolution=16, in_channels=2, out_channels=2, model_channels=32, channel_mult=[1, 2],
                         num_blocks=1, attn_resolutions=[8], dropout=0.0)
    x, noise = _seeded((1, 2, 16, 16), (1,))
    return model, [x, noise]


def corrdiff_regression() -> Built:
    """CorrDiff's regression UNet (SongUNetPosEmbd inside, positional grid embedding, attention on)."""
    from physicsnemo.models.diffusion_unets import CorrDiffRegressionUNet

    torch.manual_seed(0)
    model = CorrDiffRegressionUNet(img_resolution=16, img_in_channels=2, img_out_channels=2, model_type="SongUNet",
                                   model_channels=8, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8],
                                   dropout=0.0)
    x, lr = _seeded((1, 2, 16, 16), (1, 2, 16, 16))
    return model, [x, lr]




def topodiff() -> Built:
    """TopoDiff (topology-optimisation diffusion UNet): constraints concatenated, attention at 8x8."""
    from physicsnemo.models.topodiff import TopoDiff

    torch.manual_seed(0)
    model = TopoDiff(img_resolution=16, in_channels=3, out_channels=1, model_channels=32, channel_mult=[1, 2],
                     num_blocks=1, attn_resolutions=[8], dropout=0.0)
    x, cons = _seeded((1, 1, 16, 16), (1, 2, 16, 16))
    return model, [x, cons, torch.tensor([3.0])]


def dpot() -> Built:
    """DPOT: patch embedding, AFNO mixing in Fourier space, temporal aggregation."""
    from physicsnemo.models.dpot import DPOTNet

    torch.manual_seed(0)
    model = DPOTNet(inp_shape=16, patch_size=2, in_channels=2, out_channels=2, in_timesteps=2, out_timesteps=1,
                    num_blocks=2, embed_dim=16, out_layer_dim=8, depth=1, modes=4, norm_groups=2)
    (x,) = _seeded((1, 16, 16, 2, 2))
    return model, [x]


def pangu() -> Built:
    """Pangu-Weather: 3-D Earth-specific windowed transformer (surface and 13 pressure levels)."""
    from physicsnemo.models.pangu import Pangu

    torch.manual_seed(0)
    model = Pangu(img_size=(8, 16), patch_size=(2, 2, 2), embed_dim=8, num_heads=(1, 1, 1, 1), window_size=(2, 2, 4))
    (x,) = _seeded((1, 72, 8, 16))
    return model, [x]


def fengwu() -> Built:
    """FengWu: one encoder per variable group, a 3-D windowed transformer fuses them."""
    from physicsnemo.models.fengwu import Fengwu

    torch.manual_seed(0)
    model = Fengwu(img_size=(8, 16), pressure_level=2, embed_dim=8, patch_size=(2, 2), num_heads=(1, 1, 1, 1),
                   window_size=(2, 2, 4))
    (x,) = _seeded((1, 4 + 5 * 2, 8, 16))
    return model, [x]


def swinrnn() -> Built:
    """SwinRNN: a Swin-transformer recurrent cell over a short history."""
    from physicsnemo.models.swinvrnn import SwinRNN

    torch.manual_seed(0)
    # SwinRNN concatenates the last input step with the embedded field: a patch of one pixel
    model = SwinRNN(img_size=(2, 16, 16), patch_size=(2, 1, 1), in_chans=2, out_chans=2, embed_dim=8,
                    num_groups=2, num_heads=2, window_size=2)
    (x,) = _seeded((1, 2, 2, 16, 16))
    return model, [x]


def dlwp() -> Built:
    """DLWP on the cubed sphere: six faces, each padded from its neighbours (rotated)."""
    from physicsnemo.models.dlwp import DLWP

    torch.manual_seed(0)
    model = DLWP(nr_input_channels=2, nr_output_channels=2, nr_initial_channels=4, depth=2)
    (x,) = _seeded((1, 2, 6, 8, 8))
    return model, [x]


def _conv_rnn(name: str, steps_in: int) -> Built:
    """A small 2-D convolutional GRU of ``physicsnemo.models.rnn`` on ``steps_in`` input steps."""
    from physicsnemo.models import rnn

    torch.manual_seed(0)
    model = getattr(rnn, name)(input_channels=2, dimension=2, nr_latent_channels=4, nr_residual_blocks=1,
                               nr_downsamples=1, nr_tsteps=3)
    (x,) = _seeded((1, 2, steps_in, 16, 12))
    return model, [x]


def one2many_rnn() -> Built:
    """One2ManyRNN: a convolutional GRU unrolled from one time step to several (2-D)."""
    return _conv_rnn("One2ManyRNN", 1)


def seq2seq_rnn() -> Built:
    """Seq2SeqRNN: a convolutional GRU encoder-decoder over a sequence of fields (2-D)."""
    return _conv_rnn("Seq2SeqRNN", 3)


def fno2d() -> Built:
    """FNO 2-D: spectral convolutions (distributed rfft2/irfft2), 1x1 lift and decoder."""
    from physicsnemo.models.fno import FNO

    torch.manual_seed(0)
    model = FNO(in_channels=2, out_channels=1, dimension=2, latent_channels=8, num_fno_layers=2,
                num_fno_modes=[5, 4], decoder_layers=1, decoder_layer_size=8, padding=0, coord_features=False)
    return model, _seeded((1, 2, 17, 12))


def fno3d() -> Built:
    """FNO 3-D: pencil FFTs over three sharded-capable dims."""
    from physicsnemo.models.fno import FNO

    torch.manual_seed(0)
    model = FNO(in_channels=2, out_channels=1, dimension=3, latent_channels=8, num_fno_layers=1, num_fno_modes=2,
                decoder_layers=1, decoder_layer_size=8, padding=0, coord_features=False)
    return model, _seeded((1, 2, 9, 6, 4))


def afno() -> Built:
    """AFNO: patch embedding, block-diagonal spectral filter, transposed patch recovery."""
    from physicsnemo.models.afno import AFNO

    torch.manual_seed(0)
    model = AFNO(inp_shape=[32, 16], in_channels=2, out_channels=1, patch_size=[4, 4], embed_dim=8, depth=1,
                 num_blocks=2)
    return model, _seeded((1, 2, 32, 16))


def unet3d() -> Built:
    """UNet 3-D: halos, max pooling, transposed convolutions, group norm, skip concatenation."""
    from physicsnemo.models.unet import UNet

    torch.manual_seed(0)
    model = UNet(in_channels=1, out_channels=1, model_depth=3, feature_map_channels=[2, 2, 4, 4, 8, 8],
                 gradient_checkpointing=False)
    return model, _seeded((1, 1, 16, 8, 4))


def pix2pix() -> Built:
    """Pix2Pix 2-D: reflection padding, strided and transposed convolutions, batch norm."""
    from physicsnemo.models.pix2pix import Pix2Pix

    torch.manual_seed(0)
    model = Pix2Pix(in_channels=1, out_channels=2, dimension=2, conv_layer_size=4, n_downsampling=2,
                    n_upsampling=2, n_blocks=1, batch_norm=True, padding_type="reflect")
    return model, _seeded((1, 1, 24, 20))


def srrn() -> Built:
    """SRResNet 3-D: 7x7x7 convolutions, batch norm, PReLU, the view/permute pixel shuffle."""
    from physicsnemo.models.srrn import SRResNet

    torch.manual_seed(0)
    model = SRResNet(in_channels=1, out_channels=1, conv_layer_size=4, n_resid_blocks=1, scaling_factor=2)
    return model, _seeded((1, 1, 10, 7, 4))


def dit() -> Built:
    """DiT (timm attention): patchify, adaLN-zero modulation (re-drawn), sequence-sharded attention."""
    from physicsnemo.models.dit import DiT

    torch.manual_seed(0)
    model = DiT(input_size=(8, 8), in_channels=2, out_channels=2, patch_size=2, hidden_size=16, depth=1,
                num_heads=2, attention_backend="timm")
    (x,) = _seeded((1, 2, 8, 8))
    return model, [x, torch.rand(1, generator=torch.Generator().manual_seed(1))]


def _points(n: int = 16) -> list[torch.Tensor]:
    return _seeded((1, n, 3), (1, n, 5))


def transolver() -> Built:
    """Transolver on an unstructured point cloud: physics attention over slice tokens."""
    from physicsnemo.models.transolver import Transolver

    torch.manual_seed(0)
    model = Transolver(structured_shape=None, n_layers=1, n_hidden=16, dropout=0.0, n_head=2, time_input=False,
                       act="gelu", mlp_ratio=1, functional_dim=3, embedding_dim=5, out_dim=2, slice_num=4, ref=1,
                       unified_pos=False, use_te=False)
    return model, _points()


def geotransolver() -> Built:
    """GeoTransolver (GALE attention): points and geometry sharded, a global vector replicated."""
    from physicsnemo.models.geotransolver import GeoTransolver

    torch.manual_seed(0)
    model = GeoTransolver(functional_dim=3, out_dim=2, geometry_dim=3, global_dim=4, n_layers=1, n_hidden=16,
                          dropout=0.0, n_head=2, act="gelu", mlp_ratio=1, slice_num=4, use_te=False,
                          time_input=False, plus=False, include_local_features=False, structured_shape=None,
                          attention_type="GALE")
    x, glob, geometry = _seeded((1, 16, 3), (1, 2, 4), (1, 16, 3))
    return model, [x, None, glob, geometry]  # type: ignore[list-item]


def flare() -> Built:
    """FLARE: learned global queries attend to the sharded points (replicated-query attention)."""
    from physicsnemo.models.flare import FLARE

    torch.manual_seed(0)
    model = FLARE(functional_dim=3, out_dim=2, embedding_dim=5, n_layers=1, n_hidden=16, dropout=0.0, n_head=2,
                  act="gelu", mlp_ratio=1, slice_num=4, unified_pos=False, structured_shape=None, time_input=False,
                  use_te=False)
    return model, _points()


def diffusion_unet_3d() -> Built:
    """DiffusionUNet3D (experimental; the 3-D SongUNet of PhysicsNeMo's own domain-parallel tests), attention on."""
    from physicsnemo.experimental.models.diffusion_unets import DiffusionUNet3D

    torch.manual_seed(0)
    model = DiffusionUNet3D(x_channels=2, num_levels=2, model_channels=8, channel_mult=[1, 2], num_blocks=1,
                            attention_levels=[1], dropout=0.0)
    (x,) = _seeded((1, 2, 12, 8, 4))
    return model, [x, torch.tensor([0.5])]


class _Conditioned(nn.Module):
    """DiffusionUNet3D with its ``condition`` TensorDict built from plain arguments (a volume and a vector)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, t: torch.Tensor, volume: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        from tensordict import TensorDict

        condition = TensorDict({"volume": volume, "vector": vector}, batch_size=[])
        return self.net(x, t, condition=condition)


def diffusion_unet_3d_conditional() -> Built:
    """DiffusionUNet3D conditioned on a volume (concatenated, sharded like x) and a vector (replicated)."""
    from physicsnemo.experimental.models.diffusion_unets import DiffusionUNet3D

    torch.manual_seed(0)
    net = DiffusionUNet3D(x_channels=2, vol_cond_channels=1, vec_cond_dim=3, num_levels=2, model_channels=8,
                          channel_mult=[1, 2], num_blocks=1, attention_levels=[1], dropout=0.0)
    x, volume, vector = _seeded((1, 2, 12, 8, 4), (1, 1, 12, 8, 4), (1, 3))
    return _Conditioned(net), [x, torch.tensor([0.5]), volume, vector]


class _ListInput(nn.Module):
    """Calls ``model([x0, x1, ...])`` for models whose forward takes one list of tensors."""

    def __init__(self, model: nn.Module, **kwargs):
        super().__init__()
        self.model = model
        self.kwargs = kwargs

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(list(inputs), **self.kwargs)


def _healpix_configs(channels: list[int], recurrent: bool = False):
    from omegaconf import OmegaConf

    conv = {"_target_": "physicsnemo.models.dlwp_healpix.layers.BasicConvBlock", "kernel_size": 3,
            "n_layers": 1, "activation": {"_target_": "torch.nn.GELU"}}
    gru = {"_target_": "physicsnemo.models.dlwp_healpix.layers.ConvGRUBlock", "kernel_size": 1}
    encoder = {"_target_": "physicsnemo.models.dlwp_healpix.layers.UNetEncoder", "_recursive_": False,
               "conv_block": conv, "down_sampling_block": {"_target_": "physicsnemo.nn.HEALPixAvgPool", "pooling": 2},
               "n_channels": channels, "n_layers": [1] * len(channels)}
    decoder = {"_target_": "physicsnemo.models.dlwp_healpix.layers.UNetDecoder", "_recursive_": False,
               "conv_block": conv,
               "up_sampling_block": {"_target_": "physicsnemo.models.dlwp_healpix.layers.TransposedConvUpsample",
                                     "upsampling": 2, "activation": {"_target_": "torch.nn.GELU"}},
               "output_layer": {"_target_": "physicsnemo.models.dlwp_healpix.layers.BasicConvBlock",
                                "kernel_size": 1, "n_layers": 1},
               "n_channels": channels[::-1], "n_layers": [1] * len(channels)}
    if recurrent:
        decoder["recurrent_block"] = gru
    return OmegaConf.create(encoder), OmegaConf.create(decoder)


def healpix_unet() -> Built:
    """DLWP-HEALPix UNet: 12 faces folded into the batch, each conv padded from the neighbour faces."""
    from physicsnemo.models.dlwp_healpix import HEALPixUNet

    torch.manual_seed(0)
    encoder, decoder = _healpix_configs([4, 8])
    model = HEALPixUNet(encoder=encoder, decoder=decoder, input_channels=2, output_channels=2, n_constants=0,
                        decoder_input_channels=0, input_time_dim=1, output_time_dim=1)
    (x,) = _seeded((1, 12, 1, 2, 8, 8))  # (B, F, T, C, H, W)
    return _ListInput(model), [x]


def _row_reduction(features: torch.Tensor, row_splits: torch.Tensor, reduction: str = "mean",
                   eps: float = 1e-6) -> torch.Tensor:
    """torch_scatter's ``segment_csr`` sum/mean in plain torch (torch_scatter is not installed here)."""
    if reduction not in ("sum", "mean"):
        raise NotImplementedError(f"reduction {reduction!r} needs torch_scatter")
    lengths = row_splits[1:] - row_splits[:-1]
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=features.device), lengths)
    out = features.new_zeros(lengths.numel(), features.shape[-1]).index_add(0, rows, features)
    return out if reduction == "sum" else out / lengths.clamp(min=1).unsqueeze(-1).to(out.dtype)


def figconvunet() -> Built:
    """FIGConvUNet: points -> three factorized grids (warp radius search), 2-D UNet on the grids, grids -> points."""
    from physicsnemo.models.figconvnet import FIGConvUNet, point_feature_conv
    from physicsnemo.models.figconvnet.components import reductions

    if not reductions.TORCH_SCATTER_AVAILABLE:  # the graph convolutions' segment reduction, in plain torch
        point_feature_conv.row_reduction = _row_reduction
    torch.manual_seed(0)
    model = FIGConvUNet(in_channels=8, out_channels=2, kernel_size=3, hidden_channels=[8, 8], num_levels=1,
                        mlp_channels=[8, 8], resolution_memory_format_pairs=[("b_xc_y_z", (2, 8, 8)),
                        ("b_yc_x_z", (8, 2, 8)), ("b_zc_x_y", (8, 8, 2))], pos_encode_dim=4, knn_k=4)
    vertices = torch.rand(1, 64, 3, generator=torch.Generator().manual_seed(0))  # inside the unit AABB
    return model, [vertices]


_DOMINO_KEYS = ("volume_mesh_centers", "sdf_nodes", "pos_volume_closest", "pos_volume_center_of_mass",
                "geometry_coordinates", "grid", "sdf_grid", "surf_grid", "sdf_surf_grid", "volume_min_max",
                "global_params_values", "global_params_reference")


class _DictInput(nn.Module):
    """Calls ``model({key: tensor})`` for models whose forward takes one dict (DoMINO's ``data_dict``)."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...], output: int | None = None):
        super().__init__()
        self.model, self.keys, self.output = model, keys, output

    def forward(self, *inputs: torch.Tensor):
        out = self.model(dict(zip(self.keys, inputs)))
        return out if self.output is None else out[self.output]


def domino_volume() -> Built:
    """DoMINO (volume only): geometry -> grid by ball query (warp), 3-D UNet on the grid, volume points sampled."""
    import copy

    from physicsnemo.models.domino import DoMINO
    from physicsnemo.models.domino.config import DEFAULT_MODEL_PARAMS

    cfg = copy.deepcopy(DEFAULT_MODEL_PARAMS)
    cfg.model_type = "volume"
    cfg.interp_res = [12, 8, 8]
    cfg.num_neighbors_volume = 4
    cfg.geometry_rep.base_filters = 4
    cfg.geometry_rep.geo_conv.base_neurons = 8
    cfg.geometry_rep.geo_conv.volume_radii = [0.25, 0.5]
    cfg.geometry_rep.geo_conv.volume_neighbors_in_radius = [4, 8]
    cfg.geometry_rep.geo_conv.surface_radii = [0.25]
    cfg.geometry_rep.geo_conv.surface_neighbors_in_radius = [4]
    cfg.geometry_rep.geo_processor.base_filters = 2
    cfg.geometry_rep.geo_processor.surface_sdf_scaling_factor = [0.04]
    cfg.geometry_local.base_layer = 8
    cfg.geometry_local.surface_neighbors_in_radius = [4]
    cfg.geometry_local.surface_radii = [0.25]
    cfg.geometry_local.volume_neighbors_in_radius = [4, 8]
    cfg.geometry_local.volume_radii = [0.25, 0.5]
    for block in ("nn_basis_functions", "aggregation_model", "parameter_model"):
        cfg[block].base_layer = 8
    cfg.position_encoder.base_neurons = 8
    torch.manual_seed(0)
    model = DoMINO(input_features=3, output_features_vol=2, output_features_surf=None, global_features=2,
                   model_parameters=cfg)
    g = torch.Generator().manual_seed(0)
    n, (nx, ny, nz) = 12, cfg.interp_res

    def u(*shape):  # coordinates in [-1, 1]
        return 2 * torch.rand(*shape, generator=g) - 1

    axes = [torch.linspace(-1, 1, k) for k in (nx, ny, nz)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).unsqueeze(0)  # (1, nx, ny, nz, 3)
    inputs = [u(1, n, 3), torch.rand(1, n, 1, generator=g), u(1, n, 3), u(1, n, 3),  # volume points
              u(1, n, 3), grid, torch.rand(1, nx, ny, nz, generator=g),  # geometry, grid, sdf on the grid
              grid.clone(), torch.rand(1, nx, ny, nz, generator=g),  # surface grid (unused by a volume model)
              torch.tensor([[[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]]),  # volume_min_max
              torch.rand(1, 2, 1, generator=g), torch.rand(1, 2, 1, generator=g)]
    return _DictInput(model, _DOMINO_KEYS, output=0), inputs


def _hpx_grid_level0(level: int, pixel_order=None):
    """earth2grid's ``healpix.Grid`` for level 0 only: the 12 base pixels' centre longitudes (degrees)."""
    from types import SimpleNamespace

    if level != 0:
        raise NotImplementedError("the stand-in for earth2grid knows level 0 only")
    return SimpleNamespace(lon=torch.tensor([45.0, 135.0, 225.0, 315.0, 0.0, 90.0, 180.0, 270.0,
                                             45.0, 135.0, 225.0, 315.0]))


def healda() -> Built:
    """HealDA (v1): observations scattered onto HEALPix pixels, concatenated with the state, HEALPix-patch DiT."""
    from physicsnemo.experimental.models.healda import HealDA
    from physicsnemo.nn.module.hpx import tokenizer

    if not tokenizer.HEALPIXPAD_AVAILABLE:  # earth2grid gives the tokenizer's calendar embedding its longitudes
        tokenizer.hpx_grid = _hpx_grid_level0
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # level_in 1: 12 faces of 2x2 pixels (XY order, face-major); level_model 0: one token per face
        model = HealDA(in_channels=2, out_channels=2, nchannel_per_sensor=[2], nplatform_per_sensor=[1],
                       hidden_size=16, num_layers=1, num_heads=2, mlp_ratio=1.0, level_in=1, level_model=0,
                       time_length=1, embed_dim=4, meta_dim=4, fusion_dim=4, qk_norm_type=None,
                       attention_backend="timm", layernorm_backend="torch")
    g = torch.Generator().manual_seed(0)
    nobs, npix = 20, 48
    x = torch.randn(1, 2, 1, npix, generator=g)  # (B, C, T, Npix)
    obs = [torch.randn(nobs, generator=g), torch.randn(nobs, 4, generator=g),  # values, float metadata
           torch.randint(0, npix, (nobs,), generator=g), torch.randint(0, 2, (nobs,), generator=g),  # pix, channel
           torch.zeros(nobs, dtype=torch.long), torch.randint(0, 3, (nobs,), generator=g),  # platform, obs type
           torch.tensor([[[nobs]]])]  # offsets (S, B, T)
    calendar = [torch.tensor([[43200.0]]), torch.tensor([[100.0]])]  # second_of_day, day_of_year (B, T)
    return model, [x, torch.tensor([0.5]), *obs, *calendar, torch.zeros(1, 0)]


#: FNO's, AFNO's and DiT's output on a 2x2 mesh: values and every gradient match; the decoder's (or
#: unpatchify's) reshape merging H and W gives W back replicated.
_W_GATHERED = "2x2 mesh: the output comes back with W replicated (the decoder's reshape merges H and W)"

#: Why a model is compared with DDP's plain parameters: a plain (replicated) tensor it takes or makes
#: meets a parameter in a matmul, which DTensor refuses when distribute_module made that parameter a
#: DTensor ("aten.mm got mixed torch.Tensor and DTensor"); with DDP parameters nothing is mixed.
_PLAIN_VECTOR = "DDP parameters: a plain conditioning vector meets a weight in aten.mm (DTensor parameters refuse it)"

ZOO: dict[str, ZooModel] = {
    "songunet": ZooModel("diffusion_unets", songunet, dims=(2, 3), split=(10, 6), split_2d=((10, 6), (6, 10))),
    "dhariwalunet": ZooModel("diffusion_unets", dhariwalunet, dims=(2, 3), split=(10, 6),
                             split_2d=((10, 6), (6, 10))),
    "corrdiff_regression": ZooModel("diffusion_unets", corrdiff_regression, dims=(2, 3), split=(10, 6),
                                    split_2d=((10, 6), (6, 10)), sharded=(0, 1)),
    "diffusion_unet_3d": ZooModel("diffusion_unets", diffusion_unet_3d, dims=(2, 3), split=(8, 4),
                                  split_2d=((8, 4), (4, 4))),
    "diffusion_unet_3d_conditional": ZooModel("diffusion_unets", diffusion_unet_3d_conditional, dims=(2, 3),
                                              split=(8, 4), split_2d=((8, 4), (4, 4)), sharded=(0, 2),
                                              params="plain", note=_PLAIN_VECTOR),
    "topodiff": ZooModel("topodiff", topodiff, dims=(2, 3), split=(10, 6), split_2d=((10, 6), (6, 10)),
                         sharded=(0, 1)),
    "dpot": ZooModel("dpot", dpot, dims=(1, 2), split=(10, 6), split_2d=((10, 6), (6, 10)), params="plain",
                     note="DDP parameters (distribute_module's meet a plain tensor in aten.mm: DTensor refuses "
                     "mixed Tensor/DTensor); Tensor.__setitem__ (dpot.py:172, 177) gathers an activation"),
    "pangu": ZooModel("pangu", pangu, dims=(2, 3), split=(6, 2), split_2d=((4, 4), (8, 8)), expected_placements=None,
                      refused_2d="torch.nn.functional.conv_transpose2d: on the 2x2 mesh the patch recovery "
                      "meets W's shard moved to the channel dim",
                      note="the surface output comes back Replicate (a Tensor.__getitem__ gathers it); 2x2 mesh: "
                      "refused at conv_transpose2d (input sharded along the channel dim)"),
    "fengwu": ZooModel("fengwu", fengwu, dims=(2, 3), split=(6, 2), split_2d=((4, 4), (8, 8)), slow=True,
                       placements_2d=None,
                       note="matches, but its 3-D window attention gathers whole activations (78 gathers): "
                       "correct, not memory-parallel"),
    "swinrnn": ZooModel("swinvrnn", swinrnn, dims=(3, 4), split=(10, 6), split_2d=((10, 6), (8, 8)),
                        expected_placements=[Shard(2)], placements_2d=[Shard(2), Shard(3)], slow=True,
                        note="output (B, C, H, W): H is dim 2; its Swin windows gather whole activations (28 gathers)"),
    "dlwp": ZooModel("dlwp", dlwp, dims=(3, 4), split=(5, 3), outcome="refused",
                     note="torch.cat: the cubed-sphere padding concatenates a neighbour face's edge rows along the "
                     "sharded dim (pieces split differently)"),
    "one2many_rnn": ZooModel("rnn", one2many_rnn, dims=(3, 4), split=(10, 6), split_2d=((10, 6), (8, 4))),
    "seq2seq_rnn": ZooModel("rnn", seq2seq_rnn, dims=(3, 4), split=(10, 6), split_2d=((10, 6), (8, 4))),
    "fno2d": ZooModel("fno", fno2d, dims=(2, 3), split=(9, 8), split_2d=((9, 8), (7, 5)), placements_2d=None,
                      note=_W_GATHERED),
    "fno3d": ZooModel("fno", fno3d, dims=(2, 3), split=(5, 4), split_2d=((5, 4), (4, 2)), placements_2d=None,
                      note=_W_GATHERED),
    "afno": ZooModel("afno", afno, dims=(2, 3), split=(12, 20), split_2d=((12, 20), (8, 8)), placements_2d=None,
                     note=_W_GATHERED),
    "unet3d": ZooModel("unet", unet3d, dims=(2, 3), split=(12, 4), split_2d=((12, 4), (4, 4))),
    "pix2pix": ZooModel("pix2pix", pix2pix, dims=(2, 3), split=(13, 11), split_2d=((13, 11), (11, 9))),
    "srrn": ZooModel("srrn", srrn, dims=(2, 3), split=(6, 4), split_2d=((5, 5), (4, 3))),
    "dit": ZooModel("dit", dit, dims=(2, 3), split=(6, 2), split_2d=((6, 2), (4, 4)), placements_2d=None,
                    note=_W_GATHERED),
    "transolver": ZooModel("transolver", transolver, dims=(1,), split=(9, 7), sharded=(0, 1)),
    "geotransolver": ZooModel("geotransolver", geotransolver, dims=(1,), split=(9, 7), sharded=(0, 3), params="plain",
                              note="DDP parameters: with distribute_module's, the replicated global vector meets "
                              "a DTensor weight in aten.addmm (DTensor refuses mixed Tensor/DTensor)"),
    "flare": ZooModel("flare", flare, dims=(1,), split=(9, 7), sharded=(0, 1)),
    # HEALPix pixels split along H of every face: the neighbour-face padding rotates faces
    "healpix_unet": ZooModel(
        "dlwp_healpix", healpix_unet, dims=(4, 5), split=(5, 3), outcome="refused",
        note="torch.Tensor.rot90: HEALPixPadding rotates a neighbour face (t.rot90(1, (-2, -1))) and the DTensor "
        "fallback sizes the result as even chunks; split the faces instead (healpix_unet_faces)"),
    # the 12 faces split 7/5 (faces fold into the batch dim)
    "healpix_unet_faces": ZooModel(
        "dlwp_healpix", healpix_unet, dims=(1,), split=(7, 5), expected_placements=None,
        note="faces split: the padding's per-face torch.split/indexing gathers the faces, output comes back "
        "Replicate"),
    "figconvunet": ZooModel(
        "figconvnet", figconvunet, dims=(1,), split=(37, 27), expected_placements=None, outcome="refused",
        note="physicsnemo.models.figconvnet.warp_neighbor_search.batched_radius_search_warp: its warp radius "
        "search reads the points' memory directly (wp.from_torch), which no shard patch sees; it crashed both ranks "
        "(SIGSEGV) until the figconvnet plugin refused it by name"),
    "domino_volume": ZooModel(
        "domino", domino_volume, dims=(1,), split=(7, 5), sharded=(0, 1, 2, 3), params="plain",
        outcome="not domain-parallel",
        note="the volume solution samples random sphere points around every point in each forward "
        "(sample_sphere: randn_like/rand_like), so no sharded run can equal single-process; its ball query "
        "runs sharded through PhysicsNeMo's radius-search wrapper. Not run by the tests"),
    # HEALPix pixels (XY order, face-major) split on face boundaries: 7 and 5 faces of 2x2 pixels
    "healda": ZooModel("healda", healda, dims=(3,), split=(28, 20), params="plain",
                       note="observations replicated (scattered onto all pixels on every rank); DDP parameters: "
                       "with distribute_module's, aten.embedding meets the plain obs_type indices"),
    # the same with a split inside a face (6.5 and 5.5 faces)
    "healda_unaligned": ZooModel("healda", healda, dims=(3,), split=(26, 22), params="plain",
                                 note="pixels split inside a face"),
}
