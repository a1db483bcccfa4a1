"""A strong-scaling PROJECTION (a model, not a measurement) of domain-parallel training on 1 to 64 GPUs.

Step time and efficiency of PhysicsNeMo's FNO, Pix2Pix, 3-D UNet and timm's ViT
(the runner's configurations, ``models.build_model``) at 2048^2 and 4096^2 on
N = 1 ... 64 GPUs, from what was measured elsewhere:

* ``--measure`` (a few minutes on CPU): one training step (forward+backward) of
  each model, sharded over dim 2 on gloo CPU ranks (``--ranks``, default 2 and 4)
  at two small sizes (``--res``), after a warm-up step. Per rank: the collectives
  and the payload bytes it hands to them, by kind (``CommCounter``), and the
  ShardTensor ops of the step (top-level entries into
  ``ShardTensor.__torch_function__`` / ``__torch_dispatch__``: the calls that pay
  the host-side cost). ``--json`` writes it.
* Otherwise the projection, from such a measurement (``--from-json``) or from the
  one checked in below (``MEASURED``), and the single-GPU step times measured on
  an H100 (``H100``; ``docs/benchmarks.md``, "GPU host").

The model, per model, field and N (every assumption: ``docs/benchmarks.md``,
"Strong-scaling projection")::

    T(1) = T_compute                                    the plain model on one GPU
    T(N) = T_compute / N + T_host + T_comm(N)           N >= 2, nothing overlaps (the conservative case)
    T(N) = max(T_compute / N, T_host, T_comm(N))        N >= 2, everything overlaps (the optimistic bound)
    T_comm(N) = sum over the busiest rank's collectives of (alpha + wire bytes / bandwidth)
    E(N) = T(1) / (N * T(N))

Bytes and calls of each collective kind are carried from the measured sizes and
rank counts to the projected ones by a law (``LAWS``: a sum of terms in the
sharded side ``s`` and ``N``, their coefficients fitted to the measured points);
the law table printed first says how far each law is from every measured point.

Usage::

    python benchmarks/scaling_projection.py                                  # tables from the checked-in numbers
    python benchmarks/scaling_projection.py --plot docs/benchmarks           # and docs/benchmarks/scaling-projection.svg
    python benchmarks/scaling_projection.py --measure --json proj.json       # measure (CPU ranks, a few minutes)
    python benchmarks/scaling_projection.py --measure --ranks 8 --models fno,pix2pix,vit --json proj8.json
    python benchmarks/scaling_projection.py --from-json proj.json --from-json proj8.json
    python benchmarks/scaling_projection.py --measure --models fno --res 32 --ranks 2 --json /tmp/p.json  # quick
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the runner's modules, when run as a script
from _common import initialize, launch  # noqa: E402

MODELS = ("fno", "pix2pix", "unet", "vit")
GPUS = (1, 2, 4, 8, 16, 32, 64)
FIELDS = (2048, 4096)  # image sides; the UNet gets the cube of as many voxels

#: Single-GPU training steps (forward+backward, fp32, ms, median of 30): ``docs/benchmarks.md``, "GPU host",
#: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, PhysicsNeMo 2.2.2, commit b2a93b1, 6 Dec 2026,
#: ``benchmarks/dispatch_overhead.py --device cuda``. ``plain``: plain tensors; ``sharded``: a ShardTensor
#: on a one-rank mesh with this package (no collective: the difference is host-side time). Keys: side.
H100: dict[str, dict[str, dict[int, float]]] = {
    "fno": {"plain": {512: 6.62, 2048: 59.99}, "sharded": {512: 34.56, 2048: 82.24}},
    "pix2pix": {"plain": {512: 5.34, 2048: 69.02}, "sharded": {512: 32.03, 2048: 85.34}},
    "unet": {"plain": {64: 10.99, 256: 806.75}, "sharded": {64: 30.41, 256: 255.54}},  # cube sides
}

#: The ViT has no GPU measurement: its compute is estimated from FLOPs (``vit_flops``) at this share of
#: the H100 SXM's fp32 peak (67 TFLOPS, NVIDIA H100 datasheet; PyTorch runs fp32 matmuls without TF32 by default).
H100_FP32_FLOPS = 67e12
VIT_FLOP_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Link:
    """A fabric as the model sees it: a fixed latency per collective call and a per-GPU bandwidth per direction."""

    name: str
    alpha_s: float
    bytes_per_s: float


#: NVLink 4 (H100 SXM): 900 GB/s per GPU in total, i.e. 450 GB/s per direction, among the 8 GPUs of an HGX
#: board (NVIDIA H100 datasheet). InfiniBand NDR: 400 Gb/s = 50 GB/s per GPU (one ConnectX-7 per GPU, as in
#: a DGX H100). alpha: assumed NCCL small-message latencies, 10 us inside a node, 20 us across nodes.
NVLINK = Link("NVLink", 10e-6, 450e9)
INFINIBAND = Link("InfiniBand NDR", 20e-6, 50e9)
GPUS_PER_NODE = 8

#: Fabric variants: which link a step on N GPUs pays (beyond one node, every rank's slowest link is IB).
FABRICS: dict[str, Callable[[int], Link]] = {
    "NVLink (IB beyond 8)": lambda n: NVLINK if n <= GPUS_PER_NODE else INFINIBAND,
    "IB only": lambda n: INFINIBAND,
}

#: Bytes on the wire per byte a rank hands to the collective (``CommCounter``'s payload), per kind.
WIRE: dict[str, Callable[[int], float]] = {
    "allreduce_": lambda n: 2 * (n - 1) / n,  # ring all-reduce: reduce-scatter + all-gather
    "alltoall_base_": lambda n: 1.0,  # measured payloads are what leaves the rank (no block to itself)
    "alltoall_": lambda n: 1.0,
    "_allgather_base_": lambda n: n - 1.0,  # ring all-gather: every other rank's block passes through
    "allgather_": lambda n: n - 1.0,
    "_reduce_scatter_base_": lambda n: (n - 1) / n,
    "reduce_scatter_": lambda n: (n - 1) / n,
    "broadcast_": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv_": lambda n: 0.0,  # the matching send is counted on the other rank
}

#: Terms of the laws: ``s`` is the measured input's side along the sharded dim (the image side; the UNet's cube side).
TERMS: dict[str, Callable[[float, int], float]] = {
    "1": lambda s, n: 1.0,
    "s^2": lambda s, n: s * s,
    "s nb": lambda s, n: s * min(n - 1, 2),  # a halo row ~ s to each of at most 2 neighbours
    "s^2 nb": lambda s, n: s * s * min(n - 1, 2),  # a halo plane of a cube ~ s^2, to at most 2 neighbours
    "s^2 (N-1)/N^2": lambda s, n: s * s * (n - 1) / n**2,  # the off-rank part of a 1/N block of s^2
    "s^2 (N-1)/N": lambda s, n: s * s * (n - 1) / n,  # the off-rank part of a block that does not shrink with N
    "(N-1)/N": lambda s, n: (n - 1) / n,  # ring: K/V blocks of T/N tokens, N-1 hops
    "(N-1) max(1,8/N)": lambda s, n: (n - 1) * max(1.0, 8 / n),  # ring hops x messages per hop (2 MiB/N, <= 256 KiB)
}

#: Per model and collective kind: the terms of (bytes, calls) per step at the busiest rank.
LAWS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    # spectral conv: H-shards -> frequency shards of the 1/N block, and back, where the zero-padded spectrum
    # (everything above the kept modes) sits on the last rank: that rank's share does not shrink with N
    "fno": {"alltoall_base_": (("s^2 (N-1)/N^2", "s^2 (N-1)/N"), ("1",)), "allreduce_": (("1",), ("1",))},
    # convolutions: halo rows to the neighbours; batch-norm statistics and weight gradients: all-reduces
    "pix2pix": {"alltoall_base_": (("s nb",), ("1",)), "allreduce_": (("1",), ("1",))},
    # 3-D convolutions: halo planes; group-norm statistics and weight gradients: all-reduces
    "unet": {"alltoall_base_": (("s^2 nb",), ("1",)), "allreduce_": (("1",), ("1",))},
    # ring attention over 1024 tokens (at every size: patch = side/32); the patch embedding's weight ~ patch^2 ~ s^2
    "vit": {"alltoall_base_": (("(N-1)/N",), ("1", "(N-1) max(1,8/N)")), "allreduce_": (("1", "s^2"), ("1",))},
}

#: The checked-in measurement (``--measure``; x86_64, 2 CPU cores, gloo, torch 2.14.1+cu130, PhysicsNeMo 2.2.2,
#: 7 Dec 2026: ``--res 256,512 --ranks 2,4`` for all four models, then ``--ranks 8`` for fno, vit (256, 512),
#: pix2pix (256, 512) and unet (``--res 512``)). ``ops``: ShardTensor ops per step (the same at every size and N).
#: ``points``: per model ``[side, N, {kind: [calls, bytes]}]``, per training step at the busiest rank (each
#: number the largest over the ranks); ``side`` is the input's side along the sharded dim (UNet: the cube's).
MEASURED: dict[str, Any] = {
    "source": "checked-in: 2-core x86_64 CPU, gloo, torch 2.14.1+cu130, PhysicsNeMo 2.2.2, 2026-12-07",
    "ops": {"fno": 108, "pix2pix": 43, "unet": 39, "vit": 87},
    "points": {
        "fno": [
            [256, 2, {"allreduce_": [22, 16800836], "alltoall_base_": [16, 35545088]}],
            [256, 4, {"allreduce_": [22, 16800836], "alltoall_base_": [16, 38043648]}],
            [256, 8, {"allreduce_": [22, 16800836], "alltoall_base_": [16, 35954688]}],
            [512, 2, {"allreduce_": [22, 16800836], "alltoall_base_": [16, 138043392]}],
            [512, 4, {"allreduce_": [22, 16800836], "alltoall_base_": [16, 151420928]}],
            [512, 8, {"allreduce_": [22, 16800836], "alltoall_base_": [16, 145137664]}],
        ],
        "pix2pix": [
            [256, 2, {"allreduce_": [47, 3125764], "alltoall_base_": [20, 608912]}],
            [256, 4, {"allreduce_": [47, 3125764], "alltoall_base_": [20, 1217824]}],
            [256, 8, {"allreduce_": [47, 3125764], "alltoall_base_": [20, 1217824]}],
            [512, 2, {"allreduce_": [47, 3125764], "alltoall_base_": [20, 1204880]}],
            [512, 4, {"allreduce_": [47, 3125764], "alltoall_base_": [20, 2409760]}],
            [512, 8, {"allreduce_": [47, 3125764], "alltoall_base_": [20, 2409760]}],
        ],
        "unet": [
            [32, 2, {"allreduce_": [66, 494756], "alltoall_base_": [26, 630784]}],
            [32, 4, {"allreduce_": [66, 494756], "alltoall_base_": [26, 1261568]}],
            [64, 2, {"allreduce_": [66, 494756], "alltoall_base_": [26, 2523136]}],
            [64, 4, {"allreduce_": [66, 494756], "alltoall_base_": [26, 5046272]}],
            [64, 8, {"allreduce_": [66, 494756], "alltoall_base_": [26, 5046272]}],
        ],
        "vit": [
            [256, 2, {"allreduce_": [52, 9680896], "alltoall_base_": [36, 12582912]}],
            [256, 4, {"allreduce_": [52, 9680896], "alltoall_base_": [52, 18874368]}],
            [256, 8, {"allreduce_": [52, 9680896], "alltoall_base_": [60, 22020096]}],
            [512, 2, {"allreduce_": [52, 10270720], "alltoall_base_": [36, 12582912]}],
            [512, 4, {"allreduce_": [52, 10270720], "alltoall_base_": [52, 18874368]}],
            [512, 8, {"allreduce_": [52, 10270720], "alltoall_base_": [60, 22020096]}],
        ],
    },
}


# -- measuring on CPU ranks ---------------------------------------------------------------------
@contextlib.contextmanager
def counted_dispatches() -> Iterator[dict[str, int]]:
    """Count top-level entries into ``ShardTensor.__torch_function__`` and ``__torch_dispatch__`` in the block.

    Entries from inside another (a handler's own ShardTensor calls, a fallback's redistribution)
    are not counted: a count is one op of the model, or one aten op of its backward, on a ShardTensor.
    """
    from physicsnemo.domain_parallel import ShardTensor

    counts = {"function": 0, "dispatch": 0}
    depth = [0]
    saved = {name: ShardTensor.__dict__[name] for name in ("__torch_function__", "__torch_dispatch__")}

    def counting(name: str, key: str) -> classmethod:
        inner = saved[name].__func__

        def hook(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if depth[0] == 0:
                counts[key] += 1
            depth[0] += 1
            try:
                return inner(cls, func, types, args, kwargs)
            finally:
                depth[0] -= 1

        return classmethod(hook)

    ShardTensor.__torch_function__ = counting("__torch_function__", "function")
    ShardTensor.__torch_dispatch__ = counting("__torch_dispatch__", "dispatch")
    try:
        yield counts
    finally:
        for name, value in saved.items():
            setattr(ShardTensor, name, value)


def _by_kind(calls: list[tuple[str, int]]) -> dict[str, list[int]]:
    """``{collective kind: [calls, bytes]}`` of a ``CommCounter.calls`` list."""
    kinds: dict[str, list[int]] = {}
    for key, nbytes in calls:
        entry = kinds.setdefault(key.split(".", 1)[-1], [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    return kinds


def _count_step(name: str, res: int, mesh: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """One training step of ``name`` at ``res``, counted after a warm-up step: the run, and this rank's numbers."""
    from cases import randn
    from measure import cotangent_like
    from models import build_model
    from torch.distributed.tensor import Shard, distribute_module

    from physicsnemo_shardext.testing import CommCounter, shard_tensor

    model, full, config = build_model(name, res)
    model = distribute_module(model, mesh)
    x = shard_tensor(full, mesh, [Shard(2)], requires_grad=True)
    cotangent: list[Any] = [None]
    for _ in ("warm-up", "counted"):
        x.grad = None
        model.zero_grad(set_to_none=True)
        with counted_dispatches() as ops_forward, CommCounter() as forward:
            out = model(x)
        if cotangent[0] is None:
            cotangent[0] = cotangent_like(out, randn(*out.shape, seed=7))
        with counted_dispatches() as ops_backward, CommCounter() as backward:
            out.backward(cotangent[0])
        del out
    run = {"model": name, "res": res, "config": config, "input_shape": list(full.shape)}
    mine = {
        "ops": {"forward": ops_forward, "backward": ops_backward},
        "forward": _by_kind(forward.calls),
        "backward": _by_kind(backward.calls),
    }
    return run, mine


