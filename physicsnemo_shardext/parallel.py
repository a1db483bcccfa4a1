"""`physicsnemo_shardext.training.parallel`, under the name it had before the training wing (it keeps working).

The implementation, its documentation and its examples are in
`physicsnemo_shardext.training.parallel`; this module re-exports its public names.

Examples:
    >>> import physicsnemo_shardext.parallel as old
    >>> import physicsnemo_shardext.training.parallel as new
    >>> all(getattr(old, name) is getattr(new, name) for name in new.__all__)
    True
"""

from physicsnemo_shardext.training.parallel import *  # noqa: F403 - the old import path re-exports the public names
from physicsnemo_shardext.training.parallel import __all__ as __all__
