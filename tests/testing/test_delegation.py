"""check_delegation / partial_terms: a right delegation passes, a wrong one is caught."""

from __future__ import annotations

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Partial

from physicsnemo_shardext.testing import check_delegation, partial_terms


@pytest.mark.multirank(2)
def test_partial_terms_sum_to_the_full_tensor(domain_mesh, rank):
    full = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    local, partial = partial_terms(full, domain_mesh, rank)
    assert local.requires_grad and local.is_leaf
    assert tuple(partial._spec.placements) == (Partial(),)
    assert not torch.equal(local, full)  # a real share, not the whole tensor on one rank
    torch.testing.assert_close(partial.full_tensor(), full)


@pytest.mark.multirank(2)
def test_a_delegated_linear_op_passes(domain_mesh, rank):
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    check_delegation(lambda t: torch.roll(t, 1, 0), full, domain_mesh, rank, "roll_flip", (Partial(),))


@pytest.mark.multirank(2)
def test_squaring_each_term_is_caught(domain_mesh, rank):
    # (a + b)^2 != a^2 + b^2: a handler that applies a nonlinear op per term is wrong.
    def per_term_square(t):
        if isinstance(t, ShardTensor):
            return ShardTensor.from_local(t.to_local() ** 2, domain_mesh, [Partial()], sharding_shapes={})
        return t**2

    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="installed"):
        check_delegation(per_term_square, full, domain_mesh, rank, "roll_flip")
    with pytest.raises(AssertionError, match="installed"):  # without the disabled run, still caught
        check_delegation(per_term_square, full, domain_mesh, rank, "roll_flip", against_disabled=False)


@pytest.mark.multirank(2)
def test_wrong_expected_placements_are_caught(domain_mesh, rank):
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="expected"):
        check_delegation(lambda t: torch.roll(t, 1, 0), full, domain_mesh, rank, "roll_flip", ("not", "these"))
