"""The checks of score functions (mhsa.core.scores, which imports this, so this names
its classes in words only): a ScoreMod's fn probed once on a small tile (elementwise,
the scores' shape and dtype), per-head tensors' shapes and devices, and the tensors a
function closes over (which receive gradients)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

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


def probe_once(fn: Callable, num_heads: int, device: torch.device, dtype: torch.dtype) -> bool:
    """check_elementwise once per (num_heads, device, dtype) of fn."""
    key = (num_heads, str(device), dtype)
    if key not in fn._checked:
        check_elementwise(fn, num_heads, device, dtype)
        fn._checked.add(key)
    return True


def check_elementwise(
    fn: Callable, num_heads: int, device: torch.device, dtype: torch.dtype
) -> None:
    """Evaluate fn on a small probe tile and on three single entries of it: the same
    shape and dtype as the scores, and each entry's value equal, or a ValueError naming
    the fault."""
    heads = min(num_heads, 2)
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(1, heads, 3, 4, generator=generator).to(device, dtype)
    q_pos, k_pos = torch.arange(3, device=device), torch.arange(4, device=device)
    batch, head, rows, keys = tile_indices(1, heads, q_pos, k_pos)
    with torch.no_grad():
        try:
            out = fn(scores, batch, head, rows, keys)
        except Exception as error:
            raise ValueError(
                f"{fn!r} failed on a (1, {heads}, 3, 4) score tile: {error}. A "
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
        for h, r, c in ((0, 0, 0), (heads - 1, 1, 2), (0, 2, 3)):  # single entries alone
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
    """Tensors (and parameters of modules) that fn closes over or reads as globals."""
    try:
        variables = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return ()
    found: list[Tensor] = []
    for value in [*variables.nonlocals.values(), *variables.globals.values()]:
        if isinstance(value, Tensor) and value.is_floating_point():
            found.append(value)
        elif isinstance(value, nn.Module):
            found.extend(value.parameters())
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
