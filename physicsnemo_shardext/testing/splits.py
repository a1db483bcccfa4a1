"""Split-size cases for one sharded dimension: even, balanced, uneven, with an empty shard.

`split_cases` lists the ways a dimension of ``length`` can be split over
``world_size`` ranks that a handler should survive. Each case is a `SplitCase`, a
plain ``list`` of sizes (so it goes straight into `shard_tensor` or `ShardSpec`)
that also carries its kind and a readable id. The pytest plugin names
parametrized tests after that id (``test_op[uneven-6-11]``), so no ``ids=`` is
needed; the cases pickle, so they reach the ranks of a multirank test.

Examples:
    In a test module:

    ```python
    @pytest.mark.multirank(2)
    @pytest.mark.parametrize("sizes", split_cases(17, 2))
    def test_tanh(domain_mesh, sizes):
        xs = shard_tensor(torch.randn(3, 17), domain_mesh, [Shard(1)], sizes)
        ...
    ```

    The cases themselves:

    >>> [case.id for case in split_cases(17, 2)]
    ['balanced-9-8', 'uneven-6-11', 'empty-17-0']
    >>> [case.id for case in split_cases(8, 4, allow_empty=False)]
    ['even-2-2-2-2', 'uneven-1-2-2-3']
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["SplitCase", "split_cases"]

#: The kinds `split_cases` yields, in this order (a kind is left out where it does not apply).
KINDS = ("even", "balanced", "uneven", "empty")


class SplitCase(list):  # type: ignore[type-arg]
    """One split: the sizes per rank (a ``list``), with its ``kind`` and a readable ``id``.

    Examples:
        >>> case = SplitCase("uneven", [6, 11])
        >>> case, case.kind, case.id, sum(case)
        ([6, 11], 'uneven', 'uneven-6-11', 17)
    """

    def __init__(self, kind: str, sizes: Iterable[int]) -> None:
        super().__init__(int(size) for size in sizes)
        self.kind = kind

    @property
    def id(self) -> str:
        """``kind-size-size-...``: the test id pytest shows for this case."""
        return "-".join([self.kind, *map(str, self)])

    def __reduce__(self) -> tuple[Any, ...]:
        return (SplitCase, (self.kind, list(self)))


def _balanced(length: int, parts: int) -> list[int]:
    """Sizes differing by at most one, the larger first."""
    base, extra = divmod(length, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def _proportional(length: int, weights: list[int], min_size: int) -> list[int] | None:
    """``length`` split in proportion to ``weights`` (largest remainders), each part ``>= min_size``."""
    spare = length - min_size * len(weights)
    if spare < 0:
        return None
    total = sum(weights)
    exact = [spare * weight / total for weight in weights]
    sizes = [int(value) for value in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (sizes[i] - exact[i], -i))
    for index in by_remainder[: spare - sum(sizes)]:
        sizes[index] += 1
    return [size + min_size for size in sizes]


def split_cases(length: int, world_size: int, *, min_size: int = 1, allow_empty: bool = True) -> list[SplitCase]:
    """The split-size lists of one dim of ``length`` over ``world_size`` ranks worth testing.

    In this order, each only where it applies and differs from the cases before it:

    * ``even``: all shards equal (when ``world_size`` divides ``length``);
    * ``balanced``: sizes differing by at most one, larger first (when it does not);
    * ``uneven``: rank ``r`` gets a share proportional to ``r + 1``, each at least ``min_size``;
    * ``empty`` (with ``allow_empty``): rank ``world_size // 2`` holds nothing, the others
      split the rest as ``balanced`` does, each at least ``min_size`` (the last rank of 2;
      an inner rank of more, so its neighbours must skip it).

    A list rather than a generator: pytest deprecates passing iterators to ``parametrize``.

    Args:
        length: size of the sharded tensor dimension.
        world_size: number of shards (the size of the mesh dim).
        min_size: the smallest non-empty shard to generate (say, a halo width).
        allow_empty: also list a split in which one rank holds nothing.

    Returns:
        The cases, as `SplitCase` lists of ``world_size`` sizes adding up to ``length``.

    Examples:
        >>> split_cases(12, 3)
        [[4, 4, 4], [2, 4, 6], [6, 0, 6]]
        >>> [case.id for case in split_cases(5, 4, min_size=2)]   # too short for shards of 2
        []
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if length < 0 or min_size < 1:
        raise ValueError(f"need length >= 0 and min_size >= 1, got length={length}, min_size={min_size}")
    return list(_cases(length, world_size, min_size, allow_empty))


def _cases(length: int, world_size: int, min_size: int, allow_empty: bool) -> Iterator[SplitCase]:
    seen: list[list[int]] = []

    def fresh(kind: str, sizes: list[int] | None) -> Iterator[SplitCase]:
        if sizes is not None and sizes not in seen:
            seen.append(sizes)
            yield SplitCase(kind, sizes)

    if length >= min_size * world_size:
        balanced = _balanced(length, world_size)
        yield from fresh("even" if length % world_size == 0 else "balanced", balanced)
        yield from fresh("uneven", _proportional(length, list(range(1, world_size + 1)), min_size))
    if allow_empty and world_size > 1 and length >= min_size * (world_size - 1):
        rest = _balanced(length, world_size - 1)
        empty_rank = world_size // 2
        yield from fresh("empty", rest[:empty_rank] + [0] + rest[empty_rank:])
