"""The multirank marker end to end: inner pytest runs (pytester) with passing, failing, hanging and dying ranks."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing import ShardSpec, check_conformance, shard_tensor

INNER = """
import os, time
from pathlib import Path
import pytest, torch
import torch.distributed as dist

PIDS = Path(__file__).parent / "pids.txt"

def _record(name, rank):
    with open(PIDS, "a") as f:
        f.write(f"{name} {rank} {os.getpid()}\\n")

class Config:  # a picklable fixture value defined in the test module
    def __init__(self, n):
        self.n = n

@pytest.fixture
def config():
    return Config(3)

@pytest.mark.multirank(2)
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_a_passes(rank, world_size, domain_mesh, config, scale):
    _record("a", rank)
    t = torch.full((config.n,), scale * (rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3 * scale] * 3 and world_size == 2
    assert torch.initial_seed() == 1234  # same seed on every rank

@pytest.mark.multirank(2)
def test_b_fails_on_rank_1(rank):
    _record("b", rank)
    assert rank == 0, f"rank {rank} disagrees"

@pytest.mark.multirank(2, timeout=10)
def test_c_hangs_on_rank_1(rank):
    _record("c", rank)
    if rank == 1:
        dist.barrier()  # rank 0 never joins

@pytest.mark.multirank(2)
def test_d_dies_on_rank_1(rank):
    _record("d", rank)
    if rank == 1:
        os._exit(7)
    time.sleep(0.5)

@pytest.mark.multirank(2)
def test_e_after_trouble(rank):
    _record("e", rank)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]

@pytest.mark.multirank(2)
def test_f_skip_inside(rank):
    pytest.skip("skipped on the ranks")
"""


def _recorded(path: Path) -> dict[str, dict[int, int]]:
    table: dict[str, dict[int, int]] = {}
    for line in path.read_text().splitlines():
        name, rank, pid = line.split()
        table.setdefault(name, {})[int(rank)] = int(pid)
    return table


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_failing_hanging_and_dying_ranks_are_reported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", timeout=300)
    result.assert_outcomes(passed=3, failed=3, skipped=1)
    out = result.stdout.str()

    # failing rank: per-rank report with rank 1's traceback
    result.stdout.fnmatch_lines(
        [
            "*test_b_fails_on_rank_1*",
            "multirank(2) test failed on rank(s) [[]1[]]*",
            "rank 0: passed*",
            "rank 1: failed*",
            "*assert rank == 0*",
            "*AssertionError: rank 1 disagrees*",
        ]
    )
    # hanging rank: reported within the 10 s timeout, with the collective it waits in and its
    # Python stacks, innermost call last
    result.stdout.fnmatch_lines(
        [
            "multirank(2) test rank(s) [[]1[]] hung (no result within 10 s)*",
            "rank 0: passed*",
            "rank 1: HUNG, Python stacks at the timeout:",
            "*pending collective: barrier() over a process group of 2 ranks, issued at *test_inner.py:* in "
            "test_c_hangs_on_rank_1 (thread MainThread, waiting *",
            "*Thread MainThread:",
            "*test_inner.py*in test_c_hangs_on_rank_1*",
            "*, in barrier",
        ]
    )
    # dying rank: its exit code
    result.stdout.fnmatch_lines(["*rank 1: DIED with exit code 7*"])
    assert "SKIPPED" in out and "skipped on the ranks" in out

    # The pool was rebuilt after each incident, and nothing is left running.
    pids = _recorded(pytester.path / "pids.txt")
    assert set(pids["a"]) == set(pids["e"]) == {0, 1}
    assert pids["a"][0] == pids["b"][0]  # reused across passing tests
    assert pids["b"][0] != pids["c"][0] != pids["d"][0] != pids["e"][0]  # fresh pool after trouble
    every_pid = {pid for ranks in pids.values() for pid in ranks.values()}
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in every_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in every_pid), [p for p in every_pid if not _gone(p)]


def test_no_worker_left_behind_in_this_process() -> None:
    # Pools of this session are alive until the session ends, but never more than one per world size.
    children = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    # Spawned ranks run ``spawn_main``; multiprocessing's resource tracker is not a rank.
    workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(workers) <= 1 + 2 + 4, workers  # the suite's worlds: 1, 2 and 4 ranks


def test_torchrun_world_size_mismatch_skips_with_reason(pytester: pytest.Pytester, monkeypatch) -> None:
    pytester.makepyfile(
        test_inner="""
