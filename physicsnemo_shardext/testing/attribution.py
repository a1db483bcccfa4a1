"""Errors of the code under test, as mismatches that name the plugin behind them.

A shape, dtype, placement or autograd error raised in the sharded run
(`_is_code_error`; ``MissingShardPatch`` and the framework's own errors propagate
unchanged) is caught by a `_Guard` and recorded as a `Mismatch` naming the stage.
`_Attribution` reads the handler calls a `HandlerRecorder` saw and names the plugins
whose handlers raised, or produced the tensors concerned (`_plugin_label`:
``"plugin (dist==version) for target"``).

Examples:
    >>> mismatches = []
    >>> with _Guard("output", "the sharded forward", mismatches, lambda error: ""):
    ...     raise RuntimeError("The size of tensor a (9) must match the size of tensor b (4)")
    >>> print(mismatches[0].detail)
    the sharded forward raised RuntimeError: The size of tensor a (9) must match the size of tensor b (4)

    Autograd numbers the outputs it was given; only outputs 0 and 2 required grad here:

    >>> _backward_target(RuntimeError("Mismatch in shape: grad_output[1] and output[1]"), [0, 2])
    'gradients (backward from output[2])'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from physicsnemo_shardext.engine.trace import HandlerCall, HandlerRecorder
from physicsnemo_shardext.errors import MissingShardPatch, ShardextError
from physicsnemo_shardext.testing.conformance_report import Mismatch

__all__: list[str] = []


def _is_code_error(error: BaseException) -> bool:
    """Shape, dtype, placement and autograd errors of the code under test (not the framework's own)."""
    if isinstance(error, (MissingShardPatch, ShardextError)):
        return False  # tests rely on these propagating unchanged
    return isinstance(error, (RuntimeError, ValueError, TypeError, IndexError))


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(error).__name__}: {line[:limit]}"


def _plugin_label(call: HandlerCall) -> str | None:
    """``"plugin (dist==version) for target"`` of a recorded call to a plugin's handler, else ``None``."""
    import physicsnemo_shardext
    from physicsnemo_shardext.engine.registry import plugin_of
    from physicsnemo_shardext.targets import describe_target

    plugin = plugin_of(call.handler, physicsnemo_shardext.get_registry())
    return None if plugin is None else f"{plugin.label} for {describe_target(call.target)}"


def _labels(calls: Sequence[HandlerCall]) -> list[str]:
    return list(dict.fromkeys(label for label in map(_plugin_label, calls) if label is not None))


class _Attribution:
    """Names the plugin behind a failure from the handler calls a `HandlerRecorder` saw."""

    def __init__(self, recorder: HandlerRecorder) -> None:
        self.recorder = recorder

    def ran(self) -> list[str]:
        """Every plugin handler that ran in the sharded run."""
        return _labels(self.recorder.calls)

    def producer_of(self, tensor: Any) -> list[str]:
        """The plugin handlers that returned ``tensor``."""
        return _labels([c for c in self.recorder.calls if id(tensor) in c.result_ids])

    def blame(self, phase: str, produced: Sequence[Any] = ()) -> str:
        """A clause naming the plugins: whose handler raised in ``phase``, and who produced ``produced``.

        A handler that only passed an error on (a wrapper of ``torch.autograd.backward``) is
        named with the handlers that built the outputs, so the real culprit is never hidden.
        """
        raised = _labels([c for c in self.recorder.calls if c.phase == phase and c.error is not None])
        producers = list(dict.fromkeys(label for t in produced for label in self.producer_of(t)))
        others = [label for label in (producers or self.ran()) if label not in raised]
        clauses = []
        if raised:
            clauses.append(f"raised in the handler of plugin {', '.join(raised)}")
        if others:
            kind = "produced by the handler of plugin" if producers else "plugin handler(s) that ran:"
            clauses.append(f"{kind} {', '.join(others)}")
        return "; ".join(clauses)


class _Guard:
    """Turn an error of the code under test inside the block into a `Mismatch` (and suppress it)."""

    def __init__(
        self,
        what: str | Callable[[BaseException], str],
        stage: str,
        mismatches: list[Mismatch],
        blame: Callable[[BaseException], str],
    ) -> None:
        self.what, self.stage, self.mismatches, self.blame = what, stage, mismatches, blame
        self.failed = False

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if error is None or not _is_code_error(error):
            return False
        self.failed = True
        clause = self.blame(error)
        detail = f"{self.stage} raised {_first_line(error)}" + (f"; {clause}" if clause else "")
        self.mismatches.append(Mismatch(self.what(error) if callable(self.what) else self.what, detail))
        return True


def _backward_target(error: BaseException, indices: Sequence[int]) -> str:
    """Which output a backward error concerns: autograd names it ``output[k]`` among those passed."""
    found = re.search(r"\boutput\[(\d+)\]", str(error))
    if found and int(found.group(1)) < len(indices):
        return f"gradients (backward from output[{indices[int(found.group(1))]}])"
    return "gradients (backward)"
