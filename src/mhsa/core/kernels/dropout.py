"""Counter-based dropout: whether entry (batch*head, row, col) is kept is a hash of
(seed, batch*head, row, col), so any tiling of the score matrix, in forward or in
backward, regenerates exactly the same dropped entries without storing them.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # a well-mixing odd 32-bit multiplier; products stay below 2**63


def _mix32(x: Tensor) -> Tensor:
    """An invertible 32-bit integer hash, on int64 tensors holding values < 2**32."""
    x = ((x ^ (x >> 16)) * _MULT) & _MASK32
    x = ((x ^ (x >> 16)) * _MULT) & _MASK32
    return x ^ (x >> 16)


def draw_seed() -> int:
    """A 31-bit seed from torch's default generator (so torch.manual_seed fixes it)."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())


def keep_mask(
    seed: int, batch: int, num_heads: int, q0: int, q1: int, cols: Tensor, p: float
) -> Tensor:
    """(B, H, q1 - q0, len(cols)) bool: True where entry (row, col) survives dropout
    with rate p; rows are q0..q1-1, cols the key indices."""
    device = cols.device
    heads = torch.arange(batch * num_heads, device=device, dtype=torch.int64)
    row_ids = torch.arange(q0, q1, device=device, dtype=torch.int64)
    head_hash = _mix32((heads + seed) & _MASK32).view(-1, 1)
    row_hash = _mix32(head_hash ^ row_ids.view(1, -1))  # (B*H, rows)
    full = _mix32(row_hash.unsqueeze(-1) ^ cols.view(1, 1, -1))  # (B*H, rows, cols)
    threshold = int(p * 2**32)
    return (full >= threshold).view(batch, num_heads, q1 - q0, cols.numel())
