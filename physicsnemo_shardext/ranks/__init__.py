"""The rank runner: long-lived rank processes, their watchdog, hang reports and communication accounting.

Runtime shared by the multi-rank test fixtures and ``shardext verify``; it knows
nothing of pytest (a task names the environment its body runs in).

* `worker_pool`: the parent side, N rank processes reused across tasks;
* `worker`: the rank side, runs a `RankTask` and sends back a `RankResult`;
* `watchdog` and `hang_report`: a rank that hangs ends with a per-rank report;
* `comm_accounting` and `activation_gathers`: collectives counted, activation gathers found.

Examples:
    >>> from physicsnemo_shardext.ranks.worker import RankResult
    >>> RankResult(rank=0, outcome="passed").outcome
    'passed'
"""