import pytest

@pytest.mark.multirank(2)
def test_two():
    pass

def test_plain():
    pass
"""
    )
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*multirank(2) test, but torchrun launched 3 ranks (WORLD_SIZE=3)*"])


def test_misuse_is_explained(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
import threading, pytest

@pytest.fixture
def lock():
    return threading.Lock()

def test_mesh_outside_multirank(domain_mesh):
    pass

@pytest.mark.multirank(2)
def test_needs_lock(lock):
    pass
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1, failed=1)
    result.stdout.fnmatch_lines(["*fixture 'domain_mesh' only exists in @pytest.mark.multirank tests*"])
    result.stdout.fnmatch_lines(["*argument 'lock' of multirank test cannot be sent to the ranks*"])


@pytest.mark.multirank(2)
def test_monkeypatch_on_a_rank_sets_the_value(monkeypatch, rank):
    monkeypatch.setenv("SHARDEXT_TEST_MONKEYPATCH_LEAK", str(rank))
    assert os.environ["SHARDEXT_TEST_MONKEYPATCH_LEAK"] == str(rank)


@pytest.mark.multirank(2)
def test_monkeypatch_on_a_rank_is_undone_before_the_next_test(rank):
    # Runs in the same long-lived workers as the test above (same pool, file order).
    assert "SHARDEXT_TEST_MONKEYPATCH_LEAK" not in os.environ


@pytest.mark.parametrize("ranks", [pytest.param(n, marks=pytest.mark.multirank(n), id=f"{n}ranks") for n in (2, 4)])
def test_spatial_mesh_is_two_dimensional_on_two_and_four_ranks(spatial_mesh, world_size, rank, ranks):
    # (2, N/2): (2, 1) on 2 ranks, so 2-D tests also run under torchrun --nproc-per-node 2.
    assert world_size == ranks
    assert spatial_mesh.ndim == 2 and spatial_mesh.mesh_dim_names == ("h", "w")
    assert tuple(spatial_mesh.shape) == (2, ranks // 2)
    hs, ws = [3, 5], {2: [6], 4: [4, 2]}[ranks]
    spec = ShardSpec(spatial_mesh, [Shard(2), Shard(3)], {0: hs, 1: ws})
    full = torch.randn(1, 2, 8, 6)
    xs = shard_tensor(full, spatial_mesh, spec.placements, spec.sizes_by_mesh_dim, requires_grad=True)
    h, w = spatial_mesh.get_coordinate()
    assert xs.to_local().shape == (1, 2, hs[h], ws[w])
    assert torch.equal(xs.full_tensor(), full)
    check_conformance(torch.nn.Conv2d(2, 3, 3, padding=1), [full], spec)


_GATHER_DEPRECATION = "`torch.distributed._functional_collectives.all_gather_tensor` is deprecated"


@pytest.mark.multirank(2)
def test_physicsnemos_gather_deprecation_is_not_shown_in_rank_bodies(domain_mesh):
    full = torch.randn(2, 17, 8)
    xs = shard_tensor(full, domain_mesh, [Shard(1)], [10, 7])
    with warnings.catch_warnings(record=True) as unfiltered:
        warnings.simplefilter("always")  # in front of the body's filters: shows what PhysicsNeMo emits
        xs.full_tensor()
    if not any(_GATHER_DEPRECATION in str(w.message) for w in unfiltered):
        pytest.skip("PhysicsNeMo no longer gathers through the deprecated all_gather_tensor")
    with warnings.catch_warnings(record=True) as caught:  # the body's filters, recording what they let through
        check_conformance(torch.nn.LayerNorm(8), [full], ShardSpec(domain_mesh, [Shard(1)], [10, 7]))
        warnings.warn("another FutureWarning still shows", FutureWarning, stacklevel=1)
    messages = [str(w.message) for w in caught]
    assert not any(_GATHER_DEPRECATION in m for m in messages), messages
    assert "another FutureWarning still shows" in messages
