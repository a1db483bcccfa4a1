"""The installed torch: the one place where the code asks which torch it runs on.

Torch releases differ in what DTensor's fallback does with a ShardTensor (which ops have
a sharding strategy, which keep an uneven split, which refuse to redistribute). Code
that depends on such a difference asks here, by *feature probe* where one can tell
(`has_dtensor_strategy`, `has_local_tensor_mode`) and by *release* only where none can
(`torch_release`, `torch_in`).

A release is compared without its pre-release and local tags: NVIDIA's container builds
report torch as ``2.14.0a0+<hash>.nv26.08``, which is 2.14's code, not something older
than 2.14.0, so ``torch_in(">=2.14")`` holds there.

Examples:
    >>> str(torch_release("2.14.0a0+3bcc3cd.nv26.08"))
    '2.14.0'
    >>> torch_in(">=2.12,<2.16", "2.13.0a0+git")
    True
    >>> torch_in("<2.15", "2.15.0")
    False
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "compiles_empty_shards",
    "declared_torch_range",
    "has_dtensor_strategy",
    "has_local_tensor_mode",
    "support_report",
    "torch_in",
    "torch_release",
]

#: The distribution whose metadata declares the supported torch range.
_DISTRIBUTION = "physicsnemo-shardext"


def _installed_torch() -> str:
    import torch

    return str(torch.__version__)


def torch_release(version: str | None = None) -> Version:
    """The release of ``version`` (default: the installed torch), pre-release and local tags dropped."""
    return Version(Version(version or _installed_torch()).base_version)


def torch_in(specifier: str, version: str | None = None) -> bool:
    """Whether the torch release (see `torch_release`) lies in the PEP 440 ``specifier``."""
    return SpecifierSet(specifier).contains(torch_release(version), prereleases=True)


@functools.cache
def declared_torch_range() -> str | None:
    """The torch range this package's metadata declares (``">=2.12.0a0,<2.16"``), or ``None``."""
    try:
        requirements = metadata.requires(_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name == "torch" and requirement.marker is None:
            return str(requirement.specifier)
    return None


def has_dtensor_strategy(op: Any) -> bool:
    """Whether DTensor's sharding propagator has a strategy of its own for the aten overload ``op``.

    Ops without one make DTensor's fallback fail (or, under a ShardTensor, gather); a
    newer torch adds strategies, so a handler written for a missing one can ask here.

    Examples:
        >>> import torch
        >>> has_dtensor_strategy(torch.ops.aten.add.Tensor)
        True
    """
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = [
        getattr(propagator, name, None) for name in ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs")
    ]
    return any(isinstance(table, dict) and op in table for table in tables)


def has_local_tensor_mode() -> bool:
    """Whether ``torch.distributed._local_tensor.LocalTensorMode`` exists (torch 2.13 and newer)."""
    try:
        from torch.distributed._local_tensor import LocalTensorMode  # noqa: F401
    except ImportError:
        return False
    return True


def compiles_empty_shards(version: str | None = None) -> bool:
    """Whether ``torch.compile`` traces a ShardTensor whose local block on some rank is empty.

    No probe can tell without compiling: measured on 4 CPU ranks (rows 3/2/4/0), torch 2.13's
    Dynamo fails on the empty rank alone ("Attempted to set the storage of a tensor on device
    cpu to a storage on different device meta") while the other ranks wait in a collective
    (a hang); torch 2.14.1 and 2.15.0 compile and match single-process.
    """
    return torch_in(">=2.14", version)


def support_report() -> dict[str, Any]:
    """What ``shardext doctor`` prints about torch: version, release, the declared range and whether it holds."""
    declared = declared_torch_range()
    version = _installed_torch()
    return {
        "torch": version,
        "release": str(torch_release(version)),
        "declared": declared,
        "in_declared_range": None if declared is None else torch_in(declared, version),
        "local_tensor_mode": has_local_tensor_mode(),
    }
