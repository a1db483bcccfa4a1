"""Record, op by op, what a sharded forward and backward did: handler, placements, collectives, gathers.

`OpTracer` is a ``TorchFunctionMode``: it sees each torch call the model makes
(``F.conv2d``, ``torch.add``, ``Tensor.reshape`` ...) once, at the top level,
before ShardTensor's ``__torch_function__`` decides who handles it; calls made
*inside* a handler are not seen separately (a mode is switched off while its
own handler runs). For every call with a ShardTensor or DTensor among its
arguments it notes, per *call site* (the op and the first source line outside
torch, PhysicsNeMo's ``domain_parallel`` and this package):

* which handler ran: a plugin's (with its distribution), PhysicsNeMo's
  built-in, or none (the DTensor fallback), from `HandlerRecorder`'s calls;
* whether the output stayed sharded (its placements);
* the collectives and payload bytes this rank issued (`CommCounter`), and
  every all-gather that assembled at least as many elements as a whole sharded
  argument holds (an *activation gather*, `GatherRecorder`);
* the first error, with the op, its configuration and the call site.

Backward is attributed to the forward call site that created each autograd
node: after each call the tracer walks the new part of the graph and hooks its
nodes, so the collectives a node issues in backward are added to its site.

Examples:
    Plain tensors are passed through untouched and not recorded:

    >>> import torch
    >>> tracer, x = OpTracer(), torch.ones(3)
    >>> with tracer:
    ...     y = torch.relu(x)
    >>> tracer.sites, tracer.plain_calls
    ({}, 1)
"""

from __future__ import annotations

import importlib
import linecache
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import physicsnemo.domain_parallel as _domain_parallel
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from physicsnemo_shardext.engine.baseline import handler_origin
from physicsnemo_shardext.engine.trace import HandlerCall, HandlerRecorder
from physicsnemo_shardext.ranks.activation_gathers import GatherRecorder
from physicsnemo_shardext.ranks.comm_accounting import CommCounter
from physicsnemo_shardext.shard_registries import PatchLevel
from physicsnemo_shardext.targets import describe_handler, describe_target

__all__ = ["IGNORED_CALLS", "CallSite", "OpSite", "OpTracer", "describe_call", "find_call_site", "output_layout"]

_DISTRIBUTED = (ShardTensor, DTensor)

# Frames in these directories are machinery, not the user's code: the call site is the
# first frame outside them.
_MACHINERY = tuple(
    str(Path(str(module.__file__)).resolve().parent) + os.sep
    for module in (torch, _domain_parallel, sys.modules[__name__.split(".")[0]])
    if getattr(module, "__file__", None)
)
try:  # an editable install maps the first-party patches to patches/, outside the package's folder
    _patches = importlib.import_module("physicsnemo_shardext.patches")  # mapped from patches/: no stub for mypy
    _MACHINERY += (str(Path(str(_patches.__file__)).resolve().parent) + os.sep,)
except ImportError:  # pragma: no cover - installed without the first-party patches
    pass

#: Names of calls that read attributes or do bookkeeping: never recorded as ops.
IGNORED_CALLS = frozenset(
    {
        "__get__",
        "__set__",
        "__repr__",
        "__format__",
        "__len__",
        "__bool__",
        "__iter__",
        "__hash__",
        "size",
        "dim",
        "ndimension",
        "numel",
        "stride",
        "is_contiguous",
        "element_size",
        "data_ptr",
        "requires_grad_",
        "register_hook",
        "retain_grad",
        "backward",
        "full_tensor",
        "to_local",
        "redistribute",
        "tolist",
        "item",
        "__reduce_ex__",
        "__deepcopy__",
        "storage_offset",
        "is_floating_point",
        "is_complex",
        "get_device",
        "type",
        "__contains__",
    }
)


@dataclass(frozen=True)
class CallSite:
    """Where the user's code made a call: file, line, function and the source text."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


def find_call_site(skip: tuple[str, ...] = _MACHINERY) -> CallSite | None:
    """The innermost frame of the calling stack outside ``skip`` (directory prefixes).

    Examples:
        >>> find_call_site(skip=()).function
        'find_call_site'
    """
    frame = sys._getframe(0)
    while frame is not None:
        filename = frame.f_code.co_filename
        resolved = filename if filename.startswith("<") else os.path.realpath(filename)
        if not resolved.startswith(skip) and not filename.startswith("<frozen"):
            code = linecache.getline(filename, frame.f_lineno).strip()
            return CallSite(filename, frame.f_lineno, frame.f_code.co_name, code)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def describe_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A one-line configuration of a call: tensors as shape, dtype and placements; other values as repr.

    Examples:
        >>> import torch
        >>> describe_call((torch.ones(2, 3),), {"dim": 1})
        'Tensor[2, 3] float32, dim=1'
    """
    parts = [_describe_value(value) for value in args]
    parts += [f"{key}={_describe_value(value)}" for key, value in kwargs.items()]
    return ", ".join(parts)


