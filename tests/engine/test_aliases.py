"""Tests of physicsnemo_shardext.engine.aliases, and the convention it keeps: every alias of a patched op reaches its handler.

The conventions test reads torch's aliases from torch itself (its OpInfo database and
its docstrings, `collect_torch_aliases`), independently of the stored table, and checks
every function-level target ShardTensor has a handler for: first-party families,
PhysicsNeMo's built-ins and any plugin installed in this environment. A family that
adds an op with aliases is covered without listing them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor

import physicsnemo_shardext
from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.engine.aliases import (
    ALIAS_PAIRS,
    canonical_of,
    collect_torch_aliases,
    format_table,
    implied_entries,
    torch_aliases,
)
from physicsnemo_shardext.engine.baseline import baseline, builtin_handler
from physicsnemo_shardext.shard_registries import PatchLevel
from physicsnemo_shardext.targets import _import_dotted, describe_target

#: Aliases that may reach another handler than their op's, and why (none today).
DIVERGING_ON_PURPOSE: dict[str, str] = {}


@pytest.fixture(scope="module")
def torch_table() -> tuple[tuple[str, str, bool], ...]:
    """torch's aliases, read from the installed torch (its test internals need ``expecttest``)."""
    pytest.importorskip("expecttest", reason="torch's OpInfo database needs the expecttest package")
    return collect_torch_aliases()


def _closure(table: tuple[tuple[str, str, bool], ...]) -> dict[object, set[object]]:
    """``{target: every alias reachable from it}`` of ``table``, as objects."""
    edges: dict[object, set[object]] = {}
    for source_name, alias_name, both_ways in table:
        source, alias = _import_dotted(source_name), _import_dotted(alias_name)
        edges.setdefault(source, set()).add(alias)
        if both_ways:
            edges.setdefault(alias, set()).add(source)
    closure = {}
    for start in edges:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt is not start and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        closure[start] = seen
    return closure


def test_the_stored_table_is_what_torch_documents(torch_table):
    assert ALIAS_PAIRS == torch_table, (
        "torch's aliases changed; regenerate the table with `python -m physicsnemo_shardext.engine.aliases` and paste it "
        "into ALIAS_PAIRS:\n" + format_table(torch_table)
    )


def test_the_table_covers_the_aliases_the_issue_names():
    named = {(source, alias) for source, alias, _ in ALIAS_PAIRS}
    assert {
        ("torch.cat", "torch.concat"),
        ("torch.cat", "torch.concatenate"),
        ("torch.transpose", "torch.swapaxes"),
        ("torch.transpose", "torch.swapdims"),
        ("torch.Tensor.transpose", "torch.Tensor.swapaxes"),
        ("torch.movedim", "torch.moveaxis"),
        ("torch.abs", "torch.absolute"),
        ("torch.clamp", "torch.clip"),
        ("torch.Tensor.clamp", "torch.Tensor.clip"),
        ("torch.sigmoid", "torch.special.expit"),
        ("torch.tanh", "torch.nn.functional.tanh"),
        ("torch.nn.functional.layer_norm", "torch.layer_norm"),
    } <= named
    assert len(ALIAS_PAIRS) > 100


def test_every_alias_of_a_patched_function_reaches_the_same_handler(torch_table):
    closure = _closure(torch_table)
    table = ShardTensor._function_registry
    checked, wrong = 0, []
    for target, handler in list(table.items()):
        for alias in closure.get(target, ()):
            name = describe_target(alias)
            checked += 1
            if name in DIVERGING_ON_PURPOSE:
                continue
            if table.get(alias) is not handler:
                reached = table.get(alias)
                wrong.append(
                    f"{describe_target(target)} -> {getattr(handler, '__qualname__', handler)}, but its "
                    f"alias {name} -> {getattr(reached, '__qualname__', 'the DTensor fallback')}"
                )
    assert checked > 20
    assert not wrong, "aliases that do not reach their op's handler:\n" + "\n".join(wrong)


def test_builtin_aliases_reach_the_builtin(torch_table):
    closure = _closure(torch_table)
    builtins = baseline().as_dicts()[shard_registries.table_name(PatchLevel.FUNCTION)]
    for target, handler in builtins.items():
        for alias in closure.get(target, ()):
            assert builtins.get(alias) is handler, describe_target(alias)
    assert builtin_handler(torch.group_norm) is builtin_handler(F.group_norm) is not None


def test_torch_aliases_follow_aliases_of_aliases_and_one_way_pairs():
    assert torch_aliases(torch.cat) == (torch.concat, torch.concatenate)
    assert torch_aliases(torch.concat) == (torch.cat, torch.concatenate)
    assert set(torch_aliases(torch.special.psi)) == {torch.digamma, torch.special.digamma}
    assert torch_aliases(torch.max) == (torch.maximum,) and torch_aliases(torch.maximum) == ()
    assert torch_aliases(torch.Tensor.clamp_) == (torch.Tensor.clip_,)
    assert torch_aliases(torch.roll) == () and torch_aliases([]) == ()
    assert canonical_of(torch.Tensor.swapaxes) is torch.Tensor.transpose


def test_implied_entries_prefer_the_canonical_op_whatever_the_order():
    for declared in ({torch.concat: "concat", torch.cat: "cat"}, {torch.cat: "cat", torch.concat: "concat"}):
        assert implied_entries(declared) == {torch.concatenate: (torch.cat, "cat")}
    assert implied_entries({torch.special.expit: "expit"}) == {
        torch.sigmoid: (torch.special.expit, "expit"),
        F.sigmoid: (torch.special.expit, "expit"),
    }
    assert implied_entries({torch.roll: "roll"}) == {}


def test_the_registry_records_alias_rows_with_their_source():
    registry = physicsnemo_shardext.get_registry()
    record = registry.provenance(torch.concat)
    assert record.plugin.name == "layout_ops" and record.declaration.alias_of is torch.cat
    assert record.declaration.handler is registry.provenance(torch.cat).declaration.handler
    assert record.declaration.description.startswith("alias of torch.cat")
    assert registry.provenance(torch.cat).declaration.alias_of is None
