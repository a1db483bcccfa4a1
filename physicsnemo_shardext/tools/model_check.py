"""Run a user's model sharded and single-process on every rank, and report op by op (`shardext verify`).

`check_model` is what each rank runs. From one seed it builds the model (a
*factory* ``module:function`` or ``path/to/file.py:function`` that returns the
model, or the model and its inputs), then

1. the **reference**: a copy of the model on the full input in this process,
   a loss (``mse`` against a seeded random target, or ``sum``), backward;
2. the **sharded run**: another copy on the input split over the mesh
   (`shard_tensor`, even, uneven or given sizes), the same loss on a target
   sharded like the output, backward, all under an `OpTracer` that records
   every op's handler, placements, collectives and gathers;
3. the **comparison**: the loss, every output, the input gradient and every
   parameter gradient against the reference, by the one rule of
   `physicsnemo_shardext.comparison` (``|a - r| <= atol + rtol * |r|`` per
   element; max abs error and relative error ``max|a - r| / max(max|r|, atol)``
   reported), mismatches first, then worst relative error first.

Rank 0 gathers every rank's record and builds the report: a JSON-ready
``dict`` whose schema is `REPORT_SCHEMA` version `REPORT_VERSION` (documented in
``docs/reference/cli.md``). Its ``status`` and ``exit_code``: ``match`` (0),
``mismatch`` (1), ``unsupported`` (2: an op raised in the sharded run, e.g.
``MissingShardPatch``), ``bad-input`` (3: the factory, the input or the
reference run failed).

Examples:
    Split sizes for one dim:

    >>> split_sizes(17, 2, "even"), split_sizes(17, 2, "uneven"), split_sizes(17, 2, "5,12")
    ([9, 8], [11, 6], [5, 12])
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_leaves

from physicsnemo_shardext.comparison import RULE, Tolerance, compare, exact_float32
from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.testing.model_init import without_random_masks
from physicsnemo_shardext.tools.op_trace import (
    IGNORED_CALLS,
    CallSite,
    OpSite,
    OpTracer,
    find_call_site,
    registry_provider,
)

__all__ = [
    "REPORT_SCHEMA",
    "REPORT_VERSION",
    "BadInput",
    "VerifyConfig",
    "check_model",
    "load_factory",
    "split_sizes",
]

REPORT_SCHEMA = "physicsnemo-shardext/verify"
REPORT_VERSION = 1

EXIT_CODES = {"match": 0, "mismatch": 1, "unsupported": 2, "bad-input": 3}


class BadInput(ValueError):
    """The command's input cannot be run: factory, shape, split or the single-process reference."""


@dataclass(frozen=True)
class VerifyConfig:
    """What `shardext verify` was asked to run (every field is JSON-serialisable)."""

    factory: str
    input_shape: tuple[int, ...] | None = None
    shard_dims: tuple[int, ...] = (2,)
    ranks: int = 2
    mesh: tuple[int, ...] = (2,)
    split: str = "uneven"
    dtype: str = "float32"
    train: bool = True
    loss: str = "mse"
    rtol: float | None = None
    atol: float | None = None
    seed: int = 1234
    plugins: tuple[str, ...] = ()
    progress_path: str | None = None

    @property
    def tolerance(self) -> Tolerance:
        """The `Tolerance` of every compared tensor: ``rtol``/``atol`` as given, else the dtype's default.

        Examples:
            >>> VerifyConfig("m:f", dtype="bfloat16", rtol=0.1).tolerance
            Tolerance(rtol=0.1, atol=0.02)
        """
        default = Tolerance.for_dtype(self.dtype)
        return Tolerance(
            default.rtol if self.rtol is None else self.rtol, default.atol if self.atol is None else self.atol
        )


