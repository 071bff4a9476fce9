"""uint8 per row: what the explorer stores of each probability row.

    q = round(255 * p / max(row)), scale = max(row) / 255, p ~ q * scale

so every stored probability is within max(row) / 510 of the exact one (a row of
zeros, a query with no allowed key, stores zeros and scale 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

LEVELS = 255


def quantize_rows(probs: Tensor) -> tuple[Tensor, Tensor]:
    """probs (..., S) >= 0 -> (uint8 (..., S), float32 scales (...,))."""
    peak = probs.float().amax(dim=-1, keepdim=True)
    scaled = torch.where(peak > 0, probs.float() / peak.clamp_min(1e-30), 0.0)
    return (scaled * LEVELS).round_().to(torch.uint8), (peak[..., 0] / LEVELS)


def dequantize_rows(values: Tensor, scales: Tensor) -> Tensor:
    """The inverse of quantize_rows, within max(row) / 510: float32 (..., S)."""
    return values.float() * scales[..., None]


def spread_rows(length: int, limit: int) -> list[int]:
    """Up to `limit` row indices of 0..length-1, evenly spread, first and last included
    (all of them when length <= limit)."""
    if length <= limit:
        return list(range(length))
    if limit == 1:
        return [length - 1]
    return sorted({round(i * (length - 1) / (limit - 1)) for i in range(limit)})
