"""The tools behind the ``shardext`` command: inventory, scaffold, ``verify`` and its reports.

Internal, and free of torch at import time so that ``shardext new`` and ``--help``
answer without it (the console script starts from the top-level module
``physicsnemo_shardext_cli``).

* `cli`: the argument parser and the subcommands;
* `inventory`: what ``list`` and ``doctor`` report;
* `scaffold` and ``plugin-template/``: what ``shardext new`` writes;
* `verify_command`, `model_check`, `op_trace`, `verify_html`: ``shardext verify`` a model against single-process;
* `json_schemas`: the schemas of every ``--json`` output;
* `progress`: the one progress bar (``shardext verify`` and the benchmark runner).

Examples:
    >>> from physicsnemo_shardext.tools.cli import build_parser
    >>> build_parser().prog
    'shardext'
"""
