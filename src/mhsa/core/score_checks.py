"""The checks of score functions (mhsa.core.scores, which imports this, so this names
its classes in words only): a ScoreMod's fn probed once on a small tile (elementwise,
the scores' shape and dtype), per-head tensors' shapes and devices, and the tensors a
function closes over (which receive gradients)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn


def tile_indices(batch: int, heads: Tensor | int, q_pos: Tensor, k_pos: Tensor):
    """(batch, head, q_pos, k_pos) index tensors shaped to broadcast against a
    (B, H, rows, keys) score tile; heads is H (all) or the query heads' indices."""
    device = q_pos.device
    head = torch.arange(heads, device=device) if isinstance(heads, int) else heads
    return (
        torch.arange(batch, device=device).view(-1, 1, 1, 1),
        head.view(1, -1, 1, 1),
        q_pos.view(1, 1, -1, 1),
        k_pos.view(1, 1, 1, -1),
    )


class Probe(NamedTuple):
    """The tile a score function is first tried on: `rows` query positions from
    q_first, `keys` key positions from k_first."""

    q_first: int = 0
    rows: int = 3
    k_first: int = 0
    keys: int = 4

    @classmethod
    def within(cls, q_len: int, kv_len: int) -> Probe:
        """The tile inside a call of q_len queries and kv_len keys: positions from 0, no
        more of them than the call has, so that a function indexing a table by position
        stays in its range. The same tile for every long call and every decoding step:
        the function is tried once, not per length."""
        return cls(0, min(3, q_len, kv_len), 0, min(4, kv_len))

    def shifted(self, q_offset: int, k_offset: int) -> Probe:
        """The tile as a function sees it whose positions are offset (a shard's)."""
        return self._replace(q_first=self.q_first + q_offset, k_first=self.k_first + k_offset)


def probe_once(
    fn: Callable, num_heads: int, device: torch.device, dtype: torch.dtype, probe: Probe
) -> bool:
    """check_elementwise once per (num_heads, device, dtype, probe) of fn."""
    key = (num_heads, str(device), dtype, probe)
    if key not in fn._checked:
        check_elementwise(fn, num_heads, device, dtype, probe)
        fn._checked.add(key)
    return True


def check_elementwise(
    fn: Callable,
    num_heads: int,
    device: torch.device,
    dtype: torch.dtype,
    probe: Probe = Probe(),  # noqa: B008 (a NamedTuple: immutable)
) -> None:
    """Evaluate fn on a small probe tile and on three single entries of it: the same
    shape and dtype as the scores, and each entry's value equal, or a ValueError naming
    the fault."""
    heads, n_rows, n_keys = min(num_heads, 2), probe.rows, probe.keys
    if heads == 0 or n_rows == 0 or n_keys == 0:
        return  # (an empty call computes no score)
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(1, heads, n_rows, n_keys, generator=generator).to(device, dtype)
    q_pos = torch.arange(probe.q_first, probe.q_first + n_rows, device=device)
    k_pos = torch.arange(probe.k_first, probe.k_first + n_keys, device=device)
    batch, head, rows, keys = tile_indices(1, heads, q_pos, k_pos)
    with torch.no_grad():
        try:
            out = fn(scores, batch, head, rows, keys)
        except Exception as error:
            raise ValueError(
                f"{fn!r} failed on a (1, {heads}, {n_rows}, {n_keys}) score tile at query "
                f"positions {q_pos.tolist()} and key positions {k_pos.tolist()}: {error}. A "
                "score_mod takes (score, batch, head, q_idx, kv_idx) tensors that "
                "broadcast, and uses torch ops"
            ) from error
        if not isinstance(out, Tensor) or out.dtype != scores.dtype:
            got = out.dtype if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"{fn!r} must return a tensor of the scores' dtype {scores.dtype}, got {got}"
            )
        if not _broadcasts_to(out.shape, scores.shape):
            raise ValueError(
                f"{fn!r} must return the scores' shape {tuple(scores.shape)} "
                f"(elementwise), got {tuple(out.shape)}"
            )
        entries = ((0, 0, 0), (heads - 1, 1, 2), (0, 2, 3))
        for h, r, c in ((h, min(r, n_rows - 1), min(c, n_keys - 1)) for h, r, c in entries):
            one = fn(
                scores[:, h : h + 1, r : r + 1, c : c + 1],
                batch,
                head[:, h : h + 1],
                rows[:, :, r : r + 1],
                keys[..., c : c + 1],
            )
            expected = out.expand(scores.shape)[:, h : h + 1, r : r + 1, c : c + 1]
            if one.shape == expected.shape and torch.allclose(one, expected, equal_nan=True):
                continue
            raise ValueError(
                f"{fn!r} is not elementwise: one score computed alone differs "
                "from the same score in a tile (a score_mod may not reduce over "
                "or mix entries)"
            )


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def closure_tensors(fn: Callable) -> tuple[Tensor, ...]:
    """The floating tensors of captured_tensors(fn): those that can receive gradients."""
    return tuple(t for t in captured_tensors(fn) if t.is_floating_point())


def captured_tensors(fn: Callable, depth: int = 4) -> tuple[Tensor, ...]:
    """Tensors (and modules' parameters and buffers) that fn reads: those it closes over
    or reads as globals, and those of the functions it closes over (and_masks' parts);
    a bound method's object's (a module's, or the tensors among its attributes); a
    functools.partial's arguments; a module called as fn."""
    if depth == 0:
        return ()
    if isinstance(fn, functools.partial):
        found = _tensors_in([*fn.args, *fn.keywords.values()])
        return found + captured_tensors(fn.func, depth - 1)
    if isinstance(fn, nn.Module):
        return _tensors_in([fn])
    owner = getattr(fn, "__self__", None)
    found = list(_tensors_in([owner]) if isinstance(owner, nn.Module) else ())
    if owner is not None and not isinstance(owner, nn.Module):
        found.extend(_tensors_in(list(getattr(owner, "__dict__", {}).values())))
    try:
        variables = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return tuple(found)
    values = [*variables.nonlocals.values(), *variables.globals.values()]
    found.extend(_tensors_in(values))
    for value in values:
        parts = value if isinstance(value, tuple | list) else (value,)
        for part in parts:
            if inspect.isfunction(part) or isinstance(part, functools.partial):
                found.extend(captured_tensors(part, depth - 1))
    return tuple(found)


def _tensors_in(values: list) -> tuple[Tensor, ...]:
    """The tensors among values, and the parameters and buffers of the modules among
    them."""
    found: list[Tensor] = []
    for value in values:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, nn.Module):  # (its buffers too: a window it reads)
            found.extend((*value.parameters(), *value.buffers()))
    return tuple(found)


def unique_tensors(tensors) -> tuple[Tensor, ...]:
    seen, result = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            result.append(t)
    return tuple(result)


def check_per_head(name: str, t: Tensor, axis: int, num_heads: int, device) -> None:
    """t holds one value per query head along `axis`, on q's device."""
    if t.shape[axis] != num_heads:
        raise ValueError(
            f"{name} have {t.shape[axis]} heads but the call has {num_heads} "
            "query heads: give one value per query head"
        )
    if t.device.type != device.type:
        raise ValueError(f"{name} are on {t.device} but q is on {device}: move them with .to()")


def describe(value) -> str:
    if isinstance(value, Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
