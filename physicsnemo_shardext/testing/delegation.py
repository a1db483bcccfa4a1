"""Test that an override hands a configuration to what it replaced, and that the result is right.

The override rule (``docs/writing-a-plugin.md``) says a handler delegates what it does not
handle. `check_delegation` proves one such configuration on a rank: the sharded call
matches single-process in value and in every input gradient, and equals, exactly, the same
call with the plugin switched off (the built-in or DTensor fallback it replaced).
The input is a ``Partial(sum)`` ShardTensor from `partial_terms`, the configuration
most overrides delegate.

Examples:
    In a ``@pytest.mark.multirank(2)`` test:

    ```python
    check_delegation(lambda t: torch.roll(t, 1, 0), torch.randn(4, 3), domain_mesh, rank, "roll_flip")
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["check_delegation", "partial_terms"]


def partial_terms(full: torch.Tensor, mesh: Any, rank: int, seed: int = 1) -> tuple[torch.Tensor, Any]:
    """This rank's term (a leaf that requires grad) and the ``Partial(sum)`` ShardTensor of all terms.

    The terms are random positive shares of ``full`` (the same draw on every rank), so
    they add up to ``full`` over the ranks of the 1-D ``mesh``.

    Examples:
        In a ``@pytest.mark.multirank(2)`` test:

        ```python
        local, partial = partial_terms(torch.randn(2, 5), domain_mesh, rank)
        partial.full_tensor()  # == the full tensor, up to rounding
        ```
    """
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Partial

    size = mesh.size()
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand((size, *full.shape), generator=generator, dtype=full.dtype) + 0.1
    shares = weights / weights.sum(0)
    local = (full.detach() * shares[rank]).requires_grad_(True)
    return local, ShardTensor.from_local(local, mesh, [Partial()], sharding_shapes={})


def check_delegation(
    fn: Callable[[Any], Any],
    full: torch.Tensor,
    mesh: Any,
    rank: int,
    plugin: str,
    placements: Sequence[Any] | None = None,
    *,
    exact: bool = True,
    against_disabled: bool = True,
) -> None:
    """Assert ``fn`` of a ``Partial(sum)`` input is right, and is what runs with ``plugin`` disabled.

    Checks, on this rank: the output's placements (``placements``, or the disabled run's);
    its value against ``fn(full)``; the gradient of this rank's term against the
    single-process input gradient (each summand gets the whole gradient), under a random
    cotangent; and local outputs and gradients equal to the plugin-disabled run (bit for
    bit when ``exact``). ``against_disabled=False`` skips the disabled run, for a delegate
    known to be wrong on this torch (say why at the call).

    Examples:
        In a ``@pytest.mark.multirank(2)`` test:

        ```python
        check_delegation(lambda t: torch.softmax(t, 0), full, domain_mesh, rank, "softmax_cumsum", (Replicate(),))
        ```
    """
    import physicsnemo_shardext

    reference = full.detach().clone().requires_grad_(True)
    expected = fn(reference)
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=expected.dtype)
    (expected * cotangent).sum().backward()
    runs = []
    for disabled in (False, True) if against_disabled else (False,):
        local, partial = partial_terms(full, mesh, rank)
        if disabled:
            with physicsnemo_shardext.disabled(plugins=[plugin]):
                out = fn(partial)
        else:
            out = fn(partial)
        value = out.full_tensor()
        torch.testing.assert_close(
            value, expected, msg=lambda m: f"{plugin} {'disabled' if disabled else 'installed'}: {m}"
        )
        (value * cotangent).sum().backward()
        torch.testing.assert_close(local.grad, reference.grad, msg=lambda m: f"input gradient: {m}")
        runs.append((tuple(out._spec.placements), out.to_local(), local.grad))
    ours, our_local, our_grad = runs[0]
    if placements is not None:
        assert ours == tuple(placements), f"placements {ours} != expected {tuple(placements)}"
    if not against_disabled:
        return
    theirs, their_local, their_grad = runs[1]
    assert ours == theirs, f"placements {ours} differ from the delegate's {theirs}"
    tolerance: dict[str, Any] = {"rtol": 0, "atol": 0} if exact else {}
    torch.testing.assert_close((our_local, our_grad), (their_local, their_grad), **tolerance)
