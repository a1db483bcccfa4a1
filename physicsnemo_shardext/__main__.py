"""``python -m physicsnemo_shardext`` runs the ``shardext`` command."""

import sys

from physicsnemo_shardext.cli import main

sys.exit(main())
