"""The dtype a composed computation returns under ``torch.autocast``, as the op it replaces would.

A handler that composes an op from smaller ones (a sharded softmax from a max, an exp
and an all-reduced sum) bypasses the op's own autocast rule. On CUDA, autocast runs
``softmax``, ``log_softmax``, ``layer_norm``, ``group_norm``, ``rms_norm``, ``cumsum``,
``sum`` and the losses in float32 and returns float32 for bf16/fp16 inputs; on CPU
most of them have no rule and keep the input's dtype. Which ops have a rule differs
by device type and torch release, so this asks the dispatcher (does the op have a
kernel for the device's autocast key?) rather than keeping a list. For the ops above
a rule is always "compute and return float32": the question is only whether one exists.

Examples:
    Outside autocast, or for float32 input, nothing changes:

    >>> import torch
    >>> autocast_float32("aten::softmax.int", torch.ones(2, dtype=torch.bfloat16))
    False
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_float32("aten::softmax.int", torch.ones(2, dtype=torch.bfloat16))  # no CPU rule
    False
"""

from __future__ import annotations

import functools

import torch

__all__ = ["autocast_float32", "output_dtype_under_autocast"]

_REDUCED_PRECISION = (torch.bfloat16, torch.float16)


@functools.cache
def _has_autocast_rule(op_name: str, device_type: str) -> bool:
    key = f"Autocast{device_type.upper()}"
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key))
    except RuntimeError:  # no such dispatch key or operator in this torch
        return False


def autocast_float32(op_name: str, local: torch.Tensor) -> bool:
    """Whether ``op_name`` (an aten name, ``"aten::layer_norm"``) would run ``local`` in float32 here.

    True under an enabled autocast of ``local``'s device type, for a bf16/fp16 ``local``,
    where the op has an autocast rule for that device type.
    """
    device_type = local.device.type
    if local.dtype not in _REDUCED_PRECISION or not torch.amp.autocast_mode.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type) and _has_autocast_rule(op_name, device_type)


def output_dtype_under_autocast(op_name: str, local: torch.Tensor) -> torch.dtype:
    """The dtype ``op_name`` returns for ``local``: float32 where autocast runs it so, else ``local``'s."""
    return torch.float32 if autocast_float32(op_name, local) else local.dtype
