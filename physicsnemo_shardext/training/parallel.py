"""Hybrid data x domain parallel training: the script-side steps around ShardTensor.

Ranks form a 2-D device mesh named ``("ddp", "domain")``. Each *domain group*
(the ranks of one row of the mesh) works on **one sample** of the global batch,
split spatially over its ranks; the ``ddp`` axis averages gradients across the
groups, as data parallelism does. This module holds the steps a training script
takes around the model:

* `factorize` and `build_layout`: the mesh (both axes always present, even of size 1);
* `scatter_input` (``Shard(dim)`` over the domain mesh) and `scatter_target`
  (``Replicate``): this group's sample of a global batch;
* `broadcast_parameters`: plain parameters and buffers made equal within each
  domain group (from its domain rank 0);
* `wrap_model`: nothing, DDP on the ``ddp`` process group, or FSDP2
  (``fully_shard`` on the ``ddp`` mesh), optionally with spatial parameters
  (e.g. AFNO's ``pos_embed``) distributed ``Shard(dim)`` over the domain mesh;
* `param_groups`: optimizer groups split by device mesh (foreach kernels cannot mix meshes);
* `ddp_mean`: a scalar averaged over the ``ddp`` axis, for logging;
* `save_checkpoint` / `load_checkpoint`: a plain state-dict file (no wrapper, DDP)
  or a ``torch.distributed.checkpoint`` directory (FSDP2, any DTensor parameter).

Parameters stay plain tensors on the domain axis: when a plain weight meets a
sharded activation, ShardTensor promotes it, and its gradient comes back already
reduced over the domain mesh. Do not use ``distribute_module`` for them.

Examples:
    The pure helper runs anywhere:

    >>> factorize(8, ddp=2), factorize(8, domain=2), factorize(6)
    ((2, 4), (4, 2), (1, 6))

    Under ``torchrun --nproc-per-node 4 train.py``:

    ```python
    import physicsnemo_shardext
    from physicsnemo_shardext.training.parallel import build_layout, scatter_input, scatter_target, wrap_model

    physicsnemo_shardext.initialize()
    layout = build_layout(ddp=2)                       # 2 x 2 mesh
    model = wrap_model(make_model(), layout, "ddp")
    optimizer = torch.optim.AdamW(param_groups(model, lr=1e-3))
    for x, y in loader:                                # global batches of 2 samples, same on every rank
        loss = F.mse_loss(model(scatter_input(x, layout, dim=2)), scatter_target(y, layout))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(ddp_mean(loss, layout))
    ```
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from physicsnemo_shardext.primitives.layout import build_shard_tensor

__all__ = [
    "WRAPPERS",
    "ParallelLayout",
    "broadcast_parameters",
    "build_layout",
    "chunk_sizes",
    "ddp_mean",
    "factorize",
    "load_checkpoint",
    "param_groups",
    "save_checkpoint",
    "scatter_input",
    "scatter_target",
    "shard_spatial_parameters",
    "unwrap_model",
    "wrap_model",
]

#: The wrappers `wrap_model` knows.
WRAPPERS = ("none", "ddp", "fsdp2")

#: The mesh dim names of every layout.
MESH_DIM_NAMES = ("ddp", "domain")


@dataclass(frozen=True)
class ParallelLayout:
    """A 2-D ``("ddp", "domain")`` device mesh and its axis sizes.

    Attributes:
        mesh: the 2-D mesh; both dims exist even when one has size 1.
        ddp_size: number of domain groups (samples per global batch).
        domain_size: ranks per domain group (spatial shards of one sample).

    Examples:
        On 4 ranks (``build_layout(ddp=2)``), global rank 3 sits at ``(1, 1)``:

        ```python
        layout = build_layout(ddp=2)
        assert (layout.ddp_rank, layout.domain_rank, layout.domain_source_rank) == (1, 1, 2)
        ```
    """

    mesh: DeviceMesh
    ddp_size: int
    domain_size: int

    @property
    def ddp_mesh(self) -> DeviceMesh:
        """The 1-D mesh along ``ddp``: this rank and its peers at the same domain rank."""
        return self.mesh["ddp"]

    @property
    def domain_mesh(self) -> DeviceMesh:
        """The 1-D mesh along ``domain``: this rank's domain group."""
        return self.mesh["domain"]

    @property
    def ddp_rank(self) -> int:
        """This rank's coordinate along ``ddp`` (which sample of the global batch it works on)."""
        return int(self.mesh.get_local_rank("ddp"))

    @property
    def domain_rank(self) -> int:
        """This rank's coordinate along ``domain`` (which spatial shard it holds)."""
        return int(self.mesh.get_local_rank("domain"))

    @property
    def domain_source_rank(self) -> int:
        """The *global* rank of domain rank 0 in this rank's domain group."""
        return int(self.mesh.mesh[self.ddp_rank, 0].item())

    @property
    def world_size(self) -> int:
        """``ddp_size * domain_size``."""
        return self.ddp_size * self.domain_size


