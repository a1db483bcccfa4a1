"""``compile=``: the sharded steps of a conformance check under ``torch.compile``, against the same steps eagerly.

`_check_compiled` runs `COMPILE_STEPS` forward+backward passes of the sharded callable
(fresh sharded inputs each time; the second pass reuses the compiled code) under
``torch.compile(backend=..., dynamic=False)``, and the same passes eagerly on a fresh
copy, and compares every output, input gradient and parameter gradient
(`_sharded_steps` collects them). A failure to compile is a mismatch too.
`_resolve_compile` reads the option.

Examples:
    >>> _resolve_compile(True), _resolve_compile("aot_eager"), _resolve_compile(False)
    ('inductor', 'aot_eager', None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from physicsnemo_shardext.testing.attribution import _Guard
from physicsnemo_shardext.testing.conformance_report import Mismatch
from physicsnemo_shardext.testing.conformance_runs import (
    ParamMode,
    ShardSpec,
    _cotangent_for,
    _gathered,
    _needs_grad,
    _param_grad,
    _prepare_callable,
    _sharded_inputs,
    _tensor_leaves,
)

__all__ = ["COMPILE_STEPS"]

COMPILE_STEPS = 2
"""Forward+backward passes `check_conformance` runs compiled (the second one reuses the compiled code)."""


def _resolve_compile(option: bool | str) -> str | None:
    """The backend ``compile=`` asks for, or ``None``."""
    if option is False or option is None:
        return None
    if option is True:
        return "inductor"
    if isinstance(option, str) and option:
        return option
    raise ValueError(f"compile must be a bool or a backend name, got {option!r}")


def _sharded_steps(
    call: Callable[..., Any],
    module: Any,
    inputs: Sequence[Any],
    specs: Sequence[ShardSpec | None],
    params: ParamMode,
    kwargs: dict[str, Any],
    seed: int,
    mismatches: list[Mismatch],
) -> list[dict[str, torch.Tensor | None]]:
    """`COMPILE_STEPS` forward+backward passes of ``call`` on fresh sharded inputs: gathered outputs and gradients."""
    steps = []
    for _ in range(COMPILE_STEPS):
        if isinstance(module, torch.nn.Module):
            module.zero_grad(set_to_none=True)
        sh_inputs = _sharded_inputs(inputs, specs)
        outputs = _tensor_leaves(call(*sh_inputs, **kwargs))
        result: dict[str, torch.Tensor | None] = {}
        for i, out in enumerate(outputs):
            result[f"output[{i}]"] = _gathered(out)[0].detach()
        differentiable = [o for o in outputs if o.requires_grad]
        if differentiable:
            torch.autograd.backward(
                differentiable, [_cotangent_for(o, o.shape, seed + j) for j, o in enumerate(differentiable)]
            )
        for i, sh_in in enumerate(sh_inputs):
            if specs[i] is not None and _needs_grad(inputs[i]):
                grad = sh_in.grad
                result[f"gradient of input[{i}]"] = None if grad is None else _gathered(grad)[0]
        if isinstance(module, torch.nn.Module):
            for name, param in module.named_parameters():
                result[f"gradient of parameter {name!r}"] = _param_grad(name, param, params, mismatches)
        steps.append(result)
    return steps


def _check_compiled(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    specs: Sequence[ShardSpec | None],
    params: ParamMode,
    kwargs: dict[str, Any],
    seed: int,
    backend: str,
    compare: Callable[..., None],
    tolerances: tuple[float, float, float, float],
    mismatches: list[Mismatch],
) -> None:
    """The sharded steps under ``torch.compile(backend=backend, dynamic=False)`` against the same steps eagerly."""
    rtol, atol, grad_rtol, grad_atol = tolerances
    mesh = next(s for s in specs if s is not None).mesh
    eager_fn = _prepare_callable(fn, mesh, params)
    compiled_fn = _prepare_callable(fn, mesh, params)
    label = f"compiled ({backend})"
    import torch._dynamo  # noqa: PLC0415 - only needed here

    torch._dynamo.reset()
    try:
        eager = _sharded_steps(eager_fn, eager_fn, inputs, specs, params, kwargs, seed, mismatches)
        guard = _Guard(label, f"torch.compile(backend={backend!r}, dynamic=False)", mismatches, lambda e: "")
        with guard:
            call = torch.compile(compiled_fn, backend=backend, dynamic=False)
            compiled = _sharded_steps(call, compiled_fn, inputs, specs, params, kwargs, seed, mismatches)
    finally:
        torch._dynamo.reset()
    if guard.failed:
        return
    for k, (got, want) in enumerate(zip(compiled, eager)):
        for what in sorted(set(got) | set(want)):
            is_grad = what.startswith("gradient")
            compare(
                f"{label} step {k}: {what}",
                got.get(what),
                want.get(what),
                grad_rtol if is_grad else rtol,
                grad_atol if is_grad else atol,
            )
