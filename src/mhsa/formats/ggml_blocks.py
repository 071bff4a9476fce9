"""GGML's quantised blocks of 32 weights, unpacked into integers and per-block scales
(for weight-only quantised matmuls that keep a file's quantisation as it is).

Each row of a (N, K) weight is K / 32 blocks; a block starts with float16 scalars:
    Q4_0  d, then 16 bytes of 4-bit q       w = d * (q - 8)
    Q4_1  d, m, then 16 bytes of 4-bit q    w = d * q + m
    Q8_0  d, then 32 int8 q                 w = d * q
In the 4-bit formats byte i holds element i in its low nibble and element i + 16 in
its high nibble.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

BLOCK = 32
_HEADER = {"Q4_0": 1, "Q4_1": 2, "Q8_0": 1}  # float16 scalars before the quants


def _blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, int]:
    """raw (N, bytes per row) uint8 -> (float16 header (N, blocks, h), quant bytes
    (N, blocks, b), K)."""
    if kind not in _HEADER:
        raise ValueError(f"unpacking {kind} blocks is not supported (Q4_0, Q4_1, Q8_0 are)")
    header = _HEADER[kind]
    quant_bytes = BLOCK if kind == "Q8_0" else BLOCK // 2
    size = 2 * header + quant_bytes
    rows = raw.shape[0]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(
            f"{kind} data must be uint8 rows of whole {size}-byte blocks, got "
            f"{raw.dtype} {raw.shape}"
        )
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, size)
    scalars = blocks[..., : 2 * header].copy().view(np.float16)
    return scalars, blocks[..., 2 * header :], blocks.shape[1] * BLOCK


def unpack_q4(raw: np.ndarray, kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_0 / Q4_1 rows -> (q (N, K) int32 in 0..15, scale (N, K/32), zero (N, K/32))
    float32 with w = scale * (q - 8) + zero, exactly the file's values."""
    scalars, quants, _ = _blocks(raw, kind)
    low, high = quants & 0x0F, quants >> 4
    q = np.concatenate([low, high], axis=-1).reshape(raw.shape[0], -1).astype(np.int32)
    d = scalars[..., 0].astype(np.float32)
    zero = scalars[..., 1].astype(np.float32) + 8 * d if kind == "Q4_1" else np.zeros_like(d)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero)


def unpack_q8_0(raw: np.ndarray) -> tuple[Tensor, Tensor]:
    """Q8_0 rows -> (q (N, K) int8, scale (N, K/32) float32), w = scale * q."""
    scalars, quants, _ = _blocks(raw, "Q8_0")
    q = quants.copy().view(np.int8).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(scalars[..., 0].astype(np.float32))


def dequantize_blocks(q: Tensor, scale: Tensor, zero: Tensor | None = None) -> Tensor:
    """(N, K) weights from unpacked blocks: scale * (q - 8) + zero (4-bit) or scale * q."""
    rows, cols = q.shape
    grouped = q.float().view(rows, -1, BLOCK)
    if zero is None:
        return (grouped * scale.unsqueeze(-1)).view(rows, cols)
    return ((grouped - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(rows, cols)