def split_sizes(length: int, parts: int, split: str) -> list[int]:
    """Rows per rank for one dim: ``even`` (as ``torch.chunk``), ``uneven`` or explicit ``"a,b,..."``.

    ``uneven`` moves about a quarter of a shard from the last rank to the first,
    so every rank holds a different number of rows where the length allows.

    Examples:
        >>> split_sizes(64, 4, "uneven"), split_sizes(8, 4, "even")
        ([20, 16, 16, 12], [2, 2, 2, 2])
    """
    if parts > length:
        raise BadInput(f"{parts} ranks along a dim of {length} rows: more ranks than rows")
    if split == "even":
        chunk = -(-length // parts)
        sizes = [min(chunk, max(length - i * chunk, 0)) for i in range(parts)]
        if 0 in sizes:  # torch.chunk would give fewer pieces: spread instead
            sizes = [length // parts + (1 if i < length % parts else 0) for i in range(parts)]
        return sizes
    if split == "uneven":
        base = [length // parts + (1 if i < length % parts else 0) for i in range(parts)]
        if parts > 1:
            move = max(1, base[-1] // 4) if base[-1] > 1 else 0
            if move == 0:
                raise BadInput(f"{length} rows over {parts} ranks is too few for an uneven split; use --split even")
            base[0] += move
            base[-1] -= move
        return base
    try:
        sizes = [int(part) for part in split.split(",")]
    except ValueError:
        raise BadInput(f"--split {split!r}: expected even, uneven or comma-separated sizes like 10,7") from None
    if len(sizes) != parts or sum(sizes) != length or min(sizes) < 0:
        raise BadInput(f"--split {split}: needs {parts} non-negative sizes summing to {length}, got {sizes}")
    return sizes


def load_factory(spec: str) -> Callable[[], Any]:
    """Import ``module:attr`` or ``path/to/file.py:attr`` and return the callable (BadInput if it cannot).

    Examples:
        >>> load_factory("torch.nn:Identity")
        <class 'torch.nn.modules.linear.Identity'>
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise BadInput(f"factory {spec!r}: expected MODULE:FUNCTION or path/to/file.py:FUNCTION")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            module = _module_from_file(Path(module_name))
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())  # a module next to the user, as `python -m` finds it
            module = importlib.import_module(module_name)
    except BadInput as error:
        raise BadInput(f"factory {spec!r}: {error}") from None
    except Exception as error:
        raise BadInput(f"factory {spec!r}: cannot import {module_name!r}: {type(error).__name__}: {error}") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise BadInput(f"factory {spec!r}: {module_name!r} has no callable {attribute!r}")
    return factory  # type: ignore[no-any-return]


def load_plugin_object(spec: str) -> tuple[Any, str]:
    """``(object, plugin name)`` for ``--plugin``: a module name, ``file.py``, or either with ``:attr``.

    Examples:
        >>> load_plugin_object("physicsnemo_shardext.patches.pointwise")[1]
        'pointwise'
    """
    if ":" in spec.replace(":\\", ""):  # module:attr (a Windows drive letter is not a separator)
        return load_factory(spec), spec.rpartition(":")[2].replace("_", "-")
    if spec.endswith(".py"):
        try:
            module = _module_from_file(Path(spec))
        except BadInput:
            raise
        except Exception as error:
            raise BadInput(f"--plugin {spec}: cannot import it: {type(error).__name__}: {error}") from error
        return module, Path(spec).stem.replace("_", "-")
    try:
        module = importlib.import_module(spec)
    except Exception as error:
        raise BadInput(f"--plugin {spec}: cannot import it: {type(error).__name__}: {error}") from error
    return module, spec.rsplit(".", 1)[-1].replace("_", "-")


def _module_from_file(path: Path) -> Any:
    path = path.resolve()
    if not path.is_file():
        raise BadInput(f"no file {path}")
    alias = f"_shardext_verify_{path.stem}"
    if alias in sys.modules:
        return sys.modules[alias]
    loader_spec = importlib.util.spec_from_file_location(alias, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[alias] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception:
        del sys.modules[alias]
        raise
    return module


# -- building ------------------------------------------------------------------------------
@dataclass
class _Built:
    model: nn.Module
    inputs: list[Any]
    notes: list[str] = field(default_factory=list)


def _build(config: VerifyConfig) -> _Built:
    from physicsnemo_shardext.testing.isolation import seed_everything

    factory = load_factory(config.factory)
    seed_everything(config.seed)
    try:
        made = factory()
    except Exception as error:
        raise BadInput(f"factory {config.factory!r} raised {type(error).__name__}: {error}") from error
    model, inputs = (
        (made[0], list(made[1]) if isinstance(made[1], (list, tuple)) else [made[1]])
        if isinstance(made, tuple)
        else (made, None)
    )
    if not isinstance(model, nn.Module):
        raise BadInput(f"factory {config.factory!r} returned {type(model).__name__}, not an nn.Module")
    dtype = getattr(torch, config.dtype)
    if inputs is None:
        if config.input_shape is None:
            raise BadInput("give --input SHAPE (e.g. 1x3x64x64) or return (model, inputs) from the factory")
        inputs = [torch.randn(config.input_shape, generator=torch.Generator().manual_seed(config.seed))]
    inputs = [x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in inputs]
    model = model.to(dtype).train(config.train)
    built = _Built(model, inputs)
    if config.train:
        # A random mask depends on the shard layout: nothing could match. Drop path too (Pangu, Swin).
        dropped = without_random_masks(model)
        if dropped:
            built.notes.append(
                f"dropout and drop path set to p=0 in {len(dropped)} module(s) ({', '.join(dropped[:3])}...)"
            )
    first = _sharded_input_index(inputs)
    for dim in config.shard_dims:
        if dim >= inputs[first].dim() or dim < -inputs[first].dim():
            raise BadInput(
                f"--shard {dim}: the input has {inputs[first].dim()} dims (shape {list(inputs[first].shape)})"
            )
    return built


def _sharded_input_index(inputs: Sequence[Any]) -> int:
    for index, x in enumerate(inputs):
        if isinstance(x, Tensor) and x.is_floating_point():
            return index
    raise BadInput("the model's inputs hold no floating-point tensor to shard")


# -- the two runs ---------------------------------------------------------------------------
_LOSS_CODE = {"mse": "F.mse_loss(output, target)", "sum": "output.sum()"}


def _loss(config: VerifyConfig, output: Any, target: Any) -> Tensor:
    first = _first_tensor(output)
    if config.loss == "sum":
        return first.sum()
    return F.mse_loss(first, target)


def _first_tensor(output: Any) -> Tensor:
    for leaf in tree_leaves(output):
        if isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            return leaf
    raise BadInput(f"the model returned no floating-point tensor ({type(output).__name__})")


def _reference(config: VerifyConfig, built: _Built) -> dict[str, Any]:
    model = copy.deepcopy(built.model)
    inputs = [
        x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, Tensor) else x for x in built.inputs
    ]
    counter = _PlainCounter()
    try:
        with counter:
            output = model(*inputs)
            first = _first_tensor(output)
            target = torch.randn(first.shape, generator=torch.Generator().manual_seed(config.seed + 1)).to(first.dtype)
            loss = _loss(config, output, target)
        loss.backward()  # type: ignore[no-untyped-call]
    except BadInput:
        raise
    except Exception as error:
        shape = [list(x.shape) for x in built.inputs if isinstance(x, Tensor)]
        raise BadInput(
            f"the model fails single-process on input shape(s) {shape}: {type(error).__name__}: {error}"
        ) from error
    return {
        "model": model,
        "inputs": inputs,
        "output": output,
        "loss": loss.detach(),
        "target": target,
        "op_calls": counter.calls,
    }


class _PlainCounter(torch.overrides.TorchFunctionMode):
    """Counts top-level torch calls (the progress bar's total)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if getattr(func, "__name__", "") not in IGNORED_CALLS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _mesh(config: VerifyConfig) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    names = ("domain",) if len(config.mesh) == 1 else tuple(f"domain{i}" for i in range(len(config.mesh)))
    return init_device_mesh(device, tuple(config.mesh), mesh_dim_names=names)


def _sharded(
    config: VerifyConfig, built: _Built, reference: dict[str, Any], progress: Callable[[int], None]
) -> dict[str, Any]:
    from physicsnemo_shardext import get_registry
    from physicsnemo_shardext.testing.sharding import shard_tensor

    mesh = _mesh(config)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    model = copy.deepcopy(built.model).to(device)
    first = _sharded_input_index(built.inputs)
    full = built.inputs[first]
    dims = [d % full.dim() for d in config.shard_dims]
    sizes = {
        mesh_dim: split_sizes(
            full.shape[d], config.mesh[mesh_dim], config.split if len(dims) == 1 else _split_for(config.split, mesh_dim)
        )
        for mesh_dim, d in enumerate(dims)
    }
    placements = [Shard(d) for d in dims]
    inputs = []
    for index, x in enumerate(built.inputs):
        if isinstance(x, Tensor):
            x = x.to(device)
            if index == first or _splits_like(x, full, dims):
                x = shard_tensor(x, mesh, placements, sizes, requires_grad=x.is_floating_point())
        inputs.append(x)
    tracer = OpTracer(provider_of=registry_provider(get_registry()), on_call=progress)
    record: dict[str, Any] = {"tracer": tracer, "sizes": sizes, "placements": [f"Shard({d})" for d in dims]}
    try:
        with tracer:
            output = model(*inputs)
        out = _first_tensor(output)
        target = _target_like(reference["target"].to(device), out)
        tracer.site_override = CallSite("<shardext verify>", 0, "loss", f"loss = {_LOSS_CODE[config.loss]}")
        with tracer:
            loss = _loss(config, output, target)
        record["backward"] = tracer.backward(loss)
    except Exception as error:  # reported op by op; the first error is on its site
        record["error"] = error
        record["error_site"] = tracer.first_error
        if tracer.first_error is None:
            record["error_caller"] = find_call_site()
        return record
    record.update(model=model, inputs=inputs, output=output, loss=loss, first=first)
    return record


def _splits_like(x: Tensor, first: Tensor, dims: Sequence[int]) -> bool:
    """Whether another input is cut like the first (same rank and extents along the sharded dims).

    Point-cloud models take several per-point tensors (features, coordinates): all are split alike.
    """
    return x.dim() == first.dim() and all(x.shape[d] == first.shape[d] for d in dims)


def _split_for(split: str, mesh_dim: int) -> str:
    """``--split`` for one mesh dim of a 2-D mesh: ``even``/``uneven`` or ``a,b/c,d`` (one group per dim)."""
    if split in ("even", "uneven"):
        return split
    groups = split.split("/")
    return groups[mesh_dim] if mesh_dim < len(groups) else "even"


def _target_like(target: Tensor, output: Any) -> Any:
    """The reference's target laid out like the sharded output (Replicate where it is not a ShardTensor)."""
    from physicsnemo_shardext.testing.sharding import shard_tensor

    if not isinstance(output, DTensor) and type(output).__name__ != "ShardTensor":
        return target
    placements = list(output.placements)
    if type(output).__name__ == "ShardTensor":
        shapes = output._spec.sharding_shapes()
        sizes = {m: [s[p.dim] for s in shapes[m]] for m, p in enumerate(placements) if isinstance(p, Shard)}
        placements = [p if isinstance(p, Shard) else Replicate() for p in placements]
        return shard_tensor(target, output.device_mesh, placements, sizes or None)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        target, output.device_mesh, [p if isinstance(p, Shard) else Replicate() for p in placements]
    )


def _is_distributed(value: Any) -> bool:
    return isinstance(value, DTensor) or type(value).__name__ == "ShardTensor"


def _full(value: Any) -> Tensor:
    full: Tensor = value.full_tensor() if _is_distributed(value) else value
    return full


def _compare(config: VerifyConfig, reference: dict[str, Any], sharded: dict[str, Any]) -> list[dict[str, Any]]:
    """Every compared tensor: name, max abs error, relative error, ok. Collective (full_tensor) on all ranks."""
    rows: list[dict[str, Any]] = []
    tolerance = config.tolerance

    def add(name: str, value: Any, expected: Any) -> None:
        if value is None and expected is None:
            rows.append(
                {
                    "tensor": name,
                    "max_abs_error": None,
                    "relative_error": 0.0,
                    "ok": True,
                    "detail": "no gradient in either run (unused)",
                }
            )
            return
        if value is None or expected is None:
            missing = "sharded run" if value is None else "reference"
            rows.append(
                {
                    "tensor": name,
                    "max_abs_error": None,
                    "relative_error": float("inf"),
                    "ok": False,
                    "detail": f"no gradient in the {missing}",
                }
            )
            return
        value = _full(value).detach().cpu()
        expected = expected.detach().cpu()
        result = compare(value, expected, tolerance)
        detail = result.problem
        if not detail and not result.passed:
            where = f", worst at {list(result.worst_index)}" if result.worst_index else ""
            detail = f"{result.mismatched} of {result.numel} elements outside atol + rtol*|r|{where}"
        rows.append(
            {
                "tensor": name,
                "max_abs_error": result.max_abs_error,
                "relative_error": result.max_rel_error,
                "ok": result.passed,
                "detail": detail,
                "worst_index": None if result.worst_index is None else list(result.worst_index),
                "elements_outside": result.mismatched,
                "description": result.describe(),
            }
        )

    add("loss", sharded["loss"], reference["loss"])
    outputs = [t for t in tree_leaves(sharded["output"]) if isinstance(t, Tensor)]
    expected_outputs = [t for t in tree_leaves(reference["output"]) if isinstance(t, Tensor)]
    for index, (value, expected) in enumerate(zip(outputs, expected_outputs)):
        add("output" if len(outputs) == 1 else f"output[{index}]", value, expected)
    sharded_inputs = [i for i, x in enumerate(sharded["inputs"]) if _is_distributed(x) and x.requires_grad]
    for i in sharded_inputs:
        name = "grad input" if len(sharded_inputs) == 1 else f"grad input[{i}]"
        add(name, sharded["inputs"][i].grad, reference["inputs"][i].grad)
    expected_params = dict(reference["model"].named_parameters())
    for name, param in sharded["model"].named_parameters():
        add(f"grad {name}", param.grad, expected_params[name].grad)
    rows.sort(key=_worst_first)
    return rows


def _worst_first(row: dict[str, Any]) -> tuple[bool, float]:
    """Sort key: mismatches first, then the largest relative error (NaN last)."""
    relative = row["relative_error"]
    return row["ok"], -relative if relative == relative else 0.0


# -- the rank entry point ------------------------------------------------------------------------
def check_model(config: VerifyConfig) -> dict[str, Any] | None:
    """Run the check on this rank; every rank must call it. Rank 0 returns the report, others ``None``."""
    progress = _Progress(config.progress_path if dist.get_rank() == 0 else None)
    local: dict[str, Any] = {"rank": dist.get_rank()}
    try:
        with exact_float32():  # TF32 would make two correct runs differ (see exact_float32)
            _check_on_this_rank(config, local, progress)
    except BadInput as error:
        local["bad_input"] = str(error)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    progress.phase("done")
    if dist.get_rank() != 0:
        return None
    return build_report(config, gathered)


def _check_on_this_rank(config: VerifyConfig, local: dict[str, Any], progress: _Progress) -> None:
    """Reference, sharded run and comparison on this rank, recorded into ``local``."""
    from physicsnemo_shardext import load_plugin

    for spec in config.plugins:
        plugin, name = load_plugin_object(spec)
        report = load_plugin(plugin, name)
        if report.status.value != "loaded":
            raise BadInput(f"--plugin {spec}: {report.status.value}: {report.reason}")
    progress.phase("building the model")
    built = _build(config)
    progress.phase("single-process reference")
    reference = _reference(config, built)
    progress.total = reference["op_calls"]
    progress.phase("sharded forward")
    sharded = _sharded(config, built, reference, progress.step)
    local.update(_rank_record(config, built, sharded))
    if "error" not in sharded:
        progress.phase("comparing")
        local["comparison"] = _compare(config, reference, sharded)


def _rank_record(config: VerifyConfig, built: _Built, sharded: dict[str, Any]) -> dict[str, Any]:
    tracer: OpTracer = sharded["tracer"]
    record: dict[str, Any] = {
        "sites": [site.as_dict() for site in tracer.ordered_sites()],
        "notes": built.notes,
        "sizes": {str(k): v for k, v in sharded["sizes"].items()},
        "placements": sharded["placements"],
        "plain_calls": tracer.plain_calls,
    }
    if "error" in sharded:
        error = sharded["error"]
        site: OpSite | None = sharded.get("error_site")
        caller = site.site if site is not None else sharded.get("error_caller")
        record["error"] = {
            "type": type(error).__name__,
            "unsupported": isinstance(error, MissingShardPatch) or isinstance(error, NotImplementedError),
            "message": str(error),
            "op": site.op if site else None,
            "configuration": site.configuration if site else "",
            "site": None
            if caller is None
            else {"file": caller.file, "line": caller.line, "function": caller.function, "code": caller.code},
        }
    return record


class _Progress:
    """Rank 0 writes ``phase<TAB>done<TAB>total`` lines to a file the parent's progress bar reads."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.total = 0
        self._phase = ""

    def phase(self, name: str) -> None:
        self._phase = name
        self._write(0)

    def step(self, done: int) -> None:
        if done % 4 == 0 or done >= self.total:
            self._write(done)

    def _write(self, done: int) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(f"{self._phase}\t{done}\t{self.total}\n")


# -- the report ---------------------------------------------------------------------------------
def build_report(config: VerifyConfig, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge every rank's record into the versioned report (see the module docstring).

    Examples:
        >>> report = build_report(VerifyConfig("m:f"), [{"rank": 0, "bad_input": "no file"}])
        >>> report["status"], report["exit_code"], report["schema_version"]
        ('bad-input', 3, 1)
    """
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "schema_version": REPORT_VERSION,
        "config": {
            key: (list(value) if isinstance(value, tuple) else value)
            for key, value in asdict(config).items()
            if key != "progress_path"
        },
        "tolerance": config.tolerance.rtol,
        "rtol": config.tolerance.rtol,
        "atol": config.tolerance.atol,
        "rule": RULE,
        "ranks": len(ranks),
    }
    bad = [r["bad_input"] for r in ranks if r.get("bad_input")]
    if bad:
        report.update(
            status="bad-input",
            exit_code=EXIT_CODES["bad-input"],
            error={"message": bad[0]},
            ops=[],
            comparison=[],
            totals={},
            next_steps=[],
            notes=[],
        )
        report["summary"] = f"BAD INPUT: {bad[0]}"
        return report
    first = ranks[0]
    report["split"] = {"placements": first["placements"], "sizes": first["sizes"]}
    report["notes"] = first.get("notes", [])
    report["ops"] = _merge_sites([r.get("sites", []) for r in ranks])
    report["totals"] = _totals(report["ops"], len(ranks))
    errors = [r["error"] for r in ranks if r.get("error")]
    if errors:
        report["error"] = errors[0]
        report["comparison"] = []
        report["status"] = "unsupported"
    else:
        report["error"] = None
        report["comparison"] = _merge_comparisons([r["comparison"] for r in ranks])
        report["status"] = "match" if all(row["ok"] for row in report["comparison"]) else "mismatch"
    report["exit_code"] = EXIT_CODES[report["status"]]
    report["next_steps"] = _next_steps(report)
    report["summary"] = _summary(report)
    return report


def _merge_sites(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    def key(site: dict[str, Any]) -> tuple[Any, ...]:
        where = site["site"] or {}
        return site["op"], where.get("file"), where.get("line")

    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rank, sites in enumerate(per_rank):
        for site in sites:
            entry = merged.get(key(site))
            if entry is None:
                entry = dict(site)
                entry["forward"] = {"collectives": [0] * len(per_rank), "bytes": [0] * len(per_rank)}
                entry["backward"] = {"collectives": [0] * len(per_rank), "bytes": [0] * len(per_rank)}
                entry["activation_gathers"] = 0
                entry["index"] = len(merged)
                merged[key(site)] = entry
            for phase in ("forward", "backward"):
                entry[phase]["collectives"][rank] = site[phase]["collectives"]
                entry[phase]["bytes"][rank] = site[phase]["bytes"]
            entry["activation_gathers"] = max(entry["activation_gathers"], site["activation_gathers"])
            entry["error"] = entry["error"] or site["error"]
    return list(merged.values())


def _totals(ops: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    per_rank = {
        phase: {
            what: [sum(op[phase][what][r] for op in ops) for r in range(ranks)] for what in ("collectives", "bytes")
        }
        for phase in ("forward", "backward")
    }
    return {
        "sites": len(ops),
        "calls": sum(op["calls"] for op in ops),
        "by_provider": _count_by(ops, "provider_kind"),
        "not_sharded": sum(1 for op in ops if not op["stayed_sharded"]),
        "activation_gathers": sum(op["activation_gathers"] for op in ops),
        **per_rank,
    }


def _count_by(ops: list[dict[str, Any]], field_name: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ops:
        counts[op[field_name]] = counts.get(op[field_name], 0) + 1
    return counts


def _merge_comparisons(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    worst: dict[str, dict[str, Any]] = {}
    for rows in per_rank:
        for row in rows:
            seen = worst.get(row["tensor"])
            if seen is None or row["relative_error"] > seen["relative_error"] or not row["ok"]:
                worst[row["tensor"]] = row
    return sorted(worst.values(), key=_worst_first)


def _where(site: dict[str, Any] | None) -> str:
    return "" if not site else f"{site['file']}:{site['line']}"


def _next_steps(report: dict[str, Any]) -> list[str]:
    steps = []
    flagged = [
        op
        for op in report["ops"]
        if op["error"] or op["activation_gathers"] or (op["provider_kind"] == "dtensor" and not op["stayed_sharded"])
    ]
    for op in flagged[:5]:
        why = (
            "raised"
            if op["error"]
            else ("gathers a whole activation" if op["activation_gathers"] else "replicates a whole activation")
        )
        steps.append(f"{op['op']} ({_where(op['site'])}) {why} under {op['handler']}: write a patch for it")
    if flagged:
        steps.append("start a plugin with `shardext new my-patches` and follow docs/writing-a-plugin.md")
    if report["status"] == "mismatch":
        worst = report["comparison"][0]
        plugins = sorted({op["provider"] for op in report["ops"] if op["provider_kind"] == "plugin"})
        steps.append(
            f"the worst tensor is {worst['tensor']}; plugin handlers that ran: {', '.join(plugins) or 'none'}; "
            "rerun with SHARDEXT_DISABLE=<plugin> to find the culprit"
        )
    return steps


def _summary(report: dict[str, Any]) -> str:
    totals = report["totals"]
    providers = ", ".join(f"{count} {kind}" for kind, count in sorted(totals["by_provider"].items()))
    head = {"match": "MATCH", "mismatch": "MISMATCH", "unsupported": "UNSUPPORTED"}[report["status"]]
    fwd = max(totals["forward"]["bytes"], default=0)
    bwd = max(totals["backward"]["bytes"], default=0)
    text = (
        f"{head}: {totals['calls']} calls at {totals['sites']} op sites ({providers}); "
        f"{totals['activation_gathers']} activation gather(s); "
        f"max bytes per rank: forward {fwd}, backward {bwd}"
    )
    if report["status"] == "unsupported":
        error = report["error"]
        text += f"; first error: {error['type']} in {error['op'] or '?'} at {_where(error['site'])}"
    elif report["comparison"]:
        worst = report["comparison"][0]
        text += f"; worst relative error {worst['relative_error']:.2e} ({worst['tensor']})"
    return text


def write_json(report: dict[str, Any], path: str) -> None:
    """Write the report as JSON (``-`` for standard output)."""
    text = json.dumps(report, indent=2, default=str)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")
