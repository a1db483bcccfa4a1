"""Tests of physicsnemo_shardext_cli.py: the console script answers torch-free commands without the front door."""

from __future__ import annotations

import subprocess
import sys

import physicsnemo_shardext_cli


def test_torch_free_commands_are_answered_without_the_front_door(tmp_path):
    # physicsnemo_shardext_cli.main answers them from the torch-free tools modules, without running
    # the package's __init__; tests/tools/test_scaffold.py checks with -X importtime that torch is never imported.
    from physicsnemo_shardext.tools.cli import answers_without_torch

    assert answers_without_torch(["new", "x", "--dir", "y"]) and answers_without_torch(["doctor", "--help"])
    assert not answers_without_torch(["doctor"]) and not answers_without_torch(["list", "--plugin", "new"])
    probe = (
        "import sys, physicsnemo_shardext_cli as c\n"
        f"code = c.main(['new', 'probe-op', '--dir', {str(tmp_path / 'p')!r}])\n"
        "print('front door ran' if 'physicsnemo_shardext' in sys.modules else 'front door not run', code)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip().endswith("front door not run 0"), result.stdout
    assert (tmp_path / "p" / "src" / "probe_op" / "patches.py").is_file()


def test_a_command_that_needs_plugins_loads_them_through_the_cli_guard(capsys):
    # In-process, the package is already imported: main() runs the command directly.
    assert physicsnemo_shardext_cli.main(["list", "--plugin", "pointwise"]) == 0
    assert "pointwise" in capsys.readouterr().out
