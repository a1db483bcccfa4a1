"""The code of the tutorials in docs/ is executed here, so the pages cannot drift from the code.

Blocks are picked by the ``<!-- tested-as: NAME -->`` comment in front of them;
files a page includes with ``--8<--`` are run by their own tests.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import physicsnemo_shardext
from physicsnemo_shardext import MissingShardPatch, ShardextWarning

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "docs" / "writing-a-plugin.md"
BLOCK = re.compile(r"<!-- tested-as: (?P<name>[\w.]+) -->\n```python\n(?P<code>.*?)```", re.DOTALL)


def tutorial_blocks() -> dict[str, str]:
    return {m["name"]: m["code"] for m in BLOCK.finditer(TUTORIAL.read_text())}


def tutorial_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name.removesuffix(".py"))
    exec(compile(tutorial_blocks()[name], f"{TUTORIAL}:{name}", "exec"), module.__dict__)
    return module


def test_blocks_are_found():
    assert set(tutorial_blocks()) == {"my_hooks.py", "run"}


def test_included_files_exist_and_have_tests():
    included = re.findall(r'--8<-- "([^"]+)"', TUTORIAL.read_text())
    assert included, "the tutorial should show the real template files"
    for path in included:
        assert (REPO / path).is_file(), path
    assert (REPO / "entry_points/shardext-example-plugin/tests/test_clamp.py").is_file()


def test_sandboxed_loading_snippet_runs_as_written(tmp_path, python_runner):
    blocks = tutorial_blocks()
    (tmp_path / "my_hooks.py").write_text(blocks["my_hooks.py"])
    result = python_runner(blocks["run"], path=[str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["loaded", "1", "my-plugin", "True"]
    assert "overrides PhysicsNeMo's built-in handler for torch.nn.functional.pad" in result.stderr


@pytest.mark.multirank(2)
def test_delegating_override_on_two_ranks(domain_mesh):
    from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

    my_hooks = tutorial_module("my_hooks.py")
    with physicsnemo_shardext.sandbox(), pytest.warns(ShardextWarning):
        physicsnemo_shardext.load_plugin(my_hooks, "my-plugin")
        xs = shard_tensor(torch.randn(1, 2, 9, 4), domain_mesh, [Shard(2)], [5, 4])
        with pytest.raises(MissingShardPatch, match="circular"):
            F.pad(xs, (1, 1), mode="circular")
        # every other call reaches PhysicsNeMo's built-in, which pads correctly
        check_conformance(
            lambda t: F.pad(t, (1, 2), value=0.5), [torch.randn(1, 2, 9, 4)], ShardSpec(domain_mesh, [Shard(2)], [5, 4])
        )


def test_listing_of_the_delegating_override_is_real_output(tmp_path):
    # The §4 sample is what `shardext list` prints for the my_hooks.py block, published as
    # plugin `my-pad` by a distribution `my-plugin` (module `my_plugin`), priority included.
    import os
    import subprocess
    import sys

    from physicsnemo_shardext.testing.plugin_packages import write_plugin_distribution

    write_plugin_distribution(
        tmp_path, "my-plugin", "0.1.0", {"my-pad": "my_plugin"}, {"my_plugin": tutorial_blocks()["my_hooks.py"]}
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDEXT_")}
    env["PYTHONPATH"] = str(tmp_path)
    script = Path(sys.executable).with_name("shardext")
    result = subprocess.run(
        [str(script), "list", "--plugin", "my-pad"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    sample = re.search(
        r"<!-- output-of: shardext list --plugin my-pad -->\n```text\n(.*?)```", TUTORIAL.read_text(), re.DOTALL
    )
    assert sample, "the §4 sample output lost its <!-- output-of: ... --> marker"
    assert sample[1] == result.stdout, f"docs/writing-a-plugin.md §4 sample differs from:\n{result.stdout}"
