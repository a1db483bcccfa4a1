"""measure_comms (testing/comm_measurement.py): collectives and bytes of one sharded forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from physicsnemo_shardext.testing import ShardSpec, check_conformance, measure_comms


@pytest.mark.multirank(2)
def test_a_local_op_communicates_nothing_and_a_gather_is_counted(domain_mesh):
    x = torch.randn(2, 9)
    spec = ShardSpec(domain_mesh, [Shard(1)], [5, 4])
    local = measure_comms(torch.tanh, [x], spec)
    assert local.forward.total_calls == 0 and local.backward.total_calls == 0
    gathered = measure_comms(lambda t: t.full_tensor(), [x], spec)
    assert gathered.forward.total_calls >= 1 and gathered.forward.total_bytes > 0


@pytest.mark.multirank(2)
def test_check_conformance_reports_what_measure_comms_counts(domain_mesh):
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 17, 8)
    spec = ShardSpec(domain_mesh, [Shard(2)], [10, 7])
    report = check_conformance(conv, [x], spec)
    assert str(report.comms) == str(measure_comms(conv, [x], spec))
    assert report.comms.forward.total_calls >= 1  # the halo exchange
    assert check_conformance(conv, [x], spec, count_comms=False).comms is None
