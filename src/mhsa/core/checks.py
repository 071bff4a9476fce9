"""Generic argument checks that every layer of the package may use (a leaf module: it
imports nothing of mhsa). Checks specific to attention calls are in validate.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def as_4d(t: Tensor | None) -> Tensor | None:
    """A tensor that broadcasts to (B, H, L, S) (a mask, a bias), viewed with leading
    size-1 dims up to 4-D, as broadcasting aligns it; None stays None."""
    return None if t is None else t.view((1,) * (4 - t.dim()) + tuple(t.shape))


def is_int(value: object) -> bool:
    """Whether value is an int and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_int_tensor(t: Tensor) -> bool:
    """Whether t holds integers (not float, complex or bool): ids, positions, indices."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def int_at_least(name: str, value: int, low: int, hint: str = "") -> int:
    """value, if it is an int (not a bool) >= low; else ValueError naming `name`."""
    # is_int's rule, inlined: called per layer on the decode path
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{hint}, got {value!r}")
    return value


def an_int(name: str, value: int, hint: str = "") -> int:
    """value, if it is an int (not a bool); else TypeError naming `name`."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int{hint}, got {value!r}")
    return value


def int_list(name: str, value: Tensor | Sequence, shape: str = "") -> list:
    """A 1-D integer tensor or a sequence as a list (its items unchecked); TypeError
    naming `name` for a tensor of another dtype or rank. shape: e.g. " (N,)"."""
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a 1-D integer tensor{shape} or a sequence of ints, "
                f"got {value.dtype} {tuple(value.shape)}"
            )
        return value.tolist()
    return list(value)


def tensors_of_rank(rank: int, layout: str, hint: str = "", **tensors: Tensor) -> None:
    """TypeError naming the argument for a non-tensor; ValueError naming it, its shape,
    the expected `layout` and `hint` (how to fix it) for a tensor of another rank."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}{hint}")