def factorize(world_size: int, ddp: int | None = None, domain: int | None = None) -> tuple[int, int]:
    """Return ``(ddp, domain)`` with ``ddp * domain == world_size``, inferring a missing axis.

    Args:
        world_size: the number of ranks.
        ddp: size of the ``ddp`` axis; ``None`` or ``-1`` to infer it.
        domain: size of the ``domain`` axis; ``None`` or ``-1`` to infer it.

    Returns:
        ``(ddp, domain)``. With both axes missing: ``(1, world_size)`` (pure domain parallelism).

    Raises:
        ValueError: a size is not positive, does not divide ``world_size``, or the
            product of the two given sizes is not ``world_size``.

    Examples:
        >>> factorize(4), factorize(4, ddp=2), factorize(4, domain=-1, ddp=4), factorize(4, 1, 4)
        ((1, 4), (2, 2), (4, 1), (1, 4))
        >>> factorize(6, ddp=4)
        Traceback (most recent call last):
        ...
        ValueError: cannot split 6 ranks with ddp 4: 4 does not divide 6
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    given = {"ddp": None if ddp in (None, -1) else ddp, "domain": None if domain in (None, -1) else domain}
    for name, size in given.items():
        if size is not None and size <= 0:
            raise ValueError(f"{name} must be positive (or -1/None to infer it), got {size}")
    d, m = given["ddp"], given["domain"]
    if d is None and m is None:
        return 1, world_size
    if d is not None and m is not None:
        if d * m != world_size:
            raise ValueError(f"cannot split {world_size} ranks as ddp {d} x domain {m}: the product is {d * m}")
        return d, m
    known_name, known = ("ddp", d) if d is not None else ("domain", m)
    assert known is not None
    if world_size % known:
        raise ValueError(
            f"cannot split {world_size} ranks with {known_name} {known}: {known} does not divide {world_size}"
        )
    return (known, world_size // known) if known_name == "ddp" else (world_size // known, known)


def build_layout(
    ddp: int | None = None, domain: int | None = None, *, device_type: str | None = None
) -> ParallelLayout:
    """Build the ``("ddp", "domain")`` mesh over all ranks.

    ``torch.distributed`` must be initialized (``physicsnemo_shardext.initialize()``).
    Global ranks are laid out row-major: domain groups are runs of consecutive
    ranks (``[0, 1], [2, 3]`` for ``2 x 2``), so a domain group stays within a node
    when ``domain`` divides the ranks per node. Collective: every rank must call it.

    Args:
        ddp: size of the ``ddp`` axis (``None``/``-1``: inferred).
        domain: size of the ``domain`` axis (``None``/``-1``: inferred).
        device_type: the mesh's device type; by default ``"cuda"`` when the default
            process group is NCCL, else ``"cpu"``.

    Returns:
        The layout.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        ValueError: the sizes do not factor the world size (see `factorize`).

    Examples:
        ```python
        layout = build_layout(domain=2)        # on 8 ranks: 4 x 2
        layout.mesh.mesh_dim_names             # ('ddp', 'domain')
        ```
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_layout needs torch.distributed initialized: call physicsnemo_shardext.initialize()")
    ddp_size, domain_size = factorize(dist.get_world_size(), ddp, domain)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (ddp_size, domain_size), mesh_dim_names=MESH_DIM_NAMES)
    return ParallelLayout(mesh=mesh, ddp_size=ddp_size, domain_size=domain_size)


