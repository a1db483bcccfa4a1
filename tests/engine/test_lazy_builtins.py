"""Tests of physicsnemo_shardext.engine.lazy_builtins: PhysicsNeMo's built-ins present, the heavy ones deferred.

Import-time behaviour needs a fresh interpreter, so most checks run in a
subprocess on a machine PhysicsNeMo treats as CPU-only (``CUDA_VISIBLE_DEVICES=""``).
"""

from __future__ import annotations

import json

import pytest
import torch

from physicsnemo_shardext.engine import lazy_builtins

CPU = {"CUDA_VISIBLE_DEVICES": ""}

#: Prints every (table, key, handler) of ShardTensor's registries as JSON, keys and handlers by name.
LIST_SLOTS = """
import json
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo_shardext.shard_registries import REGISTRY_ATTRIBUTES
from physicsnemo_shardext.targets import describe_handler, describe_target
print(json.dumps(sorted([table, describe_target(key), describe_handler(handler)]
                        for table in REGISTRY_ATTRIBUTES for key, handler in getattr(ShardTensor, table).items())))
"""


def _json_tail(result) -> object:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_does_not_import_physicsnemo_nn(python_runner):
    code = (
        "import sys\n"
        "import physicsnemo.domain_parallel\n"
        "before = set(sys.modules)\n"
        "import physicsnemo_shardext\n"
        "import json; print(json.dumps(['physicsnemo.nn' in before, 'warp' in before,"
        " sorted(m for m in sys.modules if m == 'physicsnemo.nn' or m.startswith('physicsnemo.nn.'))]))\n"
    )
    nn_by_domain_parallel, warp_by_domain_parallel, nn_modules = _json_tail(python_runner(code, env=CPU))
    assert not nn_by_domain_parallel  # otherwise there would be nothing to save
    assert nn_modules == []
    # warp is imported by physicsnemo.domain_parallel itself: not ours to avoid.
    assert warp_by_domain_parallel


def test_slots_match_physicsnemo_register_custom_ops_once_physicsnemo_nn_is_imported(python_runner):
    ours = python_runner(
        "import sys, physicsnemo_shardext\n"
        "assert 'physicsnemo.nn' not in sys.modules\n"
        "import physicsnemo.nn\n" + LIST_SLOTS,
        env={**CPU, "SHARDEXT_AUTOLOAD": "0"},
    )
    theirs = python_runner(
        "import physicsnemo.domain_parallel as dp\ndp.register_custom_ops()\n" + LIST_SLOTS,
        env={**CPU, "SHARDEXT_AUTOLOAD": "0"},
    )
    ours_slots, theirs_slots = _json_tail(ours), _json_tail(theirs)
    assert {(t, k) for t, k, _ in ours_slots} == {(t, k) for t, k, _ in theirs_slots}
    # The stand-ins read as PhysicsNeMo's own handlers too.
    assert ours_slots == theirs_slots
    assert any(k == "physicsnemo.knn_cuml.default" for _, k, _ in ours_slots)
    assert any(k.endswith("natten.na2d") for _, k, _ in ours_slots)


STAND_IN = """
import json, sys, traceback
import physicsnemo_shardext
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.engine import lazy_builtins

KEY = "physicsnemo.knn_cuml.default"
MODULE = "physicsnemo.domain_parallel.shard_utils.knn"
table = ShardTensor._named_function_registry
stand_in = table[KEY]
out = {"deferred": MODULE not in sys.modules, "is_stand_in": stand_in is lazy_builtins.stand_in_for(KEY)}

def plugin_handler(func, types, args, kwargs):
    return "plugin"

table[KEY] = plugin_handler            # a plugin replaced the stand-in (it delegates to it)
try:
    stand_in(None, (), (torch_t := __import__("torch").zeros(3, 2), torch_t, 2), {})
except Exception as error:             # plain tensors: the real handler refuses them
    frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    out["forwarded"] = "knn_sharded_wrapper" in frames and frames.index("knn_sharded_wrapper") > 0
out["imported"] = MODULE in sys.modules
out["slot_kept"] = table[KEY] is plugin_handler
table[KEY] = stand_in

# Whoever imports the real modules again (PhysicsNeMo's own registration) changes nothing.
before = shard_registries.snapshot()
import physicsnemo.domain_parallel as dp
dp.register_custom_ops()
out["register_custom_ops_changes"] = [str(c.key) for c in before.changes(shard_registries.snapshot())]
out["baseline_is_stand_in"] = physicsnemo_shardext.builtin_handler(KEY, "named") is stand_in
print(json.dumps(out))
"""


