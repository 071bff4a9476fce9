"""Attention math on materialised score tiles, shared by the reference backend and
the tiled engines: grouped-query products, a softmax safe for fully masked rows, and
counter-based dropout."""

from __future__ import annotations

import torch
from torch import Tensor

from .dropout import keep_mask


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_softmax(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that is 0 (not NaN) on rows where every score is -inf.

    scores (..., S) -> probs (..., S), lse (...). Gradients on such rows are 0.
    """
    if scores.shape[-1] == 0:
        return scores, scores.new_full(scores.shape[:-1], -torch.inf)
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    alive = total > 0
    safe_total = torch.where(alive, total, torch.ones_like(total))
    probs = exp / safe_total
    lse = torch.where(alive, row_max + torch.log(safe_total), torch.full_like(total, -torch.inf))
    return probs, lse.squeeze(-1)


def grouped_scores(q: Tensor, k: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """q (B, H, L, D) @ k (B, H_kv, S, D)^T * scale -> (B, H, L, S) in `dtype`.

    Grouped-query heads are handled by viewing the H_kv * G query heads as
    (B, H_kv, G * L, D), so k is never repeated.
    """
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group_rows = num_heads // num_kv_heads * q_len  # explicit, not -1: batch may be 0
    grouped_q = q.to(dtype).reshape(batch, num_kv_heads, group_rows, head_dim)
    scores = (grouped_q @ k.to(dtype).transpose(-1, -2)).mul_(scale)  # (B, H_kv, G*L, S)
    return scores.view(batch, num_heads, q_len, kv_len)


def probs_times_v(probs: Tensor, v: Tensor) -> Tensor:
    """(B, H, L, S) @ (B, H_kv, S, D_v) -> (B, H, L, D_v), GQA without repeating v."""
    batch, num_heads, q_len, kv_len = probs.shape
    num_kv_heads = v.shape[1]
    grouped = probs.reshape(batch, num_kv_heads, num_heads // num_kv_heads * q_len, kv_len)
    out = grouped @ v.to(probs.dtype)
    return out.view(batch, num_heads, q_len, v.shape[-1])


def apply_dropout(
    probs: Tensor, p: float, seed: int, q0: int = 0, cols: Tensor | None = None
) -> Tensor:
    """Drop entries of probs (B, H, rows, keys) whose rows start at q0 and whose key
    indices are cols (default 0..keys-1); scale the rest by 1/(1-p).

    The kept entries are a hash of (seed, batch*head, row, col): the same for any tiling.
    """
    batch, num_heads, rows, keys = probs.shape
    if cols is None:
        cols = torch.arange(keys, device=probs.device)
    keep = keep_mask(seed, batch, num_heads, q0, q0 + rows, cols, p)
    return probs * keep / (1.0 - p)