def _describe_value(value: Any) -> str:
    if isinstance(value, _DISTRIBUTED):
        placements = ", ".join(_placement_name(p) for p in value.placements)
        dtype = str(value.dtype).replace("torch.", "")
        return f"{type(value).__name__}[{', '.join(map(str, value.shape))}] {dtype} ({placements})"
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"Tensor[{', '.join(map(str, value.shape))}] {dtype}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        inner = ", ".join(_describe_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _placement_name(placement: Any) -> str:
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    return str(placement)


def _sharded_numel(value: Any) -> int:
    """The global size of the largest sharded floating-point tensor in ``value`` (0 if none)."""
    sizes = [
        leaf.numel()
        for leaf in _distributed_leaves(value)
        if leaf.is_floating_point() and any(isinstance(p, Shard) for p in leaf.placements)
    ]
    return max(sizes, default=0)


def _whole_activation(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    biggest_input = _sharded_numel((args, kwargs))
    outputs = [leaf.numel() for leaf in _distributed_leaves(result)]
    return biggest_input > 0 and max(outputs, default=0) * 2 >= biggest_input


def _distributed_leaves(value: Any) -> list[Any]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, _DISTRIBUTED)]


def output_layout(result: Any) -> tuple[str, str]:
    """``(kind, placements)`` of a call's result: kind is sharded, replicated, partial, plain or none.

    Examples:
        >>> import torch
        >>> output_layout(torch.ones(2)), output_layout(3)
        (('plain', ''), ('none', ''))
    """
    leaves = [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        return "none", ""
    distributed = [leaf for leaf in leaves if isinstance(leaf, _DISTRIBUTED)]
    if not distributed:
        return "plain", ""
    if all(leaf.dim() == 0 for leaf in distributed):
        return "scalar", ""
    placements = [p for leaf in distributed for p in leaf.placements]
    text = "; ".join("(" + ", ".join(_placement_name(p) for p in leaf.placements) + ")" for leaf in distributed)
    if any(isinstance(p, Partial) for p in placements):
        return "partial", text
    if any(isinstance(p, Shard) for p in placements):
        return "sharded", text
    return "replicated", text


@dataclass
class OpSite:
    """Everything recorded for one call site (one op at one source line), over all its calls."""

    index: int
    op: str
    site: CallSite | None
    calls: int = 0
    handler: str = ""
    provider_kind: str = ""  # plugin, physicsnemo, external, dtensor
    provider: str = ""  # the plugin's name and distribution, or a description
    output: str = ""
    placements: str = ""
    forward_collectives: int = 0
    forward_bytes: int = 0
    backward_collectives: int = 0
    backward_bytes: int = 0
    gathers: int = 0
    gathered_elements: int = 0
    error: str | None = None
    configuration: str = ""
    collective_names: dict[str, int] = field(default_factory=dict)

    #: Calls whose sharded input came back as a replicated tensor at least half its size: every rank
    #: now holds (about) the whole activation. A small replicated result (the slice tokens of a
    #: contraction over the sharded dim, a loss) is what sharding promises and is not counted.
    replicated_calls: int = 0

    @property
    def stayed_sharded(self) -> bool:
        """Whether no call turned a sharded activation into a whole replicated one."""
        return self.replicated_calls == 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the ``ops`` entries of the verify report)."""
        site = (
            None
            if self.site is None
            else {
                "file": self.site.file,
                "line": self.site.line,
                "function": self.site.function,
                "code": self.site.code,
            }
        )
        return {
            "index": self.index,
            "op": self.op,
            "site": site,
            "calls": self.calls,
            "handler": self.handler,
            "provider_kind": self.provider_kind,
            "provider": self.provider,
            "output": self.output,
            "placements": self.placements,
            "stayed_sharded": self.stayed_sharded,
            "replicated_calls": self.replicated_calls,
            "forward": {"collectives": self.forward_collectives, "bytes": self.forward_bytes},
            "backward": {"collectives": self.backward_collectives, "bytes": self.backward_bytes},
            "collectives": dict(self.collective_names),
            "activation_gathers": self.gathers,
            "gathered_elements": self.gathered_elements,
            "error": self.error,
            "configuration": self.configuration,
        }


class _SiteCounter(CommCounter):  # type: ignore[no-untyped-call]
    """A `CommCounter` that also keeps the all-gathers (one dispatch mode instead of two)."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers = GatherRecorder()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if result is not NotImplemented:
            from physicsnemo_shardext.ranks.activation_gathers import _classify

            record = _classify(func, args, result)
            if record is not None:
                self.gathers.records.append(record)
        return result