def test_stand_in_imports_the_real_module_keeps_the_slot_and_forwards(python_runner):
    out = _json_tail(python_runner(STAND_IN, env={**CPU, "SHARDEXT_AUTOLOAD": "0"}))
    assert out == {
        "deferred": True,
        "is_stand_in": True,
        "forwarded": True,
        "imported": True,
        "slot_kept": True,
        # register_custom_ops imports the radius-search and SDF modules too: their own
        # registrations are undone at once, and natten's handlers were already there.
        "register_custom_ops_changes": [],
        "baseline_is_stand_in": True,
    }


NATTEN = """
import json, warnings
import physicsnemo_shardext
from physicsnemo_shardext import shard_registries
from physicsnemo_shardext.engine.baseline import late_builtins
from physicsnemo_shardext.tools.inventory import handler_rows

from physicsnemo_shardext import ShardextWarning
warnings.simplefilter("error", ShardextWarning)  # no plugin may be blamed for the late built-ins
older = shard_registries.snapshot()
with physicsnemo_shardext.sandbox():
    import physicsnemo.nn.functional.natten as natten
from physicsnemo.domain_parallel.shard_utils import natten_patches

registry = physicsnemo_shardext.get_registry()
rows = {row["target"]: row for row in handler_rows(registry)}
na2d = rows["physicsnemo.nn.functional.natten.na2d"]
out = {
    "builtin": physicsnemo_shardext.builtin_handler(natten.na2d) is natten_patches.na2d_wrapper,
    "late": sorted(str(key.__name__) for _, key in late_builtins()),
    "after_sandbox": shard_registries.current_handler("function", natten.na2d) is natten_patches.na2d_wrapper,
    "row": [na2d["provider"], na2d["status"]],
    "afno": [r.status.value for r in registry.reports() if r.plugin.name == "afno"],
}
from physicsnemo_shardext.engine.loader import resume_ready
out["afno_resumed"] = [r.status.value for r in resume_ready(registry)]
shard_registries.restore(older)         # a snapshot from before natten existed
out["after_restore"] = shard_registries.current_handler("function", natten.na2d) is natten_patches.na2d_wrapper
print(json.dumps(out))
"""


def test_natten_handlers_join_the_baseline_and_survive_restores(python_runner):
    out = _json_tail(python_runner(NATTEN, env=CPU))
    assert out == {
        "builtin": True,
        "late": ["na1d", "na2d", "na3d"],
        "after_sandbox": True,
        "row": ["physicsnemo", "ok"],
        # Loaded inside the sandbox and undone on its exit; sandbox() loads it again on exit.
        "afno": ["loaded"],
        "afno_resumed": [],
        "after_restore": True,
    }


def test_light_modules_leave_out_the_deferred_ones():
    modules = lazy_builtins.light_modules()
    deferred = {handler.module for handler in lazy_builtins.deferred_named_handlers().values()}
    assert deferred and not deferred & set(modules)
    assert "physicsnemo.domain_parallel.shard_utils.natten_patches" not in modules
    assert "physicsnemo.domain_parallel.custom_ops._tensor_ops" in modules  # a submodule named in an import


def test_nothing_is_deferred_where_cuda_is_available(monkeypatch):
    import physicsnemo.domain_parallel as domain_parallel

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(domain_parallel, "register_custom_ops", lambda: calls.append("physicsnemo"))
    late = []
    lazy_builtins.register_builtins(late.append)
    assert calls == ["physicsnemo"] and late == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_host_physicsnemo_registers_everything_itself(python_runner):
    code = (
        "import sys, physicsnemo_shardext\n"
        "from physicsnemo_shardext.engine.lazy_builtins import stand_in_for\n"
        "knn = 'physicsnemo.domain_parallel.shard_utils.knn'\n"
        "print(knn in sys.modules, stand_in_for('physicsnemo.knn_cuml.default'))\n"
    )
    result = python_runner(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["True", "None"]
