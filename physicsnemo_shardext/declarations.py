"""What a plugin hands back: patch declarations, collected by a ``PatchSet``.

Plugins never write into ShardTensor. Their ``shardext_declare_patches`` hook
receives a `PatchSet` and *declares* patches on it; each declaration is
validated on the spot (target exists, level fits, handler signature fits) so
an error points at the plugin's own line. The framework installs the whole
set later, or nothing of it.

Examples:
    >>> import torch
    >>> patches = PatchSet(plugin="demo")
    >>> def roll_handler(func, types, args, kwargs): ...
    >>> patches.function(torch.roll, roll_handler, priority=5)
    >>> [(d.target_name, d.level.value, d.priority) for d in patches]
    [('torch.roll', 'function', 5)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from packaging.specifiers import InvalidSpecifier

from physicsnemo_shardext.errors import InvalidPatchDeclaration
from physicsnemo_shardext.shard_registries import AttributeTarget, PatchLevel, SlotKey
from physicsnemo_shardext.targets import describe_target, lookup_keys, resolve_slot, validate_handler
from physicsnemo_shardext.torch_support import torch_in

__all__ = ["DispatchHandler", "FunctionHandler", "PatchDeclaration", "PatchSet"]

#: A ``__torch_function__``-level handler (``patches.function`` / ``patches.named``):
#: called as ``handler(func, types, args, kwargs)`` with the call exactly as the user
#: wrote it; returns the result (usually a ShardTensor).
FunctionHandler = Callable[[Callable[..., Any], tuple[type, ...], tuple[Any, ...], dict[str, Any]], Any]

#: A ``__torch_dispatch__``-level handler (``patches.dispatch``): called with the aten
#: op's own arguments, ``handler(*args, **kwargs)``.
DispatchHandler = Callable[..., Any]


@dataclass(frozen=True)
class PatchDeclaration:
    """One validated claim: "call ``handler`` for ``target`` at ``level``".

    Attributes:
        target: the registry key (callable, op name or OpOverload).
        level: where ShardTensor consults the handler.
        handler: the plugin's own function; installed as is (no wrapper).
        priority: higher wins when several plugins claim one target.
        override: the plugin knowingly replaces a PhysicsNeMo built-in.
        description: one line for ``shardext list``.
        alias_of: ``None`` for a declaration the plugin made; for the copy the registry
            installs under a torch alias nobody declared (``torch.concat`` for a
            declaration of ``torch.cat``, see `physicsnemo_shardext.engine.aliases`), the target
            the plugin declared.
    """

    target: Any
    level: PatchLevel
    handler: Callable[..., Any]
    priority: int = 0
    override: bool = False
    description: str = ""
    alias_of: Any = None

    @property
    def target_name(self) -> str:
        """Readable name of the target, e.g. ``torch.nn.functional.gelu``."""
        return describe_target(self.target)

    @property
    def key(self) -> tuple[PatchLevel, Any]:
        """Identity of the registry slot this declaration claims."""
        return (self.level, self.target)

    @property
    def slots(self) -> tuple[SlotKey, ...]:
        """Every slot the handler is installed in: `key` first, then the other keys of the same op.

        A custom op's only overload is also looked up under its packet's name
        (``"mylib.op"`` for ``torch.ops.mylib.op(x)``), so one declaration
        fills both; every other declaration fills its `key` alone.
        """
        return tuple((self.level, key) for key in lookup_keys(self.target, self.level))


def _first_doc_line(handler: Callable[..., Any]) -> str:
    """First line of a handler's docstring, or ``""``."""
    lines = (getattr(handler, "__doc__", None) or "").strip().splitlines()
    return lines[0] if lines else ""


