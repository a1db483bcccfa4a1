"""Fail unless installing the given wheels would install those distributions and nothing else.

pip's dry run reports what it would install; a lane's venv already holds torch, PhysicsNeMo
and the test tools, so anything more (above all a torch wheel replacing the venv's own) means
the package's declared requirements refuse that torch.

    python .ci/check_wheel_install.py .venv/bin/python dist/*.whl
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

python, *wheels = sys.argv[1:]
with tempfile.TemporaryDirectory() as folder:
    report_path = Path(folder) / "report.json"
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--dry-run", "--report", str(report_path), *wheels],
        check=True,
    )
    report = json.loads(report_path.read_text())
names = sorted(item["metadata"]["name"] for item in report["install"])
expected = sorted(Path(wheel).name.split("-")[0].replace("_", "-") for wheel in wheels)
unexpected = [name for name in names if name.replace("_", "-") not in expected]
if unexpected:
    sys.exit(f"installing {', '.join(expected)} would also install or replace: {', '.join(unexpected)}")
if sorted(name.replace("_", "-") for name in names) != expected:  # uninstall them first: else pip installs nothing
    sys.exit(f"pip would install {names or 'nothing'}, expected exactly {expected}")
print(f"the wheels install nothing else: {', '.join(names)}")
