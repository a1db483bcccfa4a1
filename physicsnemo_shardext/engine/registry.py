"""The framework's registry: installs resolved plugin patches into ShardTensor, with provenance.

`PatchRegistry` holds every loaded plugin's declarations, resolves one
winner per registry slot (see `physicsnemo_shardext.engine.resolution`), and
writes exactly the winning handlers into ShardTensor's registries. Because the
desired state is recomputed from the full set of claims on every change,
install order never matters, and removing plugins puts back, slot by slot,
exactly what ShardTensor held before the framework first touched that slot.

A function-level declaration also claims every torch alias of its target that
no plugin declares (``torch.concat`` and ``torch.concatenate`` for ``torch.cat``,
see `physicsnemo_shardext.engine.aliases`): ``__torch_function__`` sees each alias as
a key of its own. Such an *implied* claim is recorded like a declaration
(``declaration.alias_of`` names the declared target), loses to any plugin's
explicit declaration of the alias, leaves a slot that already holds a handler
alone unless the declaration says ``override=True``, and is undone with it.

Examples:
    >>> import torch
    >>> from physicsnemo_shardext.declarations import PatchSet
    >>> from physicsnemo_shardext.engine.provenance import PluginInfo
    >>> registry = PatchRegistry()
    >>> before = shard_registries.snapshot()
    >>> patches = PatchSet("demo")
    >>> def cumprod_handler(func, types, args, kwargs): ...
    >>> patches.function(torch.cumprod, cumprod_handler)
    >>> registry.add_plugin(PluginInfo("demo"), list(patches))  # what stepped aside for a newer built-in
    []
    >>> shard_registries.current_handler(PatchLevel.FUNCTION, torch.cumprod) is cumprod_handler
    True
    >>> registry.remove_all()
    >>> shard_registries.snapshot() == before
    True
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.declarations import PatchDeclaration
from physicsnemo_shardext.engine.aliases import implied_entries, torch_aliases
from physicsnemo_shardext.engine.baseline import handler_origin
from physicsnemo_shardext.engine.provenance import Conflict, InstalledPatch, PluginInfo, PluginReport
from physicsnemo_shardext.engine.resolution import Claim, Resolution, resolve_claims
from physicsnemo_shardext.engine.trace import traced_handler, untraced
from physicsnemo_shardext.errors import InvalidPatchDeclaration, PatchConflictError, ShardextWarning
from physicsnemo_shardext.markers import DISTRIBUTION_NAME
from physicsnemo_shardext.settings import current_name
from physicsnemo_shardext.shard_registries import PatchLevel, SlotKey, SlotState
from physicsnemo_shardext.targets import lookup_keys, resolve_slot

__all__ = ["PatchRegistry", "plugin_index", "plugin_of"]


@dataclass
class _RegistryState:
    """Everything `PatchRegistry.sandbox` must be able to put back."""

    plugins: dict[str, tuple[PluginInfo, tuple[PatchDeclaration, ...]]] = field(default_factory=dict)
    prior: dict[SlotKey, SlotState] = field(default_factory=dict)
    installed: dict[SlotKey, InstalledPatch] = field(default_factory=dict)
    conflicts: list[Conflict] = field(default_factory=list)
    disabled_plugins: tuple[str, ...] = ()
    disabled_targets: frozenset[SlotKey] = frozenset()
    # Keyed by identity, (distribution, entry-point name): two distributions may report the same name.
    reports: dict[tuple[str, str], PluginReport] = field(default_factory=dict)
    # (plugin name, slot): each plugin is told once per built-in it overrides.
    warned_overrides: set[tuple[str, SlotKey]] = field(default_factory=set)
    warned_conflicts: set[Conflict] = field(default_factory=set)


class PatchRegistry:
    """Owns the plugin-provided part of ShardTensor's registries.

    Args:
        prefer: plugin or distribution names, most preferred first, that break
            equal-priority ties (``SHARDEXT_PREFER``).
        strict: raise `PatchConflictError` instead of warning on an unresolved tie.
        trace: wrap installed handlers to log each decision (see `physicsnemo_shardext.engine.trace`).
    """

    def __init__(self, *, prefer: Sequence[str] = (), strict: bool = False, trace: bool = False) -> None:
        self.prefer: tuple[str, ...] = tuple(prefer)
        self.strict = strict
        self._trace = trace
        self._state = _RegistryState()

    # -- queries ---------------------------------------------------------------------------
    def plugins(self) -> list[PluginInfo]:
        """Plugins whose declarations are currently held (installed or shadowed)."""
        return [info for info, _ in self._state.plugins.values()]

    def installed(self) -> list[InstalledPatch]:
        """Provenance of every handler the framework wrote into ShardTensor."""
        return sorted(
            self._state.installed.values(), key=lambda p: (p.declaration.level.value, p.declaration.target_name)
        )

    def provenance(self, target: Any, level: PatchLevel | str = PatchLevel.FUNCTION) -> InstalledPatch | None:
        """Provenance of the plugin handler installed for ``target``, or ``None``."""
        return self._state.installed.get(resolve_slot(target, level))

    def conflicts(self) -> list[Conflict]:
        """Equal-priority claims found at the last resolution (resolved or not)."""
        return list(self._state.conflicts)

    def reports(self) -> list[PluginReport]:
        """Load reports (loaded, failed, blocked, incompatible) in (name, distribution) order."""
        return sorted(self._state.reports.values(), key=lambda r: (r.plugin.name, r.plugin.distribution))

    def record_report(self, report: PluginReport) -> None:
        """Remember what happened when loading a plugin (used by the loader).

        One report per plugin identity, (distribution, name): a later report for the
        same identity replaces the earlier one, another distribution's is kept beside it.
        """
        self._state.reports[(report.plugin.distribution, report.plugin.name)] = report

    def prior_handler(self, target: Any, level: PatchLevel | str = PatchLevel.FUNCTION) -> Callable | None:
        """The handler ShardTensor held for ``target`` before any plugin replaced it."""
        key = resolve_slot(target, level)
        if key in self._state.prior:
            return self._state.prior[key][0]
        return shard_registries.current_handler(*key)

    # -- changes ---------------------------------------------------------------------------
    def add_plugin(self, plugin: PluginInfo, declarations: Iterable[PatchDeclaration]) -> list[tuple[str, str]]:
        """Hold ``plugin``'s declarations and install whatever they win.

        All-or-nothing: on any error (missing ``override``, a strict-mode
        conflict, a name already taken) neither the registry nor ShardTensor changes.

        Upstream drift: a first-party declaration without ``override`` whose slot now
        holds a PhysicsNeMo built-in (a newer PhysicsNeMo registered one) is not
        installed: the built-in is used, as if this package were absent there. Returns
        ``(target, why)`` of each such declaration (empty for every other plugin, whose
        missing ``override`` stays an error).
        """
        declarations, yielded = self._yield_to_new_builtins(plugin, tuple(declarations))
        if plugin.name in self._state.plugins:
            holder = self._state.plugins[plugin.name][0]
            raise InvalidPatchDeclaration(
                plugin.name, "<plugin>", f"a plugin with this name is already loaded, from {holder.distribution}"
            )
        for declaration in declarations:
            for slot_declaration in _per_slot(declaration):
                self._check_override(plugin, slot_declaration)
        candidate = copy.copy(self._state)
        candidate.plugins = {**self._state.plugins, plugin.name: (plugin, declarations)}
        self._commit(candidate)
        self._warn_overrides(plugin, declarations)
        return yielded

    def _yield_to_new_builtins(
        self, plugin: PluginInfo, declarations: tuple[PatchDeclaration, ...]
    ) -> tuple[tuple[PatchDeclaration, ...], list[tuple[str, str]]]:
        """Split off first-party declarations that a newer PhysicsNeMo built-in now covers (see `add_plugin`)."""
        if plugin.distribution != DISTRIBUTION_NAME:
            return declarations, []
        kept: list[PatchDeclaration] = []
        yielded: list[tuple[str, str]] = []
        for declaration in declarations:
            prior = None
            if declaration.level is not PatchLevel.ATTRIBUTE and not declaration.override:
                prior = self._prior_state(declaration.key)[0]
            if prior is None:
                kept.append(declaration)
                continue
            yielded.append(
                (
                    declaration.target_name,
                    f"PhysicsNeMo now registers a built-in for it ({handler_origin(prior)}: "
                    f"{getattr(prior, '__qualname__', prior)!s}), which is used; this first-party handler "
                    "stepped aside (upstream drift: see docs/compatibility.md)",
                )
            )
        return tuple(kept), yielded

    def remove_plugin(self, name: str) -> None:
        """Uninstall one plugin; slots it held go to the next claimant or back to their prior handler."""
        if name not in self._state.plugins:
            raise KeyError(f"no plugin named {name!r} is loaded")
        candidate = copy.copy(self._state)
        candidate.plugins = {k: v for k, v in self._state.plugins.items() if k != name}
        self._commit(candidate)

    def remove_all(self) -> None:
        """Uninstall every plugin: ShardTensor's registries return to their state before any plugin."""
        candidate = copy.copy(self._state)
        candidate.plugins = {}
        candidate.disabled_plugins = ()
        candidate.disabled_targets = frozenset()
        self._commit(candidate)

    def set_prefer(self, prefer: Sequence[str]) -> None:
        """Change the tie-breaking preference (plugin or distribution names) and re-resolve.

        Examples:
            >>> registry = PatchRegistry()
            >>> registry.set_prefer(["fast-conv", "other-conv"])
            >>> registry.prefer
            ('fast-conv', 'other-conv')
        """
        previous = self.prefer
        self.prefer = tuple(prefer)
        try:
            self._commit(copy.copy(self._state))
        except PatchConflictError:
            self.prefer = previous
            raise

    def set_trace(self, enabled: bool) -> None:
        """Switch trace wrappers on or off for every installed handler."""
        self._trace = enabled
        self._commit(copy.copy(self._state))

    @contextlib.contextmanager
    def disabled(self, plugins: Iterable[str] = (), targets: Iterable[Any] = ()) -> Iterator[None]:
        """Run a block with some plugins and/or targets switched off; restores on exit, even on error.

        * ``plugins``: plugin or distribution names; their slots go to the next
          claimant or back to the prior (built-in) handler.
        * ``targets``: callables, op names or OpOverloads whose handler is removed
          entirely, built-in included, so ShardTensor takes the DTensor fallback.
          Give ``(target, level)`` tuples to choose a level other than the inferred one.
          A custom op, in any of its forms, is removed under every key it is looked up by,
          and a function-level target together with its torch aliases (``torch.cat``
          removes ``torch.concat`` and ``torch.concatenate`` too).

        Examples:
            Inside the block ``F.gelu`` has no handler, so ShardTensor takes the DTensor fallback:

            >>> import torch.nn.functional as F
            >>> import physicsnemo_shardext
            >>> registry = physicsnemo_shardext.get_registry()
            >>> with registry.disabled(targets=[F.gelu]):
            ...     shard_registries.current_handler(PatchLevel.FUNCTION, F.gelu) is None
            True
            >>> registry.provenance(F.gelu).plugin.name
            'pointwise'
        """
        saved = (self._state.disabled_plugins, self._state.disabled_targets)
        candidate = copy.copy(self._state)
        candidate.disabled_plugins = saved[0] + tuple(current_name(p) for p in plugins)
        candidate.disabled_targets = saved[1] | frozenset(slot for t in targets for slot in self._slots_of(t))
        self._commit(candidate)
        try:
            yield
        finally:
            restored = copy.copy(self._state)
            restored.disabled_plugins, restored.disabled_targets = saved
            self._commit(restored)

    @contextlib.contextmanager
    def sandbox(self) -> Iterator[PatchRegistry]:
        """Snapshot ShardTensor's registries and this registry; restore both on exit."""
        registries = shard_registries.snapshot()
        state = _copy_state(self._state)
        trace, prefer, strict = self._trace, self.prefer, self.strict
        try:
            yield self
        finally:
            shard_registries.restore(registries)
            self._state = state
            self._trace, self.prefer, self.strict = trace, prefer, strict

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _slots_of(target: Any) -> tuple[SlotKey, ...]:
        """Every slot of ``target`` (or of ``(target, level)``): its key and the other keys of the same op.

        The other keys are a custom op's packet or overload names, or a function's torch aliases.
        """
        level = None
        if isinstance(target, tuple):
            target, level = target
        level, key = resolve_slot(target, level)
        keys = lookup_keys(key, level) + (torch_aliases(key) if level is PatchLevel.FUNCTION else ())
        return tuple((level, each) for each in keys)

    def _prior_state(self, key: SlotKey) -> SlotState:
        if key in self._state.prior:
            return self._state.prior[key]
        return shard_registries.capture_slot(*key)

    def _check_override(self, plugin: PluginInfo, declaration: PatchDeclaration) -> None:
        if declaration.level is PatchLevel.ATTRIBUTE:
            return  # replace_attribute is itself the explicit consent (and carries a reason)
        prior = self._prior_state(declaration.key)[0]
        if prior is not None and not declaration.override:
            raise InvalidPatchDeclaration(
                plugin.name,
                declaration.target_name,
                f"ShardTensor already has a handler for it ({handler_origin(prior)}: "
                f"{getattr(prior, '__qualname__', prior)!s}); declare it with override=True to replace it",
            )

    def _warn_overrides(self, plugin: PluginInfo, declarations: Sequence[PatchDeclaration]) -> None:
        for declaration in declarations:
            installed = self._state.installed.get(declaration.key)
            if (
                installed is not None
                and installed.plugin.name == plugin.name
                and installed.overrides_builtin
                and declaration.level is not PatchLevel.ATTRIBUTE
                and (plugin.name, declaration.key) not in self._state.warned_overrides
                # First-party overrides are documented per family; warning on every import is noise.
                and plugin.distribution != DISTRIBUTION_NAME
            ):
                self._state.warned_overrides.add((plugin.name, declaration.key))
                warnings.warn(
                    f"plugin {plugin.label} overrides PhysicsNeMo's built-in handler for "
                    f"{declaration.target_name}; the built-in stays reachable through "
                    "physicsnemo_shardext.builtin_handler()",
                    ShardextWarning,
                    stacklevel=3,
                )

    def _active_claims(self, state: _RegistryState) -> list[tuple[PluginInfo, PatchDeclaration]]:
        claims = []
        for info, declarations in state.plugins.values():
            if any(info.matches(selector) for selector in state.disabled_plugins):
                continue
            claims.extend((info, declaration) for declaration in declarations)
        return claims

    def _commit(self, candidate: _RegistryState) -> None:
        """Resolve ``candidate``, check it, then write the difference into ShardTensor."""
        declared = self._active_claims(candidate)
        claims = [(info, claim) for info, declaration in declared for claim in _per_slot(declaration)]
        aliases = self._alias_claims(claims)
        winners, conflicts = resolve_claims(claims + aliases, self.prefer)
        # A tie on a custom op's packet name repeats the tie on its overload: report the declared slot only.
        # A tie on an alias is reported: plugins that declared different names of one op meet there.
        primary = {(declaration.level.value, declaration.target_name) for _, declaration in declared + aliases}
        conflicts = [c for c in conflicts if (c.level, c.target) in primary]
        unresolved = [c for c in conflicts if c.winner is None]
        if unresolved and self.strict:
            first = unresolved[0]
            raise PatchConflictError(first.target, first.level, list(first.providers), first.priority)
        new_keys = set(winners) - set(self._state.prior)
        prior = dict(self._state.prior)
        for key in new_keys:
            prior[key] = shard_registries.capture_slot(*key)
        installed = {
            key: self._provenance(resolution, prior[key])
            for key, resolution in winners.items()
            if key not in candidate.disabled_targets
        }
        candidate = replace(candidate, prior=prior, installed=installed, conflicts=conflicts)
        # Every slot we have ever touched is rewritten from the new desired state.
        for key, prior_slot in prior.items():
            if key in candidate.disabled_targets:
                shard_registries.remove_handler(*key)
            elif key in installed:
                shard_registries.set_handler(key[0], key[1], self._handler_to_install(installed[key]))
            else:
                shard_registries.restore_slot(key[0], key[1], prior_slot)
        for key in candidate.disabled_targets - set(prior):
            # A disabled slot no plugin ever claimed: remember it so it can be put back.
            candidate.prior[key] = shard_registries.capture_slot(*key)
            shard_registries.remove_handler(*key)
        self._state = candidate
        for conflict in unresolved:
            if conflict in candidate.warned_conflicts:
                continue
            candidate.warned_conflicts.add(conflict)
            warnings.warn(
                f"{PatchConflictError(conflict.target, conflict.level, list(conflict.providers), conflict.priority)}"
                "; neither handler is installed",
                ShardextWarning,
                stacklevel=3,
            )

    def _alias_claims(self, claims: Sequence[Claim]) -> list[Claim]:
        """Each plugin's function-level claims copied to the torch aliases of their targets nobody declared.

        Per plugin, an alias reached from several of its declarations takes the one
        `implied_entries` prefers (the alias's canonical op first). An alias some
        plugin declares itself is left to the declarations; a slot that already held
        a handler before any plugin (a PhysicsNeMo built-in, say) is claimed only
        by a declaration with ``override=True``, as declaring the alias would require.
        """
        explicit = {declaration.key for _, declaration in claims}
        by_plugin: dict[str, tuple[PluginInfo, dict[Any, PatchDeclaration]]] = {}
        for info, declaration in claims:
            if declaration.level is PatchLevel.FUNCTION:
                by_plugin.setdefault(info.name, (info, {}))[1][declaration.target] = declaration
        implied: list[Claim] = []
        for info, declared in by_plugin.values():
            for alias, (source, declaration) in implied_entries(declared).items():
                slot: SlotKey = (PatchLevel.FUNCTION, alias)
                if slot in explicit or (self._prior_state(slot)[0] is not None and not declaration.override):
                    continue
                note = f"alias of {declaration.target_name}"
                description = f"{note}; {declaration.description}" if declaration.description else note
                implied.append((info, replace(declaration, target=alias, alias_of=source, description=description)))
        return implied

    def _provenance(self, resolution: Resolution, prior_slot: SlotState) -> InstalledPatch:
        prior = prior_slot[0]
        return InstalledPatch(
            declaration=resolution.declaration,
            plugin=resolution.winner,
            replaced=prior,
            replaced_provider=handler_origin(prior) if prior is not None else None,
            shadowed=resolution.shadowed,
        )

    def _handler_to_install(self, patch: InstalledPatch) -> Callable:
        if not self._trace or patch.declaration.level is PatchLevel.ATTRIBUTE:
            # Attributes are installed verbatim: a wrapper would turn a staticmethod into a bound method.
            return patch.declaration.handler  # no wrapper on the dispatch hot path
        return traced_handler(
            patch.declaration.handler, target=patch.declaration.target_name, plugin=patch.plugin.label
        )


