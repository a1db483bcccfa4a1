"""Tests of physicsnemo_shardext/primitives/profiling.py: a named range only while a profiler records."""

from __future__ import annotations

import torch

from physicsnemo_shardext.primitives import profiled_range


def test_no_profiler_no_range_object():
    # The hot path: one shared no-op context, nothing built per call.
    assert profiled_range("shardext.a") is profiled_range("shardext.b")
    with profiled_range("shardext.a") as entered:
        assert entered is None


def test_the_range_is_recorded_while_profiling():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiled_range("shardext.test_range"):
            torch.ones(3).sum()
    names = [event.name for event in prof.events()]
    assert names.count("shardext.test_range") == 1, names