class PatchSet:
    """The registry object handed to a plugin's ``shardext_declare_patches`` hook.

    Use `function`, `dispatch` or `named` (or `declare`,
    which infers the level from the target's type), and `replace_attribute`
    to correct an attribute of a PhysicsNeMo class. Declaring the same target
    twice in one plugin is an error.

    Attributes:
        not_applicable: ``(target name, reason)`` of attribute replacements whose
            ``applies`` check said this environment does not need them.
    """

    def __init__(self, plugin: str) -> None:
        self.plugin = plugin
        self._declarations: dict[tuple[PatchLevel, Any], PatchDeclaration] = {}
        self.not_applicable: list[tuple[str, str]] = []

    def declare(
        self,
        target: Any,
        handler: Callable[..., Any],
        *,
        level: PatchLevel | str | None = None,
        priority: int = 0,
        override: bool = False,
        description: str = "",
        needed_on_torch: str | None = None,
    ) -> None:
        """Declare a patch; raises `InvalidPatchDeclaration` naming plugin and target.

        ``needed_on_torch`` (a PEP 440 range such as ``"<2.15"``) says on which torch
        releases the patch is needed: elsewhere (a newer torch keeps the op sharded and
        correct through DTensor) it is not declared and `not_applicable` records why, so
        ``shardext doctor`` can say that it stepped aside.

        Examples:
            >>> patches = PatchSet("demo")
            >>> def handler(func, types, args, kwargs): ...
            >>> patches.declare(torch.roll, handler, needed_on_torch="<1.0")
            >>> len(patches), patches.not_applicable[0][1].startswith("needed on torch<1.0 only")
            (0, True)
        """
        name = describe_target(target)
        if needed_on_torch is not None:
            try:
                needed = torch_in(needed_on_torch)
            except InvalidSpecifier:
                raise InvalidPatchDeclaration(
                    self.plugin, name, f"needed_on_torch={needed_on_torch!r} is not a version range"
                ) from None
            if not needed:
                self.not_applicable.append(
                    (name, f"needed on torch{needed_on_torch} only; torch {torch.__version__} handles it without")
                )
                return
        try:
            resolved_level, key = resolve_slot(target, level)
            name = describe_target(key)
            validate_handler(handler, resolved_level, key)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise ValueError(f"priority must be an int, got {priority!r}")
        except ValueError as error:
            raise InvalidPatchDeclaration(self.plugin, name, str(error)) from None
        if (resolved_level, key) in self._declarations:
            raise InvalidPatchDeclaration(self.plugin, name, "declared twice by the same plugin")
        self._declarations[(resolved_level, key)] = PatchDeclaration(
            target=key,
            level=resolved_level,
            handler=handler,
            priority=priority,
            override=override,
            description=description or _first_doc_line(handler),
        )

    def function(self, target: Any, handler: FunctionHandler, **options: Any) -> None:
        """Declare a ``__torch_function__`` handler ``handler(func, types, args, kwargs)``.

        A custom op given here is declared at the named level, as by `named`.
        """
        self.declare(target, handler, level=PatchLevel.FUNCTION, **options)

    def dispatch(self, target: Any, handler: DispatchHandler, **options: Any) -> None:
        """Declare a ``__torch_dispatch__`` handler for an aten OpOverload.

        A custom op reaches ``__torch_dispatch__`` only below ``__torch_function__``
        (code traced by ``torch.compile``); for its eager calls declare it with `named`.
        """
        self.declare(target, handler, level=PatchLevel.DISPATCH, **options)

    def named(self, target: Any, handler: FunctionHandler, **options: Any) -> None:
        """Declare a ``__torch_function__`` handler for a custom op, ``handler(func, types, args, kwargs)``.

        ``target`` may be any form of the op, and all of them claim the same
        slot: the ``CustomOpDef`` that ``torch.library.custom_op`` returns,
        ``torch.ops.mylib.op``, ``torch.ops.mylib.op.default``, ``"mylib::op"``
        or ``"mylib.op.default"``. The handler then runs for every way of
        calling the op: ``torch.ops.mylib.op(x)``, ``torch.ops.mylib.op.default(x)``
        and the ``CustomOpDef`` itself (``func`` is the packet for the first
        call form, the overload for the other two). `declare` and `function`
        treat a custom op the same way.

        Examples:
            >>> import torch
            >>> patches = PatchSet("demo")
            >>> def flip_handler(func, types, args, kwargs): ...
            >>> patches.named("aten::flip.default", flip_handler)
            >>> [(d.target_name, d.level.value) for d in patches]
            [('aten.flip.default', 'named')]
        """
        self.declare(target, handler, level=PatchLevel.NAMED, **options)

    def replace_attribute(
        self,
        owner: Any,
        name: str,
        replacement: Any,
        *,
        reason: str,
        applies: Callable[[], bool] | None = None,
        priority: int = 0,
    ) -> bool:
        """Declare that ``owner.name`` (a class or module attribute) is replaced by ``replacement``.

        Meant for corrections of PhysicsNeMo internals that no handler table can
        reach (e.g. an autograd Function's ``backward``). The replacement is
        installed, recorded, listed, resolved against other claims and undone
        exactly like a handler. ``reason`` (required) says why, for ``shardext
        list``. ``applies`` is called once, now: if it returns False the
        replacement is not declared (recorded in `not_applicable`), so a fix
        is active only where the defect exists. Returns whether it was declared.

        Examples:
            >>> class Owner:
            ...     @staticmethod
            ...     def backward(ctx, grad):
            ...         return grad
            >>> patches = PatchSet("demo")
            >>> patches.replace_attribute(Owner, "backward", staticmethod(lambda ctx, g: 2 * g),
            ...                           reason="doubles the gradient", applies=lambda: True)
            True
            >>> [(d.level.value, d.target_name.split(".")[-2:]) for d in patches]
            [('attribute', ['Owner', 'backward'])]
        """
        target = AttributeTarget(owner, name)
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidPatchDeclaration(self.plugin, str(target), "replace_attribute needs a non-empty reason")
        if applies is not None:
            try:
                needed = bool(applies())
            except Exception as error:  # a probe that cannot decide must not install blindly
                raise InvalidPatchDeclaration(
                    self.plugin, str(target), f"its applies() check raised {type(error).__name__}: {error}"
                ) from error
            if not needed:
                self.not_applicable.append((str(target), reason))
                return False
        self.declare(target, replacement, level=PatchLevel.ATTRIBUTE, priority=priority, description=reason)
        return True

    def __iter__(self) -> Iterator[PatchDeclaration]:
        return iter(self._declarations.values())

    def __len__(self) -> int:
        return len(self._declarations)