def _per_slot(declaration: PatchDeclaration) -> tuple[PatchDeclaration, ...]:
    """One claim per slot the declaration fills: itself, then a copy for each other key of its op.

    Each copy is resolved, installed, recorded and undone like a declaration of
    its own, so a custom op's packet name follows its overload's exactly.
    """
    return (declaration, *(replace(declaration, target=target) for _, target in declaration.slots[1:]))


def _copy_state(state: _RegistryState) -> _RegistryState:
    """Copy the containers of a state (declarations and handlers are shared, immutable)."""
    return _RegistryState(
        plugins=dict(state.plugins),
        prior=dict(state.prior),
        installed=dict(state.installed),
        conflicts=list(state.conflicts),
        disabled_plugins=state.disabled_plugins,
        disabled_targets=state.disabled_targets,
        reports=dict(state.reports),
        warned_overrides=set(state.warned_overrides),
        warned_conflicts=set(state.warned_conflicts),
    )


def plugin_index(registry: PatchRegistry) -> dict[int, PluginInfo]:
    """``id(declared handler) -> plugin`` of every installed patch, to attribute many calls at once.

    The registry keeps the handlers alive, so their ids stay unique while it holds them.

    Examples:
        >>> import physicsnemo_shardext, torch.nn.functional as F
        >>> registry = physicsnemo_shardext.get_registry()
        >>> plugin_index(registry)[id(registry.provenance(F.gelu).declaration.handler)].name
        'pointwise'
    """
    return {id(patch.declaration.handler): patch.plugin for patch in registry.installed()}


def plugin_of(handler: Any, registry: PatchRegistry, index: dict[int, PluginInfo] | None = None) -> PluginInfo | None:
    """The plugin whose installed declaration is ``handler`` (trace wrappers seen through), else ``None``.

    Pass ``index`` (from `plugin_index`) when asking about many handlers.

    Examples:
        >>> import physicsnemo_shardext, torch.nn.functional as F
        >>> registry = physicsnemo_shardext.get_registry()
        >>> plugin_of(registry.provenance(F.gelu).declaration.handler, registry).name
        'pointwise'
    """
    index = plugin_index(registry) if index is None else index
    return index.get(id(untraced(handler)))
