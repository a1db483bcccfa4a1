"""Metadata reads on the wrapper: ``x.shape``, ``x.dim()``, ``x.dtype``... without the DTensor fallback.

PhysicsNeMo 2.2 sends them through the fallback (a conversion round trip per read)
although the ShardTensor wrapper holds the same global values; `METADATA_GETTERS` joins
ShardTensor's ``_autograd_passthrough_functions`` (`PASSTHROUGH_WITH_METADATA`), which
PhysicsNeMo runs directly on the wrapper, where `metadata_passthrough_applies`.
"""

from __future__ import annotations

from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor

__all__ = ["METADATA_GETTERS", "PASSTHROUGH_WITH_METADATA", "metadata_passthrough_applies"]

_PASSTHROUGH = "_autograd_passthrough_functions"
_T = torch.Tensor
#: What ``x.shape``, ``x.ndim``, ``x.dim()``, ``x.size()``... hand to ``__torch_function__``. The
#: wrapper ShardTensor is built with the global shape, the local dtype and device, so these
#: answer exactly what the DTensor the fallback would build answers.
METADATA_GETTERS: frozenset[Any] = frozenset(
    {
        _T.shape.__get__,
        _T.ndim.__get__,
        _T.dtype.__get__,
        _T.device.__get__,
        _T.layout.__get__,
        _T.is_cuda.__get__,
        _T.dim,
        _T.ndimension,
        _T.size,
        _T.numel,
        _T.nelement,
        _T.is_floating_point,
        _T.is_complex,
        _T.element_size,
    }
)
PASSTHROUGH_WITH_METADATA: frozenset[Any] = (
    frozenset(getattr(ShardTensor, _PASSTHROUGH, frozenset())) | METADATA_GETTERS
)


def metadata_passthrough_applies() -> bool:
    """Whether this PhysicsNeMo has the passthrough set (2.2 does) and sends metadata reads to the fallback.

    Examples:
        >>> METADATA_GETTERS <= ShardTensor._autograd_passthrough_functions   # installed: applied already
        True
        >>> import physicsnemo_shardext
        >>> with physicsnemo_shardext.disabled(plugins=["fallback_fix"]):
        ...     metadata_passthrough_applies()
        True
    """
    held = getattr(ShardTensor, _PASSTHROUGH, None)
    return isinstance(held, frozenset) and not METADATA_GETTERS <= held
