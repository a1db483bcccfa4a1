"""What a conformance check reports: the mismatches it found, the error it raises, the report it returns.

A `Mismatch` is one failed comparison; `_merge` folds the mismatches of all ranks into
one list (the same mismatch on several ranks becomes one entry naming them);
`ConformanceError` (an ``AssertionError``) carries that list and the plugins whose
handlers ran; a passing `check_conformance` returns a `ConformanceReport`.

Examples:
    >>> seen = [Mismatch("output[0]", "shape (3,) != reference (4,)")]
    >>> (merged,) = _merge([seen, seen])          # the same on ranks 0 and 1: one entry
    >>> merged.describe()
    'output[0]: shape (3,) != reference (4,) (rank(s) [0, 1])'
    >>> str(ConformanceReport())
    'conformant (worst abs error 0.00e+00, worst rel error 0.00e+00); comms None'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Placement

from physicsnemo_shardext.comparison import Comparison
from physicsnemo_shardext.ranks.comm_accounting import PhaseCommStats

__all__ = ["ConformanceError", "ConformanceReport", "Mismatch"]


@dataclass(frozen=True)
class Mismatch:
    """One failed comparison: ``what`` (e.g. ``"gradient of parameter 'weight'"``), where and by how much.

    ``comparison`` is the `Comparison` of a tensor outside its tolerance (the worst over the ranks).

    Examples:
        >>> Mismatch("output[0]", "shape (3,) != reference (4,)", ranks=(0,)).describe()
        'output[0]: shape (3,) != reference (4,) (rank(s) [0])'
    """

    what: str
    detail: str
    max_abs_error: float | None = None
    ranks: tuple[int, ...] = ()
    comparison: Comparison | None = None

    def describe(self) -> str:
        """One line for the error message."""
        error = "" if self.max_abs_error is None else f"max abs error {self.max_abs_error:.3e}; "
        found = self.comparison
        if found is not None:
            where = f", worst at {list(found.worst_index)}" if found.worst_index else ""
            error = (
                f"max abs error {found.max_abs_error:.3e}, max rel error {found.max_rel_error:.3e}{where} "
                f"({found.mismatched} of {found.numel} elements outside); "
            )
        return f"{self.what}: {error}{self.detail} (rank(s) {list(self.ranks)})"


class ConformanceError(AssertionError):
    """The sharded run differs from the reference; ``mismatches`` lists every difference.

    ``plugins`` names the plugin handlers that ran in the sharded run (``"label for target"``).

    Examples:
        >>> print(ConformanceError([Mismatch("output[0]", "shape (3,) != reference (4,)", ranks=(0, 1))],
        ...                        plugins=["demo (demo-dist==1.0) for torch.tanh"]))
        sharded run does not match the single-process reference:
          - output[0]: shape (3,) != reference (4,) (rank(s) [0, 1])
          plugin handlers that ran: demo (demo-dist==1.0) for torch.tanh
    """

    def __init__(self, mismatches: Sequence[Mismatch], context: str = "", plugins: Sequence[str] = ()) -> None:
        self.mismatches = list(mismatches)
        self.plugins = list(plugins)
        lines = [f"sharded run does not match the single-process reference{context}:"]
        lines += [f"  - {m.describe()}" for m in self.mismatches]
        if self.plugins:
            lines.append(f"  plugin handlers that ran: {', '.join(self.plugins)}")
        super().__init__("\n".join(lines))


@dataclass
class ConformanceReport:
    """What a passing check measured on this rank."""

    max_abs_errors: dict[str, float] = field(default_factory=dict)
    #: Every compared tensor's `Comparison` on this rank (both errors, worst element), by name.
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    output_placements: list[tuple[Placement, ...] | None] = field(default_factory=list)
    comms: PhaseCommStats | None = None
    #: ``(device_type, dtype)`` when the check ran under ``torch.autocast``, else ``None``.
    autocast: tuple[str, torch.dtype] | None = None
    #: Under autocast: max abs error of the single-process autocast run against the same
    #: run in full precision, per compared tensor (what the tolerances are derived from).
    autocast_reference_errors: dict[str, float] = field(default_factory=dict)
    #: Under autocast: the ``atol`` each tensor was compared with.
    autocast_atols: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        worst = max(self.max_abs_errors.values(), default=0.0)
        relative = max((c.max_rel_error for c in self.comparisons.values()), default=0.0)
        under = "" if self.autocast is None else f" under {_describe_autocast(self.autocast)}"
        return f"conformant{under} (worst abs error {worst:.2e}, worst rel error {relative:.2e}); comms {self.comms}"


def _describe_autocast(autocast: tuple[str, torch.dtype]) -> str:
    return f"torch.autocast({autocast[0]!r}, dtype={autocast[1]})"


def _merge(per_rank: list[list[Mismatch]]) -> list[Mismatch]:
    merged: dict[tuple[str, str], Mismatch] = {}
    for rank, mismatches in enumerate(per_rank):
        for m in mismatches:
            key = (m.what, m.detail)
            previous = merged.get(key)
            if previous is None:
                merged[key] = Mismatch(m.what, m.detail, m.max_abs_error, (rank,), m.comparison)
            else:
                errors = [e for e in (previous.max_abs_error, m.max_abs_error) if e is not None]
                found = [c for c in (previous.comparison, m.comparison) if c is not None]
                worst = max(found, key=lambda c: (c.max_abs_error, c.worst_ratio)) if found else None
                merged[key] = Mismatch(
                    m.what, m.detail, max(errors) if errors else None, previous.ranks + (rank,), worst
                )
    return list(merged.values())
