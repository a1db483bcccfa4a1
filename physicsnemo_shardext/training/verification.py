"""Check a hybrid ddp x domain training run against single-process training on the global batch.

`verify_training` trains a model two ways from the same seeded initialization,
on every rank:

* the **reference**: a deep copy of the freshly built model, trained in this
  process on the whole global batch (``loss_fn`` with its default mean reduction,
  i.e. the mean of the per-sample means, which is what averaging gradients over
  the ``ddp`` axis gives);
* the **domain-parallel run**: `wrap_model`, `scatter_input` / `scatter_target`,
  an optimizer over `param_groups`, ``loss_fn(model(x_shard), y_shard)`` with the
  ``Replicate`` target (the losses plugin makes that equal to single-process),
  backward, step.

It compares the losses of every step (the parallel loss averaged over ``ddp``
with `ddp_mean`), the output of the first step, **every** parameter gradient of
the first step (sharded or FSDP2 gradients gathered with ``full_tensor()``),
every parameter after the last step, and checks that all ranks hold bitwise
identical parameters.

Every tensor and every step's loss is compared by the one rule of
`physicsnemo_shardext.comparison`: equal when ``|a - r| <= atol + rtol * |r|``
for every element (``rtol`` ``1e-5`` by default; ``atol`` by default the
compute dtype's, ``1e-5`` for fp32, ``2e-2`` under bf16 autocast). Reported per
tensor: ``max|a - r|`` and the relative error ``max|a - r| / max(max|r|, atol)``
(normalised by the reference's largest magnitude so that tiny entries do not
dominate, and by ``atol`` where the whole reference is within ``atol`` of zero).
The run is ``ok`` when every tensor and loss is within the tolerance and the
parameters are identical across ranks. The errors and verdicts are gathered over
all ranks (max, any failure), so every rank gets the same report.

Examples:
    A report of two compared tensors (one outside its tolerance):

    >>> report = TrainingReport([1.0], [1.0], 0.0, {}, {"w": TensorError(0.2, 0.1, passed=False),
    ...                         "b": TensorError(1e-8, 1e-3, passed=True)}, {}, True, 0.0, 1e-5, "ddp", (2, 2))
    >>> report.ok, report.worst_tensor
    (False, 'grad w')

    On 4 ranks (``torchrun --nproc-per-node 4``, after ``physicsnemo_shardext.initialize()``):

    ```python
    layout = build_layout(ddp=2)
    batches = [(torch.randn(2, 2, 9, 6), torch.randn(2, 1, 9, 6)) for _ in range(3)]
    report = verify_training(make_model, batches, layout, shard_dim=2, sizes=[5, 4], wrapper="ddp")
    print(report.format())
    assert report.ok
    ```
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from physicsnemo_shardext.comparison import Comparison, Tolerance, compare, exact_float32
from physicsnemo_shardext.errors import MissingShardPatch
from physicsnemo_shardext.torch_support import compiles_empty_shards
from physicsnemo_shardext.training.parallel import (
    ParallelLayout,
    ddp_mean,
    param_groups,
    scatter_input,
    scatter_target,
    wrap_model,
)

__all__ = ["TensorError", "TrainingReport", "relative_error", "verify_training"]

#: Optimizers `verify_training` can build, by name.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


@dataclass(frozen=True)
class TensorError:
    """How far one tensor is from its reference.

    Attributes:
        max_abs: ``max|a - r|``.
        relative: ``max_abs / max(max|r|, atol)`` (see `physicsnemo_shardext.comparison`).
        passed: every element within ``atol + rtol * |r|`` on every rank (``None``: not
            decided by the rule, e.g. built by hand; ``relative <= rtol`` then decides).
    """

    max_abs: float
    relative: float
    passed: bool | None = None

    @classmethod
    def of(cls, comparison: Comparison) -> TensorError:
        """The error and verdict of one `Comparison`.

        Examples:
            >>> TensorError.of(compare(torch.zeros(2), torch.zeros(2)))
            TensorError(max_abs=0.0, relative=0.0, passed=True)
        """
        return cls(comparison.max_abs_error, comparison.max_rel_error, comparison.passed)

    def within(self, rtol: float) -> bool:
        """The verdict: `passed` where the rule decided it, else ``relative <= rtol``."""
        return self.relative <= rtol if self.passed is None else self.passed


@dataclass
class TrainingReport:
    """What `verify_training` measured (identical on every rank).

    Attributes:
        sharded_losses: the domain-parallel loss of each step, averaged over ``ddp``
            (also available as ``losses``).
        reference_losses: the single-process loss of each step.
        loss_error: the largest relative loss error over the steps.
        outputs: error of the model output (first step; every batch when not training).
        gradients: error of each parameter's gradient at the first step, by name.
        parameters: error of each parameter after the last step, by name.
        params_identical_across_ranks: whether every rank holds the same parameters, bitwise.
        rank_spread: ``max|p_rank - p_rank0|`` over all parameters and ranks.
        rtol: the relative tolerance ``ok`` was decided with.
        wrapper: the wrapper used.
        mesh_shape: ``(ddp_size, domain_size)``.
        train: whether the run trained (else: forward only).
        atol: the absolute tolerance ``ok`` was decided with (``None``: a report built by hand).
        loss_passed: every step's loss within the tolerance (``None``: ``loss_error <= rtol`` decides).
    """

    sharded_losses: list[float]
    reference_losses: list[float]
    loss_error: float
    outputs: dict[str, TensorError]
    gradients: dict[str, TensorError]
    parameters: dict[str, TensorError]
    params_identical_across_ranks: bool
    rank_spread: float
    rtol: float
    wrapper: str
    mesh_shape: tuple[int, int]
    train: bool = True
    notes: list[str] = field(default_factory=list)
    atol: float | None = None
    loss_passed: bool | None = None

    @property
    def losses(self) -> list[float]:
        """The same as ``sharded_losses``."""
        return self.sharded_losses

    def errors(self) -> dict[str, TensorError]:
        """Every compared tensor, keyed ``"output ..."``, ``"grad NAME"``, ``"param NAME"``."""
        result = dict(self.outputs)
        result.update({f"grad {n}": e for n, e in self.gradients.items()})
        result.update({f"param {n}": e for n, e in self.parameters.items()})
        return result

    @property
    def worst(self) -> tuple[str, TensorError] | None:
        """The compared tensor outside its tolerance, else with the largest relative error (``None``: none compared)."""
        errors = self.errors()
        if not errors:
            return None
        name = max(errors, key=lambda n: (not errors[n].within(self.rtol), errors[n].relative))
        return name, errors[name]

    @property
    def worst_tensor(self) -> str | None:
        """The name of `worst` (e.g. ``"grad 0.weight"``)."""
        worst = self.worst
        return None if worst is None else worst[0]

    @property
    def ok(self) -> bool:
        """Every tensor and loss within the tolerance, and the parameters identical across ranks."""
        tensors_ok = all(error.within(self.rtol) for error in self.errors().values())
        loss_ok = self.loss_error <= self.rtol if self.loss_passed is None else self.loss_passed
        return tensors_ok and loss_ok and self.params_identical_across_ranks

    def format(self) -> str:
        """A few readable lines: verdict, losses, worst tensor, rank agreement.

        Examples:
            >>> report = TrainingReport([1.0], [1.0], 0.0, {}, {"w": TensorError(2e-3, 1e-3)}, {}, True, 0.0,
            ...                         1e-5, "ddp", (2, 2))
            >>> print(report.format())
            training check FAILED (wrapper='ddp', mesh ddp=2 x domain=2, 1 step(s), rtol=1e-05)
              losses:    parallel [1.000000e+00]  reference [1.000000e+00]  max rel error 0.000e+00
              worst:     grad w: rel error 1.000e-03 (max abs 2.000e-03) > rtol
              ranks:     parameters identical on every rank (spread 0.000e+00)
        """
        verdict = "ok" if self.ok else "FAILED"
        kind = "training" if self.train else "inference"
        lines = [
            f"{kind} check {verdict} (wrapper={self.wrapper!r}, mesh ddp={self.mesh_shape[0]} x "
            f"domain={self.mesh_shape[1]}, {len(self.losses)} step(s), rtol={self.rtol:g}"
            + ("" if self.atol is None else f", atol={self.atol:g}")
            + ")"
        ]
        fmt = ", ".join
        lines.append(
            f"  losses:    parallel [{fmt(f'{v:.6e}' for v in self.losses)}]  "
            f"reference [{fmt(f'{v:.6e}' for v in self.reference_losses)}]  max rel error {self.loss_error:.3e}"
        )
        worst = self.worst
        if worst is not None:
            name, error = worst
            if error.passed is None:
                mark = "<= rtol" if error.relative <= self.rtol else "> rtol"
            else:
                mark = "within atol + rtol*|r|" if error.passed else "OUTSIDE atol + rtol*|r|"
            lines.append(f"  worst:     {name}: rel error {error.relative:.3e} (max abs {error.max_abs:.3e}) {mark}")
        same = "identical on every rank" if self.params_identical_across_ranks else "DIFFER across ranks"
        lines.append(f"  ranks:     parameters {same} (spread {self.rank_spread:.3e})")
        lines.extend(f"  note:      {note}" for note in self.notes)
        return "\n".join(lines)


def relative_error(value: Tensor, reference: Tensor) -> tuple[float, float]:
    """``(max|value - reference|, that / max|reference|)``; the second is the first if ``reference`` is all zeros.

    The measure before `physicsnemo_shardext.comparison`, kept for callers; it misleads
    near zero (a tiny reference makes a huge ratio): use `compare` instead.

    Examples:
        >>> relative_error(torch.zeros(2), torch.zeros(2))
        (0.0, 0.0)
    """
    if tuple(value.shape) != tuple(reference.shape):
        return float("inf"), float("inf")
    diff = (value.detach().double() - reference.detach().double()).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(reference.detach().double().abs().max()) if reference.numel() else 0.0
    return max_abs, (max_abs / scale if scale > 0 else max_abs)


def _full(value: Any) -> Tensor:
    """The whole tensor of a ShardTensor / DTensor (collective), or the tensor itself."""
    if isinstance(value, DTensor) or type(value).__name__ == "ShardTensor":
        return value.full_tensor()  # type: ignore[no-any-return]
    assert isinstance(value, Tensor)
    return value


def _device(layout: ParallelLayout) -> torch.device:
    if layout.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(layout.mesh.device_type)


def _autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    if not values:
        return []
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def _fingerprint(tensor: Tensor) -> list[float]:
    values = tensor.detach().reshape(-1).double()
    weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=values.device).remainder_(97).add_(1)
    return [float(values.numel()), float(values.sum()), float(values.square().sum()), float((values * weights).sum())]


def _check_identical_batches(batches: Sequence[tuple[Tensor, Tensor]], steps: int, device: torch.device) -> None:
    """Raise on every rank if the batches used differ across ranks (compared by fingerprints, one all-gather)."""
    used = [batches[step % len(batches)] for step in range(min(steps, len(batches)))]
    local = torch.tensor(
        [v for x, y in used for v in (*_fingerprint(x), *_fingerprint(y))], dtype=torch.float64, device=device
    )
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    differing = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if differing:
        raise ValueError(
            f"verify_training: the global batches differ between rank 0 and rank(s) {differing}; they must be "
            "identical on every rank (build them after the same torch.manual_seed, or broadcast them)"
        )


def _rank_spread(parameters: list[Tensor], device: torch.device) -> float:
    """``max|p_rank - p_rank0|`` over all ranks, from one all-gather of the flattened parameters."""
    if not parameters:
        return 0.0
    flat = torch.cat([p.detach().reshape(-1).to(device=device, dtype=torch.float64) for p in parameters])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


def _refuse_uncompilable_split(length: int, ranks: int, sizes: Sequence[int] | None) -> None:
    """Refuse, on every rank alike, a compiled run that this torch would fail on one rank only (a hang)."""
    rows = list(sizes) if sizes is not None else [len(c) for c in torch.arange(length).chunk(ranks)]
    rows += [0] * (ranks - len(rows))
    if 0 in rows and not compiles_empty_shards():
        raise MissingShardPatch(
            f"verify_training(compile=True) with shard sizes {rows}: torch {torch.__version__}'s Dynamo fails on "
            "the rank whose shard is empty while the others wait (a hang); use torch>=2.14, a split without "
            "empty shards, or compile=False"
        )


@exact_float32()  # TF32 would make the parallel and single-process runs differ (see exact_float32)
def verify_training(
    make_model: Callable[[], nn.Module],
    batches: Sequence[tuple[Tensor, Tensor]],
    layout: ParallelLayout,
    *,
    shard_dim: int,
    sizes: Sequence[int] | None = None,
    loss_fn: Callable[..., Tensor] = F.mse_loss,
    wrapper: str = "none",
    spatial_parameters: Sequence[str] = (),
    spatial_dim: int = 1,
    steps: int = 3,
    lr: float = 1e-2,
    optimizer: str = "sgd",
    compile: bool = False,
    autocast_dtype: torch.dtype | None = None,
    train: bool = True,
    rtol: float = 1e-5,
    atol: float | None = None,
) -> TrainingReport:
    """Train domain-parallel and single-process from the same start; compare losses, gradients, parameters.

    Collective: call it on every rank with the same arguments.

    Args:
        make_model: builds the model; called once, after ``torch.manual_seed(0)``, on every rank.
        batches: global batches ``(x, y)``, ``ddp_size`` samples each, identical on every
            rank; step ``i`` uses ``batches[i % len(batches)]``.
        layout: the parallel layout.
        shard_dim: the input dim split over the domain mesh (`scatter_input`).
        sizes: rows of ``shard_dim`` per domain rank (default ``torch.chunk``-like).
        loss_fn: ``loss_fn(output, target)`` with a mean reduction.
        wrapper: ``"none"``, ``"ddp"`` or ``"fsdp2"`` (`wrap_model`). Training with
            ``"none"`` needs ``ddp_size == 1``: nothing would average gradients over ``ddp``.
        spatial_parameters: parameters sharded over the domain mesh (FSDP2 only).
        spatial_dim: their sharded dim.
        steps: optimizer steps (forward passes when ``train=False``).
        lr: learning rate.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        compile: ``torch.compile(..., dynamic=False)`` the wrapped and the reference
            model (errors propagate).
        autocast_dtype: run both forwards under ``torch.autocast(device_type, dtype)``;
            ``atol`` defaults to that dtype's (`Tolerance.for_dtype`); pass a suitable ``rtol``.
        train: ``False``: forward only, in ``eval()`` mode under ``no_grad`` (outputs
            and losses compared, no optimizer).
        rtol: the relative tolerance of ``ok`` (see the module docstring for the rule).
        atol: the absolute tolerance of ``ok``; default: `Tolerance.for_dtype` of the
            autocast dtype, else of the model's parameters (``1e-5`` for float32).

    Returns:
        The `TrainingReport`, identical on every rank.

    Raises:
        ValueError: an unknown optimizer, no batches, batches that differ across ranks
            (checked by fingerprints), or training with ``wrapper="none"`` on ``ddp_size > 1``.

    Examples:
        ```python
        report = verify_training(make_model, batches, layout, shard_dim=2, wrapper="fsdp2")
        assert report.ok, report.format()
        ```
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZERS)}")
    if not batches:
        raise ValueError("verify_training needs at least one batch")
    if train and wrapper == "none" and layout.ddp_size > 1:
        raise ValueError(
            f"wrapper='none' with ddp size {layout.ddp_size}: nothing averages gradients over the ddp axis, "
            "so the domain groups would train apart; use 'ddp' or 'fsdp2' (or train=False)"
        )
    if compile:
        _refuse_uncompilable_split(batches[0][0].shape[shard_dim], layout.domain_size, sizes)
    device = _device(layout)
    device_type = layout.mesh.device_type
    _check_identical_batches(batches, steps, device)

    torch.manual_seed(0)
    model = make_model().to(device)
    reference = copy.deepcopy(model)
    compute_dtype = autocast_dtype or next((p.dtype for p in model.parameters()), torch.float32)
    tolerance = Tolerance(rtol, Tolerance.for_dtype(compute_dtype).atol if atol is None else atol)
    wrapped = wrap_model(model, layout, wrapper, spatial_parameters=spatial_parameters, spatial_dim=spatial_dim)
    run: Callable[..., Any] = wrapped
    reference_run: Callable[..., Any] = reference
    if compile:
        run = torch.compile(wrapped, dynamic=False)
        reference_run = torch.compile(reference, dynamic=False)
    optimizer_class = OPTIMIZERS[optimizer]
    if train:
        parallel_optimizer = optimizer_class(param_groups(model, lr=lr))
        reference_optimizer = optimizer_class(reference.parameters(), lr=lr)
    else:
        model.eval()
        reference.eval()

    losses: list[float] = []
    reference_losses: list[float] = []
    output_pairs: dict[str, tuple[Tensor, Tensor]] = {}
    gradient_pairs: dict[str, tuple[Tensor, Tensor]] = {}
    grad_context: Callable[[], contextlib.AbstractContextManager[Any]] = (
        contextlib.nullcontext if train else torch.no_grad
    )
    for step in range(steps):
        x, y = (t.to(device) for t in batches[step % len(batches)])
        with grad_context():
            with _autocast(device_type, autocast_dtype):
                reference_output = reference_run(x)
                reference_loss = loss_fn(reference_output, y)
            x_shard = scatter_input(x, layout, shard_dim, sizes=sizes)
            y_shard = scatter_target(y, layout)
            with _autocast(device_type, autocast_dtype):
                output = run(x_shard)
                loss = loss_fn(output, y_shard)
        if step == 0 or not train:
            sample = reference_output[layout.ddp_rank : layout.ddp_rank + 1]
            output_pairs[f"output (step {step})"] = (_full(output).detach(), sample.detach())
        if train:
            torch.autograd.backward(reference_loss)
            torch.autograd.backward(loss)
            if step == 0:
                reference_grads = dict(reference.named_parameters())
                for name, param in model.named_parameters():
                    grad, expected = param.grad, reference_grads[name].grad
                    if grad is None and expected is None:
                        continue
                    if grad is None or expected is None:  # one run has a gradient, the other none
                        gradient_pairs[name] = (torch.full((1,), float("inf")), torch.zeros(1))
                        continue
                    gradient_pairs[name] = (_full(grad).detach().clone(), expected.detach().clone())
            parallel_optimizer.step()
            parallel_optimizer.zero_grad()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        losses.append(ddp_mean(loss, layout))
        reference_losses.append(float(reference_loss.detach().float()))

    reference_params = dict(reference.named_parameters())
    parameter_pairs: dict[str, tuple[Tensor, Tensor]] = {}
    full_params: list[Tensor] = []
    for name, param in model.named_parameters():
        full = _full(param.detach())
        full_params.append(full)
        if train:
            parameter_pairs[name] = (full, reference_params[name].detach())

    def measure(pairs: dict[str, tuple[Tensor, Tensor]]) -> list[Comparison]:
        return [compare(a, r, tolerance, check_dtype=False) for a, r in pairs.values()]

    measured = [*measure(output_pairs), *measure(gradient_pairs), *measure(parameter_pairs)]
    measured_losses = [
        compare(torch.tensor(a, dtype=torch.float64), torch.tensor(r, dtype=torch.float64), tolerance)
        for a, r in zip(losses, reference_losses)
    ]
    # One all-reduce (max) of (max abs, relative, failed) per tensor and loss: the same report on every rank.
    flat = [
        v for c in [*measured, *measured_losses] for v in (c.max_abs_error, c.max_rel_error, 0.0 if c.passed else 1.0)
    ]
    flat = _max_over_ranks(flat, device)
    reduced = [TensorError(flat[3 * i], flat[3 * i + 1], flat[3 * i + 2] == 0.0) for i in range(len(measured))]
    loss_rows = range(len(measured), len(measured) + len(measured_losses))
    loss_error = max((flat[3 * i + 1] for i in loss_rows), default=0.0)
    loss_passed = all(flat[3 * i + 2] == 0.0 for i in loss_rows)
    n_out, n_grad = len(output_pairs), len(gradient_pairs)
    spread = _rank_spread(full_params, device)
    return TrainingReport(
        sharded_losses=losses,
        reference_losses=reference_losses,
        loss_error=loss_error,
        outputs=dict(zip(output_pairs, reduced[:n_out])),
        gradients=dict(zip(gradient_pairs, reduced[n_out : n_out + n_grad])),
        parameters=dict(zip(parameter_pairs, reduced[n_out + n_grad :])),
        params_identical_across_ranks=spread == 0.0,
        rank_spread=spread,
        rtol=rtol,
        wrapper=wrapper,
        mesh_shape=(layout.ddp_size, layout.domain_size),
        train=train,
        atol=tolerance.atol,
        loss_passed=loss_passed,
    )
