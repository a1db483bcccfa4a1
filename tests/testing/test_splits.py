"""split_cases (testing/splits.py): the split-size cases of one dim, their ids, and their use in multirank tests."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing import ShardSpec, SplitCase, check_conformance, shard_tensor, split_cases


@pytest.mark.parametrize("length,world_size", [(17, 2), (16, 4), (12, 3), (5, 4), (2, 2), (7, 1), (100, 7)])
def test_every_case_partitions_the_dim(length, world_size):
    cases = split_cases(length, world_size)
    assert cases, "at least one case"
    for case in cases:
        assert isinstance(case, SplitCase) and len(case) == world_size and sum(case) == length
        assert case.kind in ("even", "balanced", "uneven", "empty")
        assert all(size >= 1 for size in case) or case.kind == "empty"
    assert len({tuple(case) for case in cases}) == len(cases), "no case twice"
    kinds = [case.kind for case in cases]
    assert kinds == sorted(kinds, key=("even", "balanced", "uneven", "empty").index)


def test_cases_by_kind():
    assert [case.id for case in split_cases(16, 4)] == ["even-4-4-4-4", "uneven-2-3-5-6", "empty-6-5-0-5"]
    assert [case.id for case in split_cases(17, 2)] == ["balanced-9-8", "uneven-6-11", "empty-17-0"]
    assert [case.kind for case in split_cases(17, 2, allow_empty=False)] == ["balanced", "uneven"]


def test_min_size_is_respected_or_the_case_left_out():
    for case in split_cases(20, 4, min_size=3):
        assert all(size >= 3 for size in case if size)
    assert [case.kind for case in split_cases(7, 4, min_size=2)] == ["empty"]  # 3 shards of >= 2 fit, 4 do not
    assert split_cases(3, 4, min_size=2) == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        split_cases(4, 0)
    with pytest.raises(ValueError, match="min_size"):
        split_cases(4, 2, min_size=0)


def test_a_case_is_a_list_that_pickles():
    case = SplitCase("uneven", [6, 11])
    assert case == [6, 11] and list(case) == [6, 11]
    again = pickle.loads(pickle.dumps(case))
    assert again == case and again.kind == "uneven" and again.id == "uneven-6-11"


@pytest.mark.parametrize("sizes", split_cases(17, 2))
def test_parametrize_ids_are_readable(request, sizes):
    assert request.node.name == f"test_parametrize_ids_are_readable[{sizes.id}]"


@pytest.mark.multirank(2)
@pytest.mark.parametrize("sizes", split_cases(17, 2))
def test_cases_feed_shard_tensor_on_two_ranks(domain_mesh, rank, sizes):
    assert isinstance(sizes, SplitCase)  # pickled to the rank as it is
    full = torch.randn(3, 17, 4)
    xs = shard_tensor(full, domain_mesh, [Shard(1)], sizes)
    assert xs.to_local().shape == (3, sizes[rank], 4)
    assert torch.equal(xs.full_tensor(), full)
    check_conformance(torch.nn.Tanh(), [full], ShardSpec(domain_mesh, [Shard(1)], sizes))


@pytest.mark.multirank(4)
@pytest.mark.parametrize("sizes", split_cases(10, 4))
def test_cases_feed_shard_tensor_on_four_ranks(domain_mesh, rank, sizes):
    full = torch.randn(10, 3)
    xs = shard_tensor(full, domain_mesh, [Shard(0)], sizes)
    assert xs.to_local().shape == (sizes[rank], 3)
    assert torch.equal(xs.full_tensor(), full)
