"""Property-based fuzzing of layout-op chains on uneven ShardTensors (issue 29, item 2).

A *chain* is data: a list of op descriptors (reshape/view/flatten/unflatten,
permute/transpose/movedim, basic indexing with ellipsis, steps, negative
indices and ``None``, unbind/split/chunk, cat/stack, and in-place updates such
as ``t[idx] = v``, ``t[idx].add_(c)``, ``t.transpose(..).mul_(c)``). Hypothesis
draws it from the shape, one op at a time, and each op is tried on a small plain
tensor while drawing, so only chains valid in single-process torch are kept.
One interpreter (`apply_op`) runs the chain on the plain tensor and on a
ShardTensor of the same values (random uneven splits, empty shards included, on
a 1-D mesh of 2 ranks and a 2x2 mesh), and the result is fed to a consumer that
cares about strides (``scaled_dot_product_attention``, matmul/einsum, conv,
group/layer norm, ``torch.fft.rfft``). The values of the chain and of the
consumer, the input gradient of a random-weighted sum and the consumer's
parameter gradients must equal single-process, or the sharded run must raise
``NotImplementedError`` (``MissingShardPatch``): refusals are counted, any
other exception is a failure.

Every rank runs the same examples: hypothesis is derandomized (a fixed seed,
no database), and the outcome of each example is agreed over the ranks (one
all-reduce) so that the ranks take the same branch when hypothesis shrinks.

Budgets: ``FUZZ_1D``/``FUZZ_2D`` examples in CI; ``SHARDEXT_FUZZ_EXAMPLES=N``
runs N examples on each mesh instead (``SHARDEXT_FUZZ_SHRINK=1`` also shrinks a
failure to a minimal chain; ``SHARDEXT_FUZZ_TRACE=DIR`` makes each rank append every case
and its own error to ``DIR/rank<r>.txt``, which names the case when ranks diverge and
hang), and the ``slow`` cells (``--run-slow`` /
``SHARDEXT_RUN_SLOW=1``) run the long budget, with shrinking. See docs/testing.md.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: CI budgets (examples per mesh) and the long budget of the slow cells.
FUZZ_1D, FUZZ_2D = 40, 15
LONG_1D, LONG_2D = 400, 120
EXAMPLES_ENV, SHRINK_ENV, REPORT_ENV = "SHARDEXT_FUZZ_EXAMPLES", "SHARDEXT_FUZZ_SHRINK", "SHARDEXT_FUZZ_REPORT"
TRACE_ENV = "SHARDEXT_FUZZ_TRACE"

#: Known bugs, each with an xfail(strict) regression test in test_layout_ops.py; left out of the CI run
#: so that it fails on new bugs only. ``SHARDEXT_FUZZ_STRICT=1`` puts them back.
STRICT_ENV = "SHARDEXT_FUZZ_STRICT"
#: (None left: an in-place op on a view made by a layout/indexing handler, ``t[idx].mul_(c)``, which
#: gave silently wrong gradients, is now refused while a graph is built and counts as a refusal;
#: test_fuzz_in_place_update_of_a_handler_view_is_refused.)
KNOWN_SILENT_OPS: tuple[str, ...] = ()
#: The backward of group_norm of a batch-sharded input with an empty shard, on a 2x2 mesh, after a
#: flatten moved the shard to the batch dim: a reshape error in the normalization family
#: (test_group_norm_after_a_flatten_with_an_empty_shard_backpropagates).
KNOWN_ERRORS = ("is invalid for input of size",)


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


MAX_NUMEL = 768
MAX_NDIM = 5
DTYPE = torch.float64

Op = tuple  # ("name", *args): printable, picklable, the same on every rank


# -- the interpreter ------------------------------------------------------------------------------
def _value_for(shape: Sequence[int], seed: int) -> torch.Tensor:
    """A plain tensor of ``shape`` (a replicated value), the same on every rank."""
    return torch.randn(tuple(shape), dtype=DTYPE, generator=torch.Generator().manual_seed(seed))


def apply_op(t: torch.Tensor, op: Op) -> torch.Tensor:
    """Apply one op descriptor to ``t`` (plain or ShardTensor) and return the chain's next tensor."""
    name, *args = op
    if name in ("reshape", "view"):
        return getattr(t, name)(args[0])
    if name == "flatten":
        return torch.flatten(t, args[0], args[1])
    if name == "unflatten":
        return t.unflatten(args[0], args[1])
    if name == "permute":
        return t.permute(*args[0])
    if name == "transpose":
        return t.transpose(args[0], args[1])
    if name == "movedim":
        return torch.movedim(t, args[0], args[1])
    if name == "contiguous":
        return t.contiguous()
    if name == "getitem":
        return t[args[0]]
    if name == "unbind":
        return t.unbind(args[0])[args[1]]
    if name == "split":  # split_size_or_sections, dim, which piece
        return torch.split(t, args[0], dim=args[1])[args[2]]
    if name == "chunk":
        return t.chunk(args[0], dim=args[1])[args[2]]
    if name == "split_cat":  # the pieces of a split, concatenated back in another order
        sections, dim, order = args
        pieces = torch.split(t, sections, dim=dim)
        return torch.cat([pieces[i] for i in order], dim=dim)
    if name == "chunk_stack":  # equal chunks stacked along a new dim
        n, dim, new_dim = args
        return torch.stack(t.chunk(n, dim=dim), dim=new_dim)
    if name == "cat_self":
        return torch.cat([t, t * 2.0], dim=args[0])
    if name == "stack_self":
        return torch.stack([t, t * 0.5], dim=args[0])
    if name == "setitem":  # t[idx] = scalar | plain tensor | a function of t itself
        idx, kind, seed = args
        if kind == "scalar":
            t[idx] = 0.25
        elif kind == "plain":
            t[idx] = _value_for(torch.zeros(t.shape, device="meta")[idx].shape, seed)
        else:
            t[idx] = t[idx] * 3.0
        return t
    if name in ("add_view", "mul_view"):  # an in-place update of a view of t: t must see it
        idx, c = args
        view = t[idx]
        view.add_(c) if name == "add_view" else view.mul_(c)
        return t
    if name == "transpose_mul_":
        d0, d1, c = args
        t.transpose(d0, d1).mul_(c)
        return t
    if name in ("add_", "mul_"):
        return getattr(t, name)(args[0])
    raise ValueError(f"unknown op {op!r}")