def chunk_sizes(size: int, parts: int) -> list[int]:
    """Rows per part when ``size`` rows are split like ``torch.chunk`` (and DTensor's ``Shard``).

    Trailing parts may be empty.

    Examples:
        >>> chunk_sizes(17, 2), chunk_sizes(5, 4), chunk_sizes(0, 2)
        ([9, 8], [2, 2, 1, 0], [0, 0])
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    step = -(-size // parts) if size else 0
    sizes = []
    remaining = size
    for _ in range(parts):
        take = min(step, remaining)
        sizes.append(take)
        remaining -= take
    return sizes


def _check_batch(batch: torch.Tensor, layout: ParallelLayout, what: str) -> None:
    if batch.ndim == 0 or batch.shape[0] != layout.ddp_size:
        got = "a 0-d tensor" if batch.ndim == 0 else f"batch size {batch.shape[0]}"
        raise ValueError(
            f"{what}: got {got}, but the layout has ddp size {layout.ddp_size}: a global batch holds "
            f"one sample per domain group, i.e. exactly {layout.ddp_size} sample(s) along dim 0 "
            "(use gradient accumulation for more samples per step)"
        )


def _group_sample(batch: torch.Tensor, layout: ParallelLayout, broadcast: bool) -> torch.Tensor:
    """This domain group's sample, shape ``(1, ...)``, detached, on the mesh's device."""
    sample = batch.detach()[layout.ddp_rank : layout.ddp_rank + 1]
    device_type = layout.mesh.device_type
    if sample.device.type != device_type:
        sample = sample.to(
            torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else device_type
        )
    if broadcast and layout.domain_size > 1:
        sample = sample.contiguous().clone()
        dist.broadcast(sample, src=layout.domain_source_rank, group=layout.domain_mesh.get_group())
    return sample


def scatter_input(
    batch: torch.Tensor,
    layout: ParallelLayout,
    dim: int,
    *,
    sizes: Sequence[int] | None = None,
    broadcast: bool = False,
    requires_grad: bool = False,
) -> Any:
    """This domain group's sample of a global batch, sharded ``Shard(dim)`` over the domain mesh.

    Args:
        batch: the global batch, ``ddp_size`` samples along dim 0, identical on every
            rank (e.g. from a seeded loader); with ``broadcast=True`` only the domain
            source rank's copy counts.
        layout: the parallel layout.
        dim: the tensor dim to shard (of the batch's shape; not 0, the batch dim).
        sizes: rows of ``dim`` per domain rank; default ``torch.chunk``-like
            (`chunk_sizes`, DTensor's ``Shard`` split; trailing ranks may hold none).
            Uneven and zero-size entries are allowed.
        broadcast: broadcast the sample from the domain source rank over the domain
            group first (one broadcast of one sample), when only that rank's batch is
            authoritative.
        requires_grad: make the result a leaf that requires grad.

    Returns:
        A ShardTensor of global shape ``(1, *batch.shape[1:])``; its local shard is a
        plain slice of the sample, with no autograd history.

    Raises:
        ValueError: ``batch.shape[0] != ddp_size`` (one sample per domain group), a bad
            ``dim``, or ``sizes`` that do not partition ``batch.shape[dim]``.

    Examples:
        ```python
        x = torch.randn(layout.ddp_size, 3, 17, 8)          # same on every rank
        xs = scatter_input(x, layout, dim=2, sizes=[10, 7]) # domain size 2
        assert xs.full_tensor().equal(x[layout.ddp_rank : layout.ddp_rank + 1])
        ```
    """
    _check_batch(batch, layout, "scatter_input")
    ndim = batch.ndim
    if not -ndim <= dim < ndim or dim % ndim == 0:
        raise ValueError(f"scatter_input: dim {dim} must name a non-batch dim of a {ndim}-d batch")
    dim %= ndim
    length = batch.shape[dim]
    rows = chunk_sizes(length, layout.domain_size) if sizes is None else [int(s) for s in sizes]
    if len(rows) != layout.domain_size or sum(rows) != length or min(rows) < 0:
        raise ValueError(
            f"scatter_input: sizes {rows} do not split dim {dim} of size {length} over {layout.domain_size} domain ranks"
        )
    sample = _group_sample(batch, layout, broadcast)
    start = sum(rows[: layout.domain_rank])
    local = sample.narrow(dim, start, rows[layout.domain_rank]).contiguous()
    if requires_grad:
        local = local.clone().requires_grad_(True)
    result = build_shard_tensor(local, layout.domain_mesh, [Shard(dim)], {dim: rows})
    if requires_grad:
        result = result.detach().requires_grad_(True)
    return result


def scatter_target(batch: torch.Tensor, layout: ParallelLayout, *, broadcast: bool = False) -> Any:
    """This domain group's sample of a global batch, ``Replicate`` over the domain mesh.

    Args:
        batch: the global batch of targets, ``ddp_size`` samples along dim 0.
        layout: the parallel layout.
        broadcast: take the domain source rank's sample (see `scatter_input`).

    Returns:
        A ShardTensor of shape ``(1, *batch.shape[1:])``, each rank holding the whole sample.

    Raises:
        ValueError: ``batch.shape[0] != ddp_size``.

    Examples:
        ```python
        ys = scatter_target(y, layout)
        assert ys.to_local().equal(y[layout.ddp_rank : layout.ddp_rank + 1])
        ```
    """
    _check_batch(batch, layout, "scatter_target")
    local = _group_sample(batch, layout, broadcast).contiguous()
    return build_shard_tensor(local, layout.domain_mesh, [Replicate()], {})


def _plain_tensors(model: nn.Module) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for t in [*model.parameters(), *model.buffers()]:
        if not isinstance(t, DTensor) and type(t).__name__ != "ShardTensor":
            tensors.append(t)
    return tensors


def broadcast_parameters(model: nn.Module, layout: ParallelLayout) -> None:
    """Copy plain parameters and buffers from the domain source rank to its domain group.

    DTensor parameters (already laid out over a mesh) are skipped. Collective over
    each domain group; a no-op when the domain axis has size 1.

    Examples:
        ```python
        torch.manual_seed(rank)            # ranks start different
        model = torch.nn.Linear(4, 4)
        broadcast_parameters(model, layout)
        # now equal within each domain group
        ```
    """
    if layout.domain_size == 1:
        return
    group = layout.domain_mesh.get_group()
    with torch.no_grad():
        for tensor in _plain_tensors(model):
            dist.broadcast(tensor.data, src=layout.domain_source_rank, group=group)


def shard_spatial_parameters(model: nn.Module, layout: ParallelLayout, names: Iterable[str], dim: int) -> list[str]:
    """Make the named parameters DTensors ``Shard(dim)`` over the domain mesh.

    For parameters with a spatial extent that meets the sharded activation
    elementwise (AFNO's ``pos_embed``), on the FSDP2 path (`wrap_model` calls it
    before ``fully_shard``). The tensor is made contiguous and split like
    ``torch.chunk``, which must match how the activation is split.

    Args:
        model: the module; parameters are replaced in place.
        layout: the parallel layout.
        names: exact dotted parameter names or ``fnmatch`` patterns (``"*.pos_embed"``).
        dim: the parameter dim to shard.

    Returns:
        The names of the parameters replaced, in the model's order (parameters that
        are already DTensors are left alone and not listed).

    Raises:
        KeyError: a name or pattern matches no parameter (the message lists them).

    Examples:
        ```python
        done = shard_spatial_parameters(model, layout, ["pos_embed"], dim=1)
        assert isinstance(model.pos_embed, DTensor)
        ```
    """
    patterns = list(names)
    parameters = dict(model.named_parameters())
    unknown = [p for p in patterns if p not in parameters and not fnmatch.filter(parameters, p)]
    if unknown:
        raise KeyError(f"no parameter matches {unknown}; the model's parameters are {sorted(parameters)}")
    selected = [n for n in parameters if any(n == p or fnmatch.fnmatchcase(n, p) for p in patterns)]
    done: list[str] = []
    for name in selected:
        param = parameters[name]
        if isinstance(param, DTensor):
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        sharded = distribute_tensor(param.data.contiguous(), layout.domain_mesh, [Shard(dim % param.ndim)])
        setattr(owner, leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
        done.append(name)
    return done


def wrap_model(
    model: nn.Module,
    layout: ParallelLayout,
    wrapper: str = "ddp",
    *,
    spatial_parameters: Iterable[str] = (),
    spatial_dim: int = 1,
) -> nn.Module:
    """Broadcast the parameters over the domain axis, then wrap for the ``ddp`` axis.

    * ``"none"``: the model itself (nothing averages gradients over ``ddp``; fine
      for ``ddp_size == 1`` or inference).
    * ``"ddp"``: ``DistributedDataParallel`` on the ``ddp`` process group
      (``device_ids`` set on CUDA); with ``ddp_size == 1`` the model itself.
    * ``"fsdp2"``: `shard_spatial_parameters`, then
      ``torch.distributed.fsdp.fully_shard(model, mesh=layout.ddp_mesh)`` (also
      for ``ddp_size == 1``); the model is changed in place and returned.

    Args:
        model: the module, on the mesh's device.
        layout: the parallel layout.
        wrapper: ``"none"``, ``"ddp"`` or ``"fsdp2"``.
        spatial_parameters: names/patterns for `shard_spatial_parameters` (FSDP2 only).
        spatial_dim: the dim they are sharded along.

    Returns:
        The module to train.

    Raises:
        ValueError: an unknown wrapper, or ``spatial_parameters`` with a wrapper other
            than ``"fsdp2"``: there they stay plain and are promoted by ShardTensor,
            so asking to shard them is a mistake this refuses to hide.

    Examples:
        ```python
        model = wrap_model(make_model(), layout, "fsdp2", spatial_parameters=["pos_embed"])
        ```
    """
    if wrapper not in WRAPPERS:
        raise ValueError(f"unknown wrapper {wrapper!r}; expected one of {WRAPPERS}")
    spatial = list(spatial_parameters)
    if spatial and wrapper != "fsdp2":
        raise ValueError(
            f"spatial_parameters={spatial} need wrapper='fsdp2'; with {wrapper!r} parameters stay plain "
            "(ShardTensor promotes them where they meet sharded activations): drop spatial_parameters"
        )
    broadcast_parameters(model, layout)
    if wrapper == "none":
        return model
    if wrapper == "ddp":
        if layout.ddp_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.cuda.current_device()] if layout.mesh.device_type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, process_group=layout.ddp_mesh.get_group())
    from torch.distributed.fsdp import fully_shard

    if spatial:
        shard_spatial_parameters(model, layout, spatial, spatial_dim)
    fully_shard(model, mesh=layout.ddp_mesh)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under DDP and ``torch.compile`` wrappers (FSDP2 wraps in place).

    Examples:
        >>> layer = torch.nn.Linear(2, 2)
        >>> unwrap_model(torch.compile(layer)) is layer
        True
    """
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, (OptimizedModule, DistributedDataParallel)):
        model = model._orig_mod if isinstance(model, OptimizedModule) else model.module
    return model


