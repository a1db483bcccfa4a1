"""Probe worlds: find the variants that kill the process before the measured world runs them.

Some cases (``Setup.may_abort``) may end a rank without an exception: a gloo
collective whose sizes differ between ranks aborts the process, and a collective
that only some ranks issue hangs. Before each measured world, `run_probes`
starts a throwaway world (``_common.launch``) that runs only those cases,
announcing each variant before and after in a file per rank, with the rank's
standard error captured. A variant announced but never finished killed the
world; the next probe world skips it, until one finishes. The measured world
then reports those variants as ``fails: ...; not run``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _common import initialize, launch
from cases import CASES, Shape, randn
from measure import Run, cotangent_like

__all__ = ["PROBE_TIMEOUT_S", "probe_world", "run_probes"]

PROBE_TIMEOUT_S = 60  # collectives of a probe world: a hang becomes a timeout
PROBE_GRACE_S = 2.0  # once a probe rank died, how long the others may take before they are stopped


def probe_world(args: argparse.Namespace) -> None:
    """Run the ``may_abort`` cases once, each variant announced before and after, stderr to a file.

    A variant announced but never finished killed the process; the gloo message (``what(): ...``) is in
    the captured stderr. Python exceptions are fine here (the real run reports them).
    """
    import physicsnemo_shardext

    rank = int(os.environ["RANK"])
    base = Path(args.probe_file)
    err = open(f"{base}.{rank}.err", "w")  # noqa: SIM115 - open until the process ends
    os.dup2(err.fileno(), 2)
    warnings.filterwarnings("ignore")
    manager = initialize(timeout_s=PROBE_TIMEOUT_S)  # a hang shows as a timeout, soon
    mesh = manager.initialize_mesh((-1,), ("domain",))
    shape = Shape(tuple(args.size), dist.get_world_size(), args.tokens, args.heads, args.head_dim)
    with open(f"{base}.{rank}", "w") as log:
        for family in args.family_list:
            for build in CASES[family]:
                torch.manual_seed(0)
                setup = build(shape)
                if not setup.may_abort:
                    continue
                for variant in ("ours", "fallback"):
                    key = f"{family}|{setup.op}|{variant}"
                    if key in args.probe_skip:
                        continue
                    log.write(f"start {key}\n")
                    log.flush()
                    context = (
                        physicsnemo_shardext.disabled(plugins=[family])
                        if variant == "fallback"
                        else contextlib.nullcontext()
                    )
                    try:
                        with context:
                            run = Run(setup, mesh, manager.device)
                            out = run.forward()
                            run.cotangent = cotangent_like(out, randn(*out.shape, seed=7).to(out.dtype))
                            run.backward(out)
                    except Exception as exc:  # noqa: BLE001 - exceptions are the real run's to report ...
                        text = f"{type(exc).__name__}: {str(exc)}".lower()
                        if any(w in text for w in ("timed out", "timeout", "connection closed", "connection reset")):
                            log.write(f"hang {key}\n")  # ... but not a collective that never completes:
                            log.flush()
                            physicsnemo_shardext.exit_rank(1)  # the group is broken now
                    dist.barrier()
                    log.write(f"done {key}\n")
                    log.flush()
    physicsnemo_shardext.shutdown()


def _abort_reason(what: str) -> str:
    """gloo's enforce message in a few words (``... 1152 vs 1024. Received data size doesn't match ...``)."""
    sizes = re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)", what)
    if sizes:
        return f"gloo: a rank received {sizes.group(1)} B where it expected {sizes.group(2)} B"
    return what.split("] ", 1)[-1]


def run_probes(args: argparse.Namespace, ranks: int, tmp: str) -> dict[str, str]:
    """Start one world of ``ranks`` that runs the ``may_abort`` cases (again, after each abort); what aborted and why."""
    shape = Shape(tuple(args.size), ranks, args.tokens, args.heads, args.head_dim)
    if not any(build(shape).may_abort for family in args.family_list for build in CASES[family]):
        return {}
    aborted: dict[str, str] = {}
    for attempt in range(8):  # one more world after each abort, skipping what is known
        probe_args = copy.copy(args)
        probe_args.probe_file = str(Path(tmp) / f"probe-{ranks}-{attempt}")
        probe_args.probe_skip = set(aborted)
        try:
            launch(probe_world, probe_args, ranks, grace_s=PROBE_GRACE_S)
            return aborted
        except Exception:  # noqa: BLE001 - a rank that died ends the launch with RanksFailed
            pass
        unfinished, hung, reason = set(), set(), "unknown"
        for rank in range(ranks):
            started, done = set(), set()
            with contextlib.suppress(OSError):
                for line in Path(f"{probe_args.probe_file}.{rank}").read_text().splitlines():
                    state, key = line.split(" ", 1)
                    {"start": started, "done": done, "hang": hung}[state].add(key)
            unfinished |= started - done
            with contextlib.suppress(OSError):
                for line in Path(f"{probe_args.probe_file}.{rank}.err").read_text().splitlines():
                    if "what():" in line:
                        reason = _abort_reason(line.split("what():", 1)[1].strip())
        if not unfinished:
            break  # died outside a variant: nothing more to learn
        if hung:
            reason = f"hangs: a collective timed out after {PROBE_TIMEOUT_S} s (ranks issue different collectives)"
        elif reason == "unknown":
            reason = "hangs or dies: the probe world ended in this variant without a gloo message"
        aborted.update({key: reason[:160] for key in unfinished})
    return aborted