class OpTracer(TorchFunctionMode):
    """Record every top-level torch call on distributed tensors, by call site (see the module docstring).

    Args:
        provider_of: maps a handler to ``(kind, description)``; the default names
            PhysicsNeMo's built-ins and everything else by module.
        on_call: called after every recorded call with the number of calls so far
            (a progress bar).
    """

    def __init__(
        self,
        provider_of: Callable[[Any], tuple[str, str]] | None = None,
        on_call: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self.sites: dict[tuple[str, str, int], OpSite] = {}
        self.plain_calls = 0
        self.calls = 0
        self.first_error: OpSite | None = None
        self._provider_of = provider_of or _default_provider
        self._on_call = on_call
        self._recorder = HandlerRecorder()
        self._node_site: dict[Any, OpSite] = {}
        self._backward_counter: CommCounter | None = None
        self._backward_site: OpSite | None = None
        self._backward_mark: tuple[int, int, dict[str, int]] = (0, 0, {})  # totals when the running node started
        self.site_override: CallSite | None = None  # set by a harness for calls it makes itself

    # -- forward ------------------------------------------------------------------------
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in IGNORED_CALLS or not _distributed_leaves((args, kwargs)):
            if name not in IGNORED_CALLS:
                self.plain_calls += 1
            return func(*args, **kwargs)
        site = self._site_for(func)
        site.calls += 1
        before = len(self._recorder.calls)
        counter = _SiteCounter()
        try:
            with self._recorder.recording("forward"), counter:
                result = func(*args, **kwargs)
        except BaseException as error:
            self._note_handler(site, self._recorder.calls[before:])
            self._note_error(site, error, args, kwargs)
            raise
        self._note_handler(site, self._recorder.calls[before:])
        self._note_comms(site, counter, args, kwargs)
        kind, placements = output_layout(result)
        site.output = kind if not site.output or site.output == kind else "mixed"
        site.placements = placements
        if kind == "replicated" and _whole_activation(result, args, kwargs):
            site.replicated_calls += 1
        self._own_new_nodes(result, site)
        self.calls += 1
        if self._on_call is not None:
            self._on_call(self.calls)
        return result

    def _site_for(self, func: Any) -> OpSite:
        call_site = self.site_override or find_call_site()
        op = _op_name(func)
        key = (op, call_site.file if call_site else "", call_site.line if call_site else 0)
        if key not in self.sites:
            self.sites[key] = OpSite(len(self.sites), op, call_site)
        return self.sites[key]

    def _note_handler(self, site: OpSite, calls: list[HandlerCall]) -> None:
        if site.handler:
            return
        function_calls = [c for c in calls if c.level in (PatchLevel.FUNCTION, PatchLevel.NAMED)]
        dispatch_calls = [c for c in calls if c.level is PatchLevel.DISPATCH]
        if function_calls:
            outer = function_calls[-1]  # appended when it ends: the outermost ends last
            site.handler = describe_handler(outer.handler)
            site.provider_kind, site.provider = self._provider_of(outer.handler)
        elif dispatch_calls:
            names = sorted({describe_target(c.target) for c in dispatch_calls})
            providers = sorted({self._provider_of(c.handler) for c in dispatch_calls})
            site.handler = "dispatch: " + ", ".join(names)
            site.provider_kind = providers[0][0]
            site.provider = ", ".join(p[1] for p in providers)
        else:
            site.handler = "DTensor fallback"
            site.provider_kind, site.provider = "dtensor", "torch.distributed.tensor"

    def _note_error(self, site: OpSite, error: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if site.error is None:
            site.error = f"{type(error).__name__}: {error}".strip()
            site.configuration = describe_call(args, kwargs)
        if self.first_error is None:
            self.first_error = site

    def _note_comms(self, site: OpSite, counter: _SiteCounter, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        site.forward_collectives += counter.stats.total_calls
        site.forward_bytes += counter.stats.total_bytes
        for key, count in counter.stats.counts.items():
            site.collective_names[key] = site.collective_names.get(key, 0) + count
        whole = [
            leaf.numel()
            for leaf in _distributed_leaves((args, kwargs))
            if leaf.is_floating_point() and any(isinstance(p, Shard) for p in leaf.placements)
        ]
        if whole:
            threshold = max(min(whole), 2)
            for record in counter.gathers.activation_gathers(threshold):
                site.gathers += 1
                site.gathered_elements = max(site.gathered_elements, record.gathered_numel)

    # -- backward attribution -------------------------------------------------------------
    def _own_new_nodes(self, result: Any, site: OpSite) -> None:
        stack = [leaf.grad_fn for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor) and leaf.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in self._node_site or type(node).__name__ == "AccumulateGrad":
                continue
            self._node_site[node] = site
            node.register_prehook(self._node_started(site))
            node.register_hook(self._node_ended(site))
            stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)

    def _node_started(self, site: OpSite) -> Callable[..., None]:
        def started(*_: Any) -> None:
            if self._backward_counter is not None:
                stats = self._backward_counter.stats
                self._backward_mark = (stats.total_calls, stats.total_bytes, dict(stats.counts))
                self._backward_site = site

        return started

    def _node_ended(self, site: OpSite) -> Callable[..., None]:
        def ended(*_: Any) -> None:
            counter = self._backward_counter
            if counter is None or self._backward_site is not site:
                return
            calls, nbytes, counts = self._backward_mark
            site.backward_collectives += counter.stats.total_calls - calls
            site.backward_bytes += counter.stats.total_bytes - nbytes
            for key, count in counter.stats.counts.items():
                extra = count - counts.get(key, 0)
                if extra:
                    site.collective_names[key] = site.collective_names.get(key, 0) + extra
            self._backward_mark = (counter.stats.total_calls, counter.stats.total_bytes, dict(counter.stats.counts))

        return ended

    def backward(self, loss: torch.Tensor, grad: torch.Tensor | None = None) -> CommCounter:
        """Run ``loss.backward()`` attributing collectives to sites; returns the whole pass's counter.

        Call it outside the ``with tracer`` block. If backward raises, the site
        whose node was running is given the error (and becomes ``first_error``).
        """
        counter = CommCounter()
        self._backward_counter = counter
        try:
            with counter:
                loss.backward(grad)  # type: ignore[no-untyped-call]
        except BaseException as error:
            site = self._backward_site
            if site is not None:
                site.error = site.error or f"{type(error).__name__} in backward: {error}".strip()
                if self.first_error is None:
                    self.first_error = site
            raise
        finally:
            self._backward_counter = None
        return counter

    def ordered_sites(self) -> list[OpSite]:
        """The call sites in the order they were first called."""
        return sorted(self.sites.values(), key=lambda s: s.index)


def _op_name(func: Any) -> str:
    try:
        name = describe_target(func)
    except Exception:  # an exotic callable: its repr still tells the user what it is
        return repr(func)
    # torch.fft's functions live in a private C module; show the name users call.
    return name.replace("torch._C._fft.fft_", "torch.fft.")


def _default_provider(handler: Any) -> tuple[str, str]:
    origin = handler_origin(handler)
    if origin == "physicsnemo":
        return "physicsnemo", "PhysicsNeMo built-in"
    return "external", origin


def registry_provider(registry: Any) -> Callable[[Any], tuple[str, str]]:
    """A ``provider_of`` for `OpTracer` that names the plugin (and distribution) behind a handler."""
    from physicsnemo_shardext.engine.trace import untraced
    from physicsnemo_shardext.tools.inventory import plugin_index

    index = plugin_index(registry)

    def provider_of(handler: Any) -> tuple[str, str]:
        plugin = index.get(id(untraced(handler)))
        if plugin is not None:
            return "plugin", f"{plugin.name} ({plugin.distribution}=={plugin.version or '?'})"
        return _default_provider(handler)

    return provider_of


def iter_errors(sites: Iterable[OpSite]) -> list[OpSite]:
    """The sites that raised, in call order."""
    return [site for site in sorted(sites, key=lambda s: s.index) if site.error]