def param_groups(model: nn.Module, **options: Any) -> list[dict[str, Any]]:
    """Optimizer parameter groups, one per device mesh (plain parameters: one group).

    Optimizers' foreach kernels cannot mix DTensors of different meshes (or DTensors
    and plain tensors) in one group. ``options`` (``lr``, ``weight_decay``...) go into
    every group. Parameters that do not require grad are left out.

    Examples:
        >>> groups = param_groups(torch.nn.Linear(2, 3), lr=0.1)
        >>> [(len(g["params"]), g["lr"]) for g in groups]
        [(2, 0.1)]
    """
    meshes: list[DeviceMesh | None] = []
    members: list[list[nn.Parameter]] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        for index, known in enumerate(meshes):
            if known is mesh or (known is not None and mesh is not None and known == mesh):
                members[index].append(param)
                break
        else:
            meshes.append(mesh)
            members.append([param])
    return [{"params": params, **options} for params in members]


def _full_value(value: Any) -> torch.Tensor:
    if isinstance(value, DTensor) or type(value).__name__ == "ShardTensor":
        return value.full_tensor()  # type: ignore[no-any-return]
    return torch.as_tensor(value)


def ddp_mean(value: torch.Tensor | float, layout: ParallelLayout) -> float:
    """Average a scalar over the ``ddp`` axis (for logging a loss). Collective.

    A ShardTensor or DTensor (a loss computed on ShardTensors) is gathered first
    (``full_tensor()``); it is detached.

    Examples:
        ```python
        print(f"step {step}: loss {ddp_mean(loss, layout):.4e}")
        ```
    """
    with torch.no_grad():
        local = _full_value(value).detach()
        if local.numel() != 1:
            raise ValueError(f"ddp_mean needs a scalar, got shape {tuple(local.shape)}")
        device = torch.device("cuda", torch.cuda.current_device()) if layout.mesh.device_type == "cuda" else "cpu"
        total = local.reshape(1).to(device=device, dtype=torch.float64)
        if layout.ddp_size > 1:
            dist.all_reduce(total, group=layout.ddp_mesh.get_group())
        return float(total.item()) / layout.ddp_size


