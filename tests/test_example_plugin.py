"""The template third-party plugin (entry_points/shardext-example-plugin), really pip-installed."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "entry_points" / "shardext-example-plugin"


def test_pip_installed_copy_is_discovered_on_import(tmp_path, python_runner):
    # A renamed copy, so the test proves discovery of a distribution installed
    # now, even where the template itself is installed already (as in CI).
    source = tmp_path / "src-tree"
    shutil.copytree(TEMPLATE, source)
    pyproject = source / "pyproject.toml"
    text = pyproject.read_text()
    text = text.replace('name = "shardext-example-plugin"', 'name = "shardext-copied-plugin"')
    text = text.replace("example-clamp = ", "copied-clamp = ").replace('version = "0.1.0"', 'version = "7.7.7"')
    pyproject.write_text(text)
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    code = (
        "import json, torch, physicsnemo_shardext as s\n"
        "p = s.get_registry().provenance(torch.clamp)\n"
        "r = {x.plugin.name: x.status.value for x in s.get_registry().reports()}\n"
        "print(json.dumps([p.plugin.name if p else None, p.plugin.distribution if p else None, "
        "p.plugin.version if p else None, r]))"
    )
    result = python_runner(code, env={"SHARDEXT_DISABLE": "example-clamp"}, path=[str(site)])
    assert result.returncode == 0, result.stderr
    name, distribution, version, reports = json.loads(result.stdout.strip().splitlines()[-1])
    assert (name, distribution, version) == ("copied-clamp", "shardext-copied-plugin", "7.7.7")
    assert reports["copied-clamp"] == "loaded"
