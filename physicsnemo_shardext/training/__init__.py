"""Training helpers: hybrid ddp x domain set-up, a training run verified against single process, the bootstrap.

* `parallel` (public, also as ``physicsnemo_shardext.parallel``): layout, scattering,
  DDP/FSDP2 wrapping, optimizer groups and checkpoints of a hybrid step;
* `verification` (public, also as ``physicsnemo_shardext.verification``): `verify_training`;
* `distributed`: `initialize` / `shutdown` / `distributed_session`, re-exported at the top level.

Examples:
    >>> from physicsnemo_shardext.training.parallel import ParallelLayout
    >>> from physicsnemo_shardext.parallel import ParallelLayout as Public
    >>> ParallelLayout is Public
    True
"""
