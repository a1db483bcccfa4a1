"""Prepare a model for a comparison against single-process: zero-initialised parameters re-drawn, no random masks.

Many models start with an output layer at exactly zero: SongUNet's attention
projection and last convolution, DiT's adaLN-zero modulation, ControlNet-style
blocks. Such a layer multiplies whatever reaches it by zero, so a wrong value in
front of it leaves the output (and most gradients) equal to single-process: a
conformance check passes while the model is wrong. `redraw_zero_parameters`
gives every parameter that is exactly zero seeded random values (the same on
every rank), so that every layer reaches the output.

`without_random_masks` sets dropout and drop-path (stochastic depth)
probabilities to 0: a random mask is drawn per rank for its own rows, so no
sharded run could reproduce single-process's.

Examples:
    >>> import torch
    >>> layer = torch.nn.Linear(4, 3)
    >>> torch.nn.init.zeros_(layer.weight)
    Parameter containing:...
    >>> redraw_zero_parameters(layer, seed=0)
    ['weight']
    >>> bool(layer.weight.abs().sum() > 0)
    True
    >>> redraw_zero_parameters(layer, seed=0)  # nothing is zero any more
    []
"""

from __future__ import annotations

import math

import torch

__all__ = ["redraw_zero_parameters", "without_random_masks"]

#: Attributes through which drop-path (stochastic depth) modules hold their probability
#: (PhysicsNeMo's and timm's ``DropPath``: ``drop_prob``).
DROP_PATH_ATTRIBUTES = ("drop_prob", "drop_path_prob")

#: The spread of a re-drawn vector (biases, norm scales): small, so activations stay in range.
VECTOR_STD = 0.1


def redraw_zero_parameters(model: torch.nn.Module, seed: int = 0) -> list[str]:
    """Give every all-zero floating-point parameter of ``model`` seeded random values, in place.

    A matrix or kernel (``ndim >= 2``) is drawn with standard deviation
    ``1/sqrt(fan_in)`` (its first dim is the output), so a re-drawn layer keeps
    its activations' scale; a vector with ``VECTOR_STD``. The generator is seeded
    from ``seed`` and the parameter's name, so every rank draws the same values
    whatever the order of calls.

    Args:
        model: the module whose parameters are re-drawn (a deep copy stays untouched).
        seed: base seed; the same seed gives the same values on every rank.

    Returns:
        The names of the re-drawn parameters, in ``named_parameters`` order.

    Examples:
        >>> conv = torch.nn.Conv2d(2, 2, 3)
        >>> with torch.no_grad():
        ...     _ = conv.bias.zero_()
        >>> redraw_zero_parameters(conv, seed=1)
        ['bias']
    """
    redrawn = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point() or param.numel() == 0 or bool(param.any()):
                continue
            generator = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
            std = 1.0 / math.sqrt(max(1, param[0].numel())) if param.ndim >= 2 else VECTOR_STD
            values = torch.randn(param.shape, generator=generator, dtype=torch.float64) * std
            param.copy_(values.to(param.dtype))
            redrawn.append(name)
    return redrawn


def without_random_masks(model: torch.nn.Module) -> list[str]:
    """Set every dropout and drop-path probability of ``model`` to 0, in place; return the modules changed.

    Examples:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
        >>> without_random_masks(net), net[1].p
        (['1'], 0.0)
    """
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p = 0.0
            changed.append(name)
        for attribute in DROP_PATH_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, float) and value:
                setattr(module, attribute, 0.0)
                changed.append(name)
    return changed


def _stable_hash(text: str) -> int:
    """A hash of ``text`` that, unlike ``hash``, is the same in every process."""
    value = 0
    for byte in text.encode():
        value = (value * 131 + byte) % 2_147_483_647
    return value