def _has_dtensor_parameters(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: ParallelLayout,
    *,
    step: int,
) -> None:
    """Save model, optimizer and step. Collective: every rank calls it.

    * Plain parameters (no wrapper, DDP): global rank 0 writes one ``torch.save``
      file at ``path`` with the unwrapped model's ``state_dict()`` (no ``module.``
      prefix), the optimizer's and the step.
    * DTensor parameters (FSDP2, spatial parameters): a ``torch.distributed.checkpoint``
      directory at ``path``, written by every rank, from
      ``torch.distributed.checkpoint.state_dict.get_state_dict``.

    Examples:
        ```python
        save_checkpoint("ckpt/step100", model, optimizer, layout, step=100)
        ```
    """
    del layout  # the whole world takes part either way; kept for a uniform signature
    target = os.fspath(path)
    if _has_dtensor_parameters(model):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save

        model_state, optim_state = get_state_dict(model, optimizer)
        save({"model": model_state, "optim": optim_state, "step": torch.tensor(step)}, checkpoint_id=target)
        return
    if dist.get_rank() == 0:
        parent = os.path.dirname(target)
        if parent:
            os.makedirs(parent, exist_ok=True)
        state = {"model": unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, target)
    dist.barrier()


def load_checkpoint(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, layout: ParallelLayout
) -> int:
    """Load what `save_checkpoint` wrote into ``model`` and ``optimizer``; return the step.

    The model must be built and wrapped as when it was saved (the same wrapper,
    layout and spatial parameters); the optimizer over the same `param_groups`.
    Every rank reads. Collective.

    Examples:
        ```python
        model = wrap_model(make_model(), layout, "fsdp2")
        optimizer = torch.optim.AdamW(param_groups(model, lr=1e-3))
        step = load_checkpoint("ckpt/step100", model, optimizer, layout) + 1
        ```
    """
    source = os.fspath(path)
    if _has_dtensor_parameters(model):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
        load(state, checkpoint_id=source)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return int(state["step"].item())
    device = torch.device("cuda", torch.cuda.current_device()) if layout.mesh.device_type == "cuda" else "cpu"
    saved = torch.load(source, map_location=device, weights_only=True)
    unwrap_model(model).load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"])
