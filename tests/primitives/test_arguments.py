"""Tests of physicsnemo_shardext/primitives/arguments.py: binding a call and expanding scalars."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physicsnemo_shardext.primitives import bind_arguments, expand_to


def _softmax(input, dim=None, dtype=None):  # mirror of torch.softmax's parameters
    ...


def _pad(input, pad, mode="constant", value=None): ...


def test_bind_fills_defaults_and_maps_positionals_and_keywords():
    bound = bind_arguments(F.interpolate, ("x",), {"scale_factor": 2})
    assert bound["input"] == "x" and bound["size"] is None and bound["scale_factor"] == 2
    assert bound["mode"] == "nearest" and bound["align_corners"] is None
    assert bind_arguments(_pad, ("x", (1, 1), "reflect"), {}) == {
        "input": "x",
        "pad": (1, 1),
        "mode": "reflect",
        "value": None,
    }


def test_bind_against_a_mirror_function_where_the_builtin_has_no_signature():
    assert bind_arguments(_softmax, ("x",), {"dim": 1}) == {"input": "x", "dim": 1, "dtype": None}
    assert bind_arguments(_softmax, ("x", -1, torch.float64), {}) == {"input": "x", "dim": -1, "dtype": torch.float64}


def test_a_builtin_without_a_signature_asks_for_a_mirror():
    with pytest.raises(TypeError, match="has no introspectable signature; pass a mirror function"):
        bind_arguments(torch.softmax, ("x",), {"dim": 1})


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        (("x", (1, 1)), {"size": 3}, r"^_pad\(\): got an unexpected keyword argument 'size'$"),
        (("x",), {}, r"^_pad\(\): missing a required argument: 'pad'$"),
        (("x", (1,), "constant", 0.0, 5), {}, r"^_pad\(\): too many positional arguments$"),
        (("x", (1,)), {"input": "y"}, r"^_pad\(\): multiple values for argument 'input'$"),
    ],
    ids=["unknown-keyword", "missing", "too-many", "twice"],
)
def test_bind_raises_type_error_like_python_naming_the_reference(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        bind_arguments(_pad, args, kwargs)


def test_bind_returns_a_fresh_dict_each_call():
    first = bind_arguments(_softmax, ("x",), {})
    first["dim"] = 7
    assert bind_arguments(_softmax, ("x",), {})["dim"] is None


@pytest.mark.parametrize(
    "value,n,expected",
    [
        (2, 3, (2, 2, 2)),
        (None, 2, (None, None)),
        (1.5, 1, (1.5,)),
        ([4], 2, (4, 4)),
        ((4,), 3, (4, 4, 4)),
        ((1, 2), 2, (1, 2)),
        ([1, 2, 3], 3, (1, 2, 3)),
        ("ab", 2, ("ab", "ab")),  # a string is a scalar here, not a sequence
        (torch.Size([3, 5]), 2, (3, 5)),
    ],
    ids=["int", "none", "float-1", "list-1", "tuple-1", "tuple-n", "list-n", "str", "size"],
)
def test_expand_to_cases(value, n, expected):
    assert expand_to(value, n) == expected


def test_expand_to_rejects_other_lengths_naming_what_and_op():
    with pytest.raises(ValueError, match=r"^avg_pool2d: stride must have 2 elements, got \(1, 2, 3\)$"):
        expand_to((1, 2, 3), 2, what="stride", op="avg_pool2d")
    with pytest.raises(ValueError, match=r"^argument must have 3 elements, got \(1, 2\)$"):
        expand_to([1, 2], 3)
    with pytest.raises(ValueError, match=r"must have 2 elements, got \(\)"):
        expand_to((), 2)


def _conv(input, weight, bias=None, stride=1, padding=0, *, groups=1):
    """A signature with a keyword-only parameter (binding by name matching)."""


def _variadic(input, *rest, scale=1.0, **options):
    """A signature the name-matching path leaves to inspect."""


@pytest.mark.parametrize("reference", [_conv, _variadic])
@pytest.mark.parametrize(
    "args,kwargs",
    [
        (("x", "w"), {}),
        (("x", "w", "b", 2), {"padding": 1}),
        (("x",), {"weight": "w", "groups": 2}),
        (("x", "w", "b", 1, 0), {"groups": 3}),
        (("x", "w", "b", 1, 0, "extra"), {}),  # too many positional for _conv
        (("x",), {}),  # a required argument missing for _conv
        (("x", "w"), {"weight": "again"}),  # given twice
        (("x", "w"), {"unknown": 1}),
    ],
)
def test_binding_equals_inspect_signature_bind(reference, args, kwargs):
    import inspect

    signature = inspect.signature(reference)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        with pytest.raises(TypeError, match=str(error).split("'")[0]):
            bind_arguments(reference, args, kwargs)
        return
    bound.apply_defaults()
    got = bind_arguments(reference, args, kwargs)
    assert got == dict(bound.arguments) and list(got) == list(bound.arguments)