def run_chain(x: torch.Tensor, chain: Sequence[Op]) -> torch.Tensor:
    """``x * 1`` (a non-leaf, so in-place ops are legal), then every op of ``chain``."""
    t = x * 1.0
    for op in chain:
        t = apply_op(t, op)
    return t


# -- consumers: ops that care about the strides of what they are given ------------------------------
@dataclass(frozen=True)
class Consumer:
    """A consumer: its name and the seed of its (replicated) parameters."""

    name: str
    seed: int = 0

    def params(self, shape: Sequence[int]) -> list[torch.Tensor]:
        """Plain parameters (fresh leaves), the same on every rank."""
        g = torch.Generator().manual_seed(self.seed)
        rand = lambda *s: torch.randn(s, dtype=DTYPE, generator=g).requires_grad_(True)  # noqa: E731
        if self.name == "matmul":
            return [rand(shape[-1], 3)]
        if self.name == "einsum":
            return [rand(shape[-1], 2)]
        if self.name == "conv1d":
            return [rand(2, shape[1], 3), rand(2)]
        if self.name == "conv2d":
            return [rand(2, shape[1], 3, 3), rand(2)]
        if self.name == "group_norm":
            return [rand(shape[1]), rand(shape[1])]
        if self.name == "layer_norm":
            return [rand(shape[-1]), rand(shape[-1])]
        return []

    def __call__(self, t: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.name == "sdpa":
            return F.scaled_dot_product_attention(t, t * 0.5, t.tanh(), is_causal=bool(self.seed % 2))
        if self.name == "matmul":
            return t @ params[0]
        if self.name == "self_matmul":
            return torch.matmul(t, t.transpose(-1, -2))
        if self.name == "einsum":
            return torch.einsum("...i,ij->...j", t, params[0])
        if self.name == "conv1d":
            return F.conv1d(t, params[0], params[1], padding=1)
        if self.name == "conv2d":
            return F.conv2d(t, params[0], params[1], padding=1)
        if self.name == "group_norm":
            groups = max(g for g in (1, 2, 3) if t.shape[1] % g == 0)
            return F.group_norm(t, groups, params[0], params[1])
        if self.name == "layer_norm":
            return F.layer_norm(t, (t.shape[-1],), params[0], params[1])
        if self.name == "rfft":
            return torch.view_as_real(torch.fft.rfft(t, dim=-1))
        raise ValueError(self.name)


def consumers_for(shape: Sequence[int]) -> list[str]:
    """The consumers that accept a tensor of ``shape`` ("none" first: what shrinking goes to)."""
    n = len(shape)
    names = ["none", "matmul", "einsum", "layer_norm", "rfft"] if n >= 1 else ["none"]
    if n >= 2:
        names.append("self_matmul")
        names.append("group_norm")
    if n == 4:
        names.append("sdpa")
    if n == 3:
        names.append("conv1d")
    if n == 4:
        names.append("conv2d")
    return names


# -- drawing chains ----------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


@st.composite
def _basic_index(draw: st.DrawFn, shape: Sequence[int], allow_none: bool = True) -> tuple:
    """A basic index: ints (negative too), slices with steps, ``None`` and one ``...``."""
    n = len(shape)
    k = draw(st.integers(0, n))  # dims indexed explicitly
    ellipsis_at = draw(st.one_of(st.none(), st.integers(0, k)))
    if ellipsis_at is None:
        dims = list(range(k))
    else:  # the explicit entries before ... index the leading dims, those after it the trailing ones
        dims = list(range(ellipsis_at)) + list(range(n - (k - ellipsis_at), n))
    entries: list[Any] = []
    for d in dims:
        size = shape[d]
        kind = draw(st.sampled_from(["slice", "int", "full"]))
        if kind == "int":
            entries.append(draw(st.integers(-size, size - 1)))
        elif kind == "full":
            entries.append(slice(None))
        else:
            start = draw(st.one_of(st.none(), st.integers(-size, size - 1)))
            stop = draw(st.one_of(st.none(), st.integers(-size, size)))
            step = draw(st.sampled_from([None, 1, 2, 3]))
            entries.append(slice(start, stop, step))
    if ellipsis_at is not None:
        entries.insert(ellipsis_at, Ellipsis)
    if allow_none and draw(st.booleans()):
        entries.insert(draw(st.integers(0, len(entries))), None)
    return tuple(entries)


@st.composite
def draw_op(draw: st.DrawFn, shape: Sequence[int]) -> Op:
    """One op descriptor that makes sense for ``shape`` (validity is checked by running it)."""
    n = len(shape)
    dim = st.integers(-n, n - 1)
    kinds = [
        "reshape",
        "view",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "movedim",
        "contiguous",
        "getitem",
        "unbind",
        "split",
        "chunk",
        "split_cat",
        "chunk_stack",
        "cat_self",
        "stack_self",
        "setitem",
        "add_view",
        "mul_view",
        "transpose_mul_",
        "add_",
        "mul_",
    ]
    kind = draw(st.sampled_from(kinds if _strict() else [k for k in kinds if k not in KNOWN_SILENT_OPS]))
    if kind in ("reshape", "view"):
        new = list(shape)
        d = draw(st.integers(0, n - 1))
        if draw(st.booleans()) and _divisors(shape[d]):  # split a dim in two
            a = draw(st.sampled_from(_divisors(shape[d])))
            new[d : d + 1] = [a, shape[d] // a]
        elif n >= 2:  # merge a run of dims
            e = draw(st.integers(d, n - 1))
            new[d : e + 1] = [math.prod(shape[d : e + 1])]
        if draw(st.booleans()):
            new[draw(st.integers(0, len(new) - 1))] = -1
        return (kind, tuple(new))
    if kind == "flatten":
        a, b = sorted(draw(st.tuples(dim, dim)), key=lambda v: v % n)
        return (kind, a, b)
    if kind == "unflatten":
        d = draw(dim)
        divisors = _divisors(shape[d])
        if not divisors:
            return ("unflatten", d, (1, shape[d]))
        a = draw(st.sampled_from(divisors))
        return (kind, d, (a, draw(st.sampled_from([shape[d] // a, -1]))))
    if kind == "permute":
        return (kind, tuple(draw(st.permutations(range(n)))))
    if kind == "transpose":
        return (kind, draw(dim), draw(dim))
    if kind == "movedim":
        return (kind, draw(dim), draw(dim))
    if kind == "contiguous":
        return (kind,)
    if kind == "getitem":
        return (kind, draw(_basic_index(shape)))
    if kind == "unbind":
        d = draw(dim)
        return (kind, d, draw(st.integers(-shape[d], shape[d] - 1)))
    if kind == "split":
        d = draw(dim)
        if draw(st.booleans()):
            size = draw(st.integers(1, max(1, shape[d])))
            return (kind, size, d, draw(st.integers(0, -(-shape[d] // size) - 1)))
        cut = draw(st.integers(0, shape[d]))
        return (kind, [cut, shape[d] - cut], d, draw(st.integers(0, 1)))
    if kind == "chunk":
        d = draw(dim)
        chunks = draw(st.integers(1, 3))
        return (kind, chunks, d, draw(st.integers(0, len(torch.zeros(shape[d]).chunk(chunks)) - 1)))
    if kind == "split_cat":
        d = draw(dim)
        cuts = sorted(draw(st.lists(st.integers(0, shape[d]), min_size=1, max_size=2)))
        sections = [b - a for a, b in zip([0, *cuts], [*cuts, shape[d]])]
        return (kind, sections, d, tuple(draw(st.permutations(range(len(sections))))))
    if kind == "chunk_stack":
        d = draw(dim)
        divisors = [v for v in (1, 2, 3) if shape[d] % v == 0]
        return (kind, draw(st.sampled_from(divisors)), d, draw(st.integers(-n - 1, n)))
    if kind == "cat_self":
        return (kind, draw(dim))
    if kind == "stack_self":
        return (kind, draw(st.integers(-n - 1, n)))
    if kind == "setitem":
        return (
            kind,
            draw(_basic_index(shape)),
            draw(st.sampled_from(["scalar", "plain", "self"])),
            draw(st.integers(0, 99)),
        )
    if kind in ("add_view", "mul_view"):
        return (kind, draw(_basic_index(shape)), draw(st.sampled_from([0.5, -2.0])))
    if kind == "transpose_mul_":
        return (kind, draw(dim), draw(dim), 1.5)
    return (kind, draw(st.sampled_from([0.5, -3.0])))


def _simulate(shape: Sequence[int], chain: Sequence[Op]) -> torch.Tensor | None:
    """The chain on a plain tensor that requires grad (as the real run), or None if torch refuses it."""
    try:
        out = run_chain(torch.zeros(tuple(shape), dtype=DTYPE, requires_grad=True), chain)
    except Exception:  # noqa: BLE001 - invalid in single-process torch: not a chain to test
        return None
    return out


@st.composite
def draw_chain(draw: st.DrawFn, shape: Sequence[int], max_ops: int = 5) -> list[Op]:
    """A chain of ``max_ops`` ops at most, each valid on the shape (and strides) the chain has reached."""
    chain: list[Op] = []
    current = tuple(shape)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(draw_op(current))
        out = _simulate(shape, [*chain, op])
        if out is None or out.dim() == 0 or out.dim() > MAX_NDIM or not 0 < out.numel() <= MAX_NUMEL:
            continue  # invalid or degenerate: drop the op (shrinks towards shorter chains)
        chain.append(op)
        current = tuple(out.shape)
    return chain


@dataclass(frozen=True)
class Case:
    """One example: the input, its sharding, the chain and the consumer."""

    shape: tuple[int, ...]
    placements: tuple  # one per mesh dim
    sizes: dict[int, list[int]]
    chain: list[Op]
    consumer: Consumer
    seed: int

    def __repr__(self) -> str:
        return (
            f"Case(shape={self.shape}, placements={list(self.placements)}, sizes={self.sizes}, "
            f"chain={self.chain}, consumer={self.consumer.name!r}/{self.consumer.seed}, seed={self.seed})"
        )


def _composition(draw: st.DrawFn, total: int, parts: int) -> list[int]:
    """Split sizes of ``total`` over ``parts`` ranks, any of them empty."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


@st.composite
def draw_case(draw: st.DrawFn, mesh_shape: Sequence[int]) -> Case:
    """A random input shape, a random uneven sharding on a mesh of ``mesh_shape``, a chain and a consumer."""
    ndim = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    sharded = draw(st.lists(st.integers(0, ndim - 1), min_size=len(mesh_shape), max_size=len(mesh_shape), unique=True))
    placements, sizes = [], {}
    for mesh_dim, d in enumerate(sharded):
        if len(mesh_shape) > 1 and draw(st.integers(0, 4)) == 0:
            placements.append(Replicate())  # a 2-D mesh with one mesh dim replicated
            continue
        placements.append(Shard(d))
        sizes[mesh_dim] = _composition(draw, shape[d], mesh_shape[mesh_dim])
    chain = draw(draw_chain(shape))
    final = _simulate(shape, chain)
    assert final is not None
    name = draw(st.sampled_from(consumers_for(final.shape)))
    consumer = Consumer(name, draw(st.integers(0, 99)))
    return Case(shape, tuple(placements), sizes, chain, consumer, draw(st.integers(0, 2**16)))


# -- running one example -----------------------------------------------------------------------------
class Refused(Exception):
    """The sharded run raised NotImplementedError (MissingShardPatch): allowed, and counted."""


def _full(t: Any) -> torch.Tensor:
    # ShardTensor is no DTensor subclass in every PhysicsNeMo release: go by the method.
    return t.full_tensor() if isinstance(t, DTensor) or hasattr(t, "full_tensor") else t


def _check_local_shape(t: Any, what: str) -> None:
    """A ShardTensor's local block must have the shape its spec says (else full_tensor lies)."""
    spec = getattr(t, "_spec", None)
    if spec is None or not hasattr(spec, "sharding_shapes"):
        return
    coordinate = spec.mesh.get_coordinate()
    for mesh_dim, shapes in spec.sharding_shapes().items():
        expected = tuple(shapes[coordinate[mesh_dim]])
        assert tuple(t._local_tensor.shape) == expected, (
            f"{what}: local shape {tuple(t._local_tensor.shape)} but the spec says {expected} "
            f"(mesh dim {mesh_dim}, placements {t.placements})"
        )


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")


@dataclass
class Outcome:
    """What happened in one example (for the counters)."""

    refused: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)  # a KNOWN_ERRORS bug (loud, not silent)


def run_case(case: Case, mesh: Any) -> Outcome:
    """Run ``case`` plain and sharded and compare; raises AssertionError on a mismatch or a foreign error."""
    from physicsnemo_shardext.testing import shard_tensor

    outcome = Outcome()
    full = _value_for(case.shape, case.seed)

    # single process
    x = full.clone().requires_grad_(True)
    try:
        chained = run_chain(x, case.chain)
        ref_params = case.consumer.params(chained.shape)
        consumed = None if case.consumer.name == "none" else case.consumer(chained, ref_params)
    except Exception:  # noqa: BLE001 - torch itself refuses this example (rare; drawing filters most)
        reject()
    g = torch.Generator().manual_seed(case.seed + 1)
    w_chain = torch.randn(chained.shape, dtype=DTYPE, generator=g)
    w_consumer = None if consumed is None else torch.randn(consumed.shape, dtype=DTYPE, generator=g)

    # sharded
    xs = shard_tensor(full, mesh, list(case.placements), case.sizes or None, requires_grad=True)
    try:
        out = run_chain(xs, case.chain)
    except NotImplementedError as exc:
        outcome.refused.append(f"chain: {type(exc).__name__}: {str(exc)[:160]}")
        return outcome
    except Exception as exc:
        raise AssertionError(f"the chain raised {type(exc).__name__} where torch does not: {exc}") from exc
    _check_local_shape(out, "chain output")
    assert tuple(out.shape) == tuple(chained.shape), f"chain output shape {tuple(out.shape)} != {tuple(chained.shape)}"
    _close(_full(out), chained.detach(), "chain values")

    params = [p.detach().clone().requires_grad_(True) for p in ref_params]
    sharded_consumed = None
    if consumed is not None:
        try:
            sharded_consumed = case.consumer(out, params)
        except NotImplementedError as exc:
            outcome.refused.append(f"{case.consumer.name}: {type(exc).__name__}: {str(exc)[:160]}")
        except Exception as exc:
            raise AssertionError(
                f"consumer {case.consumer.name} raised {type(exc).__name__} where torch does not: {exc}"
            ) from exc
    if sharded_consumed is not None:
        _check_local_shape(sharded_consumed, f"{case.consumer.name} output")
        _close(_full(sharded_consumed), consumed.detach(), f"{case.consumer.name} values")

    # gradients of one random-weighted sum (the consumer's term only where it ran sharded)
    ref_loss = (chained * w_chain).sum()
    loss = (_full(out) * w_chain).sum()
    if sharded_consumed is not None:
        ref_loss = ref_loss + (consumed * w_consumer).sum()
        loss = loss + (_full(sharded_consumed) * w_consumer).sum()
    ref_loss.backward()
    try:
        loss.backward()
    except NotImplementedError as exc:
        outcome.refused.append(f"backward: {type(exc).__name__}: {str(exc)[:160]}")
        return outcome
    except RuntimeError as exc:
        if _strict() or not any(known in str(exc) for known in KNOWN_ERRORS):
            raise AssertionError(f"backward raised {type(exc).__name__}: {exc}") from exc
        outcome.known.append(f"backward: {str(exc)[:120]}")
        return outcome
    except Exception as exc:
        raise AssertionError(f"backward raised {type(exc).__name__}: {exc}") from exc
    expected_grad = x.grad if x.grad is not None else torch.zeros_like(full)
    grad = _full(xs.grad) if xs.grad is not None else torch.zeros_like(full)
    _close(grad, expected_grad, "input gradient")
    if sharded_consumed is not None:
        for i, (p, ref) in enumerate(zip(params, ref_params)):
            _close(_full(p.grad), ref.grad, f"{case.consumer.name} parameter {i} gradient")
    return outcome


# -- the property -------------------------------------------------------------------------------------
def _agree(failed: bool) -> bool:
    """Whether any rank failed this example (one all-reduce): every rank then takes the same branch."""
    import torch.distributed as dist

    flag = torch.tensor([int(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def fuzz(mesh: Any, examples: int, shrink: bool, failures: list[str] | None = None) -> Counter:
    """Run ``examples`` derandomized examples on ``mesh``; returns the counters (examples, refusals).

    With a ``failures`` list, a failing example is appended to it (the case and the error) instead of
    failing the run: a survey of everything a budget finds, for triage.
    """
    counts: Counter = Counter()
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

    @settings(
        derandomize=True,
        database=None,
        max_examples=examples,
        deadline=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=draw_case(tuple(mesh.shape)))
    def prop(case: Case) -> None:
        error: BaseException | None = None
        outcome = Outcome()
        _trace(f"case {case!r}")
        try:
            outcome = run_case(case, mesh)
        except Exception as exc:  # noqa: BLE001 - any error fails the example, on every rank alike
            if type(exc).__module__.startswith("hypothesis"):
                raise  # reject(): decided before any collective, the same on every rank
            error = exc
            _trace(f"  this rank raised {type(exc).__name__}: {exc}")
        if _agree(error is not None):
            if failures is not None:
                failures.append(f"{case!r}\n    {type(error).__name__}: {str(error)[:400]}")
                counts["failed"] += 1
                return
            raise AssertionError(f"{case!r}: " + (str(error) if error else "failed on another rank")) from error
        counts["examples"] += 1
        counts["refused"] += bool(outcome.refused)
        counts["known bug"] += bool(outcome.known)
        for why in outcome.refused:
            counts["refusal: " + why.split(":")[0] + ": " + why.split(":", 2)[-1].strip()[:90]] += 1

    prop()
    return counts


def _trace(line: str) -> None:
    """Append ``line`` to ``$SHARDEXT_FUZZ_TRACE/rank<r>.txt`` (nothing when unset)."""
    folder = os.environ.get(TRACE_ENV)
    if folder:
        import torch.distributed as dist

        with open(os.path.join(folder, f"rank{dist.get_rank()}.txt"), "a") as handle:
            handle.write(line + "\n")


def _budget(default: int) -> tuple[int, bool]:
    if os.environ.get(EXAMPLES_ENV):
        return int(os.environ[EXAMPLES_ENV]), os.environ.get(SHRINK_ENV, "") not in ("", "0")
    return default, os.environ.get(SHRINK_ENV, "") not in ("", "0")


def _report(name: str, counts: Counter, rank: int) -> None:
    """Print the counters on rank 0 (and append them to $SHARDEXT_FUZZ_REPORT as a JSON line)."""
    if rank != 0:
        return
    print(f"{name}: {dict(counts)}")
    if os.environ.get(REPORT_ENV):
        with open(os.environ[REPORT_ENV], "a") as f:
            f.write(json.dumps({"test": name, **counts}) + "\n")


@pytest.mark.multirank(2, timeout=300)
def test_layout_chains_on_a_1d_mesh(domain_mesh, rank):
    examples, shrink = _budget(FUZZ_1D)
    _report("1d", fuzz(domain_mesh, examples, shrink), rank)


@pytest.mark.multirank(4, timeout=300)
def test_layout_chains_on_a_2x2_mesh(spatial_mesh, rank):
    examples, shrink = _budget(FUZZ_2D)
    _report("2x2", fuzz(spatial_mesh, examples, shrink), rank)


@pytest.mark.slow
@pytest.mark.multirank(2, timeout=3600)
def test_layout_chains_on_a_1d_mesh_long(domain_mesh, rank):
    _report("1d-long", fuzz(domain_mesh, LONG_1D, shrink=True), rank)


@pytest.mark.slow
@pytest.mark.multirank(4, timeout=3600)
def test_layout_chains_on_a_2x2_mesh_long(spatial_mesh, rank):
    _report("2x2-long", fuzz(spatial_mesh, LONG_2D, shrink=True), rank)
