"""``python -m physicsnemo_shardext`` runs the ``shardext`` command (after an ordinary import of the package)."""

import os
import sys

from physicsnemo_shardext.tools.cli import main
from physicsnemo_shardext.training.distributed import exit_rank

code = main()
if os.environ.get("WORLD_SIZE") and sys.argv[1:2] == ["verify"]:
    exit_rank(code)  # a torchrun rank that has reported: no interpreter teardown (gloo can abort there)
sys.exit(code)