def measure_world(args: argparse.Namespace) -> None:
    """Body of every rank of one world: each model at each ``--res``; rank 0 writes ``args.world_out``."""
    import torch
    import torch.distributed as dist

    import physicsnemo_shardext

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    manager = initialize(timeout_s=600)
    try:
        mesh = manager.initialize_mesh((-1,), ("domain",))
        counted = [_count_step(name, res, mesh) for name in args.model_list for res in args.res_list]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [mine for _, mine in counted])
        if dist.get_rank() == 0:
            runs = [
                {**run, "ranks": len(gathered), "per_rank": [of_rank[i] for of_rank in gathered]}
                for i, (run, _) in enumerate(counted)
            ]
            Path(args.world_out).write_text(json.dumps(runs))
    finally:
        physicsnemo_shardext.shutdown()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run a world per ``--ranks`` count; the measurement as JSON-ready dict."""
    import tempfile

    import physicsnemo
    import torch

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shardext-proj-") as tmp:
        for n in args.rank_list:
            args.world_out = str(Path(tmp) / f"world-{n}.json")
            print(f"measuring {', '.join(args.model_list)} at {args.res_list} on {n} ranks", file=sys.stderr)
            launch(measure_world, args, n)
            runs.extend(json.loads(Path(args.world_out).read_text()))
    return {
        "schema": 1,
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo",
        "torch": torch.__version__,
        "physicsnemo": getattr(physicsnemo, "__version__", "?"),
        "date": datetime.date.today().isoformat(),
        "runs": runs,
    }


# -- from a measurement to the laws -------------------------------------------------------------
def summarize(measurement: dict[str, Any]) -> dict[str, Any]:
    """A ``--measure`` JSON in ``MEASURED``'s form: per model and point, each kind's largest calls and bytes."""
    points: dict[str, list[list[Any]]] = {}
    ops: dict[str, int] = {}
    for run in measurement["runs"]:
        kinds: dict[str, list[int]] = {}
        for rank in run["per_rank"]:
            for kind in sorted(set(rank["forward"]) | set(rank["backward"])):
                calls = sum(rank[phase].get(kind, [0, 0])[0] for phase in ("forward", "backward"))
                nbytes = sum(rank[phase].get(kind, [0, 0])[1] for phase in ("forward", "backward"))
                entry = kinds.setdefault(kind, [0, 0])
                entry[0], entry[1] = max(entry[0], calls), max(entry[1], nbytes)
        points.setdefault(run["model"], []).append([run["input_shape"][2], run["ranks"], kinds])
        forward = run["per_rank"][0]["ops"]["forward"]
        ops[run["model"]] = forward["function"] + forward["dispatch"]
    return {
        "source": f"{measurement['machine']}, torch {measurement['torch']}, {measurement['date']}",
        "ops": ops,
        "points": points,
    }


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several summaries as one (a later point of the same model, side and N replaces an earlier one)."""
    merged: dict[str, Any] = {
        "source": "; ".join(dict.fromkeys(s["source"] for s in summaries)),
        "ops": {},
        "points": {},
    }
    for summary in summaries:
        merged["ops"].update(summary["ops"])
        for model, points in summary["points"].items():
            known = {(p[0], p[1]): p for p in merged["points"].get(model, [])}
            known.update({(p[0], p[1]): p for p in points})
            merged["points"][model] = sorted(known.values(), key=lambda p: (p[0], p[1]))
    return merged


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a few unknowns)."""
    size = len(vector)
    rows = [list(matrix[i]) + [vector[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if abs(rows[col][col]) <= 1e-9 * max(abs(v) for row in matrix for v in row):
            raise ValueError("singular fit: the measured points cannot tell the law's terms apart")
        for r in range(size):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][size] / rows[i][i] for i in range(size)]


def fit(terms: tuple[str, ...], samples: list[tuple[float, int, float]]) -> list[float]:
    """Coefficients of ``terms`` fitted to ``(side, N, value)`` samples, least squares in relative error.

    Where the samples cannot tell the terms apart (one size, or one rank count), the last terms get 0.
    """
    basis = [[TERMS[t](s, n) / max(value, 1.0) for t in terms] for s, n, value in samples]
    target = [value / max(value, 1.0) for _, _, value in samples]
    for used in range(len(terms), 0, -1):
        normal = [[sum(row[i] * row[j] for row in basis) for j in range(used)] for i in range(used)]
        moments = [sum(row[i] * y for row, y in zip(basis, target, strict=True)) for i in range(used)]
        with contextlib.suppress(ValueError):
            return _solve(normal, moments) + [0.0] * (len(terms) - used)
    return [0.0] * len(terms)


@dataclass
class Law:
    """One collective kind of one model: fitted bytes and calls per step at the busiest rank."""

    kind: str
    byte_terms: tuple[str, ...]
    bytes_coef: list[float]
    call_terms: tuple[str, ...]
    calls_coef: list[float]
    worst_bytes: float  # the largest relative error over the measured points
    worst_calls: float
    points: int

    def nbytes(self, side: float, n: int) -> float:
        return sum(c * TERMS[t](side, n) for c, t in zip(self.bytes_coef, self.byte_terms, strict=True))

    def calls(self, side: float, n: int) -> float:
        return sum(c * TERMS[t](side, n) for c, t in zip(self.calls_coef, self.call_terms, strict=True))


def fit_laws(measured: dict[str, Any]) -> dict[str, list[Law]]:
    """Per model, a `Law` per collective kind it issued (``LAWS``' terms fitted to every measured point)."""
    laws: dict[str, list[Law]] = {}
    for model, points in measured["points"].items():
        kinds = sorted({kind for _, _, per_kind in points for kind in per_kind})
        for kind in kinds:
            byte_terms, call_terms = LAWS.get(model, {}).get(kind, (("1",), ("1",)))
            by = [(s, n, float(k.get(kind, [0, 0])[1])) for s, n, k in points]
            calls = [(s, n, float(k.get(kind, [0, 0])[0])) for s, n, k in points]
            law = Law(kind, byte_terms, fit(byte_terms, by), call_terms, fit(call_terms, calls), 0.0, 0.0, len(by))
            law.worst_bytes = max(abs(law.nbytes(s, n) / max(v, 1.0) - v / max(v, 1.0)) for s, n, v in by)
            law.worst_calls = max(abs(law.calls(s, n) / max(v, 1.0) - v / max(v, 1.0)) for s, n, v in calls)
            laws.setdefault(model, []).append(law)
    return laws


# -- single-GPU inputs --------------------------------------------------------------------------
def side_of(model: str, field: int) -> float:
    """The projected input's side along the sharded dim: the image side, or the side of the UNet's cube."""
    return field ** (2 / 3) if model == "unet" else float(field)


def host_ms(model: str, ops: dict[str, int]) -> float:
    """Host-side time per step that does not shrink with N: one-rank sharded minus plain, kernels small."""
    if model == "vit":  # not measured: the ViT's ops at FNO's cost per op
        return ops["vit"] * host_ms("fno", ops) / ops.get("fno", MEASURED["ops"]["fno"])
    small = min(H100[model]["plain"])
    return H100[model]["sharded"][small] - H100[model]["plain"][small]


def vit_flops(field: int, tokens: int = 1024, width: int = 256, depth: int = 4, mlp: float = 2.0) -> float:
    """FLOPs of one ViT training step (3x the forward): patch embedding, per block 2 x params x tokens + attention."""
    patch = field // 32
    embed = 2 * tokens * 3 * patch * patch * width
    block = 2 * tokens * width * width * (4 + 2 * mlp) + 4 * tokens * tokens * width
    return 3 * (embed + depth * block)


def compute_ms(model: str, field: int, ops: dict[str, int]) -> float:
    """The single-GPU step's kernel time at ``field``: measured, scaled linearly with points (see the doc)."""
    if model == "vit":
        return vit_flops(field) / (VIT_FLOP_EFFICIENCY * H100_FP32_FLOPS) * 1e3
    if model == "unet":  # the sharded path's kernels (plain 256^3 is slowed by torch's group-norm kernel)
        kernels = H100["unet"]["sharded"][256] - host_ms("unet", ops)
        return kernels * (side_of("unet", field) / 256) ** 3
    return H100[model]["plain"][2048] * (field / 2048) ** 2


# -- the projection -----------------------------------------------------------------------------
@dataclass
class Row:
    """One model, field and GPU count: times in ms per step, efficiencies per fabric."""

    model: str
    field: int
    gpus: int
    compute: float  # T_compute / N
    host: float
    comm: dict[str, float]
    step: dict[str, float]  # no overlap
    efficiency: dict[str, float]
    overlapped: dict[str, float]  # efficiency, everything overlapped
    note: str = ""


def comm_ms(laws: list[Law], side: float, n: int, link: Link) -> float:
    """T_comm: every collective of the step at the busiest rank, alpha + wire bytes / bandwidth."""
    seconds = 0.0
    for law in laws:
        wire = WIRE.get(law.kind, lambda n: 1.0)(n)
        seconds += max(law.calls(side, n), 0.0) * link.alpha_s + wire * max(law.nbytes(side, n), 0.0) / link.bytes_per_s
    return seconds * 1e3


def project(measured: dict[str, Any], models: list[str]) -> list[Row]:
    """Every model, field and GPU count of the projection."""
    laws, ops, rows = fit_laws(measured), measured["ops"], []
    for model in models:
        for field in FIELDS:
            single = compute_ms(model, field, ops)
            side = side_of(model, field)
            for n in GPUS:
                if n == 1:
                    ones = dict.fromkeys(FABRICS, 1.0)
                    rows.append(
                        Row(
                            model,
                            field,
                            1,
                            single,
                            0.0,
                            dict.fromkeys(FABRICS, 0.0),
                            dict.fromkeys(FABRICS, single),
                            ones,
                            ones,
                        )
                    )
                    continue
                host = host_ms(model, ops)
                comm = {name: comm_ms(laws[model], side, n, link(n)) for name, link in FABRICS.items()}
                step = {name: single / n + host + c for name, c in comm.items()}
                best = {name: max(single / n, host, c) for name, c in comm.items()}
                note = "†" if model == "unet" and n > side / 8 else ""  # < 1 plane per rank after 3 poolings
                rows.append(
                    Row(
                        model,
                        field,
                        n,
                        single / n,
                        host,
                        comm,
                        step,
                        {k: single / (n * t) for k, t in step.items()},
                        {k: single / (n * t) for k, t in best.items()},
                        note,
                    )
                )
    return rows


# -- tables and the figure ----------------------------------------------------------------------
NAMES = {"fno": "FNO", "pix2pix": "Pix2Pix", "unet": "UNet 3-D", "vit": "ViT"}


def field_name(model: str, field: int) -> str:
    if model == "unet":
        return f"{side_of(model, field):.0f}^3 (= {field}^2 voxels)"
    return f"{field}^2"


def law_table(measured: dict[str, Any]) -> str:
    lines = [
        f"Laws fitted to the measured points ({measured['source']}); worst error: the largest relative "
        "difference between the law and a measured point",
        "",
        "| model | kind | bytes per step ~ | calls per step ~ | points | worst error, bytes | worst error, calls |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    fitted = fit_laws(measured)
    for model in sorted(fitted, key=lambda m: MODELS.index(m) if m in MODELS else len(MODELS)):
        for law in fitted[model]:
            terms = " + ".join(f"{c:.3g} {t}" for c, t in zip(law.bytes_coef, law.byte_terms, strict=True))
            calls = " + ".join(f"{c:.3g} {t}" for c, t in zip(law.calls_coef, law.call_terms, strict=True))
            lines.append(
                f"| {NAMES.get(model, model)} | {law.kind} | {terms} | {calls} | {law.points} "
                f"| {law.worst_bytes:.1%} | {law.worst_calls:.1%} |"
            )
    return "\n".join(lines)


def inputs_table(measured: dict[str, Any], models: list[str]) -> str:
    ops = measured["ops"]
    lines = [
        "| model | T_compute, 2048^2 (ms) | T_compute, 4096^2 (ms) | T_host (ms) | ShardTensor ops per step | host per op (us) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model in models:
        host = host_ms(model, ops)
        lines.append(
            f"| {NAMES[model]} | {compute_ms(model, 2048, ops):.2f} | {compute_ms(model, 4096, ops):.2f} "
            f"| {host:.2f} | {ops[model]} | {host / ops[model] * 1e3:.0f} |"
        )
    return "\n".join(lines)


def summary_table(rows: list[Row]) -> str:
    """Efficiency E(N) per model, field and fabric (no overlap), N across."""
    lines = [
        "| model | field | fabric | " + " | ".join(f"{n}" for n in GPUS) + " |",
        "|---|---|---|" + "---:|" * len(GPUS),
    ]
    keys = sorted({(r.model, r.field) for r in rows}, key=lambda k: (MODELS.index(k[0]), k[1]))
    for model, field in keys:
        mine = {r.gpus: r for r in rows if (r.model, r.field) == (model, field)}
        for fabric in FABRICS:
            cells = " | ".join(f"{mine[n].efficiency[fabric]:.2f}{mine[n].note}" for n in GPUS)
            lines.append(f"| {NAMES[model]} | {field_name(model, field)} | {fabric} | {cells} |")
    return "\n".join(lines)


def detail_table(rows: list[Row], model: str, field: int) -> str:
    """One model and field: the terms of T(N) and the efficiencies, N down."""
    nv, ib = list(FABRICS)
    lines = [
        f"{NAMES[model]} {field_name(model, field)} (ms per training step; PROJECTION)",
        "",
        "| GPUs | T_compute/N | T_host | T_comm, NVLink | T(N), NVLink | E, NVLink | E overlapped, NVLink "
        "| T_comm, IB | T(N), IB | E, IB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if (r.model, r.field) == (model, field)):
        lines.append(
            f"| {r.gpus}{r.note} | {r.compute:.2f} | {r.host:.2f} | {r.comm[nv]:.2f} | {r.step[nv]:.2f} "
            f"| {r.efficiency[nv]:.2f} | {r.overlapped[nv]:.2f} | {r.comm[ib]:.2f} | {r.step[ib]:.2f} "
            f"| {r.efficiency[ib]:.2f} |"
        )
    return "\n".join(lines)


#: Published figures put beside the projection (docs/benchmarks.md gives the sources and what each measures).
PEERS = (
    (8, 0.902, "peer: zigzag ring attention,\nattention op only, 8xH800", "center"),
    (128, 0.93, "peer: context-parallel\nprefill, 128 H100", "right"),
)


def write_plot(rows: list[Row], directory: Path) -> Path:
    """Efficiency against GPUs, one panel per field: solid NVLink (IB beyond 8), dashed IB only, dotted overlapped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "physicsnemo-shardext"  # stable ids: diffs show data changes only
    nv, ib = list(FABRICS)
    figure, axes = plt.subplots(1, len(FIELDS), figsize=(12, 6.2), sharey=True)
    for axis, field in zip(axes, FIELDS, strict=True):
        for index, model in enumerate(m for m in MODELS if any(r.model == m for r in rows)):
            mine = [r for r in rows if (r.model, r.field) == (model, field)]
            colour = f"C{index}"
            gpus = [r.gpus for r in mine]
            axis.plot(gpus, [r.efficiency[nv] for r in mine], "-o", color=colour, label=f"{NAMES[model]}, {nv}")
            axis.plot(gpus, [r.efficiency[ib] for r in mine], "--", color=colour, label=f"{NAMES[model]}, {ib}")
            axis.plot(gpus, [r.overlapped[nv] for r in mine], ":", color=colour, label=f"{NAMES[model]}, overlapped")
        for n, value, label, align in PEERS:
            axis.plot([n], [value], "k*", markersize=11)
            axis.annotate(label, (n, value), textcoords="offset points", xytext=(0, -22), ha=align, fontsize=7)
        axis.set_xscale("log", base=2)
        axis.set_xticks([*GPUS, 128], [str(n) for n in (*GPUS, 128)])
        axis.set_ylim(0, 1.05)
        axis.set_xlabel("GPUs")
        axis.set_title(f"{field}^2 (UNet: {side_of('unet', field):.0f}^3)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("efficiency T(1) / (N T(N))")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=7, ncol=4, loc="lower center")
    figure.suptitle(
        "PROJECTION, not a measurement: strong scaling of domain-parallel training (model and inputs: docs)"
    )
    figure.tight_layout(rect=(0, 0.13, 1, 1))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "scaling-projection.svg"
    figure.savefig(path)
    plt.close(figure)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure bytes, collectives and ops on CPU ranks")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated ({', '.join(MODELS)})")
    parser.add_argument("--res", default="256,512", help="--measure: image sides (UNet: a cube of side res/8)")
    parser.add_argument("--ranks", default="2,4", help="--measure: rank counts")
    parser.add_argument("--json", default=None, help="--measure: write the measurement to this file")
    parser.add_argument(
        "--from-json", action="append", default=[], metavar="FILE", help="project from this measurement (repeatable)"
    )
    parser.add_argument("--plot", default=None, metavar="DIR", help="write DIR/scaling-projection.svg (matplotlib)")
    args = parser.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.model_list) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    args.res_list = [int(r) for r in args.res.split(",")]
    args.rank_list = sorted({int(n) for n in args.ranks.split(",")})
    if any(n < 2 for n in args.rank_list):
        parser.error("--ranks: at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure:
        measurement = measure(args)
        if args.json:
            Path(args.json).write_text(json.dumps(measurement, indent=1) + "\n")
        measured = summarize(measurement)
    elif args.from_json:
        measured = merge([summarize(json.loads(Path(f).read_text())) for f in args.from_json])
    else:
        measured = MEASURED
    models = [m for m in args.model_list if m in measured["points"]]
    print(law_table(measured) + "\n")
    print("PROJECTION, not a measurement: T(N) = T_compute/N + T_host + T_comm(N), E(N) = T(1) / (N T(N))\n")
    print(inputs_table(measured, models) + "\n")
    rows = project(measured, models)
    print("Efficiency E(N), no overlap (†: fewer planes than ranks at the UNet's deepest level)\n")
    print(summary_table(rows) + "\n")
    for model in models:
        for field in FIELDS:
            print(detail_table(rows, model, field) + "\n")
    if args.plot:
        print(f"wrote {write_plot(rows, Path(args.plot))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
