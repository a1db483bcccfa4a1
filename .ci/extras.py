"""Print the requirements of one optional-dependency group of pyproject.toml, one per line.

The lanes install the test tools before the package itself, so that installing the
package's wheel afterwards can be checked to install nothing else.

    python .ci/extras.py test
"""

import sys
import tomllib
from pathlib import Path

pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
for requirement in pyproject["project"]["optional-dependencies"][sys.argv[1]]:
    print(requirement)
