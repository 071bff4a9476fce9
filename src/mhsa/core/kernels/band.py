"""Sliding-window attention on PyTorch's fused CPU kernel, every row block in one call.

Seen from its own block of rows, a sliding window is the same mask everywhere: block j
(BAND_ROWS rows starting at row r0) attends the keys r0 + shift - left .. r0 + shift +
right + BAND_ROWS - 1 (shift = S - L: queries are aligned bottom-right). Those key
windows are one overlapping strided view of K and V (nothing is copied), the blocks
fill the kernel's head dimension (the heads its batch dimension, so that consecutive
blocks, which share most of their keys, run one after another), and a single
(BAND_ROWS, left + right + BAND_ROWS) additive mask serves all of them. The interior of
the band is then one fused call per batch element instead of a call per run and a
logsumexp merge per row block. Rows whose window reaches past either end of the keys
are left to the block plan.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..masks.causal import causal_shift

# 32 rows: less wasted work at the band's edges than 64 or more, while the kernel
# still runs at full speed (`mhsa bench sparse`, SlidingWindow(256, 256), L=16384).
BAND_ROWS = 32

# the kernel's output is taken in chunks of about this size: a large fresh buffer costs
# more in page faults than the copy (allocators map big buffers anew on every call)
CHUNK_BYTES = 8 * 2**20

_FUSED_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def interior_rows(q_len: int, kv_len: int, left: int, right: int, align: int):
    """(first, end): the rows first..end-1, both multiples of align, whose whole window
    lies inside the keys; None when there are none or align is not a multiple of
    BAND_ROWS."""
    if _FUSED_FORWARD is None or align % BAND_ROWS:
        return None
    shift = causal_shift(q_len, kv_len)
    first = -(-max(0, left - shift) // align) * align  # row first's window starts at key >= 0
    end = max(0, q_len - right) // align * align  # row end - 1's window ends at key <= S - 1
    return (first, end) if end > first else None


def _blocks(t: Tensor, start: int, count: int, step: int, length: int) -> Tensor:
    """(H, count, length, D) view of t (H, N, D): block j is rows start + j * step ..
    start + j * step + length - 1. Blocks overlap when length > step."""
    head_stride, row_stride, dim_stride = t.stride()
    return t.as_strided(
        (t.shape[0], count, length, t.shape[2]),
        (head_stride, step * row_stride, row_stride, dim_stride),
        t.storage_offset() + start * row_stride,
    )


def band_mask(left: int, right: int, dtype: torch.dtype, device) -> Tensor:
    """(BAND_ROWS, left + right + BAND_ROWS) additive mask of one row block: row r
    attends the window's keys r .. r + left + right, -inf elsewhere."""
    rows = torch.arange(BAND_ROWS, device=device).view(-1, 1)
    cols = torch.arange(left + right + BAND_ROWS, device=device).view(1, -1)
    outside = (cols < rows) | (cols > rows + left + right)
    mask = torch.zeros(outside.shape, dtype=dtype, device=device)
    return mask.masked_fill_(outside, -torch.inf)


def band_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    left: int,
    right: int,
    scale: float,
    first: int,
    end: int,
    out: Tensor,
    lse: Tensor,
) -> None:
    """Write rows first..end-1 of out (B, H, L, D_v) and lse (B, H, L) for the sliding
    window (left, right); (first, end) comes from interior_rows. q, k, v must have a
    unit stride in their last dimension (as flash_forward ensures); one call per batch
    element, since heads and blocks already fill the kernel's two batch dimensions."""
    count = (end - first) // BAND_ROWS
    start = first + (k.shape[2] - q.shape[2]) - left  # first block's first key
    span = left + right + BAND_ROWS
    mask = band_mask(left, right, q.dtype, q.device)
    # the kernel maps query heads to key heads (GQA) along its head dimension only, so
    # with GQA the heads go there and the blocks into its batch dimension instead
    grouped = k.shape[1] != q.shape[1]
    heads, value_dim = out.shape[1], out.shape[3]
    chunk = max(1, CHUNK_BYTES // (heads * BAND_ROWS * value_dim * out.element_size()))
    for i in range(q.shape[0]):
        for c0 in range(0, count, chunk):
            n = min(chunk, count - c0)
            r0 = first + c0 * BAND_ROWS
            views = [
                _blocks(q[i], r0, n, BAND_ROWS, BAND_ROWS),
                _blocks(k[i], start + c0 * BAND_ROWS, n, BAND_ROWS, span),
                _blocks(v[i], start + c0 * BAND_ROWS, n, BAND_ROWS, span),
            ]
            if grouped:
                views = [t.transpose(0, 1) for t in views]
            out_c, lse_c = _FUSED_FORWARD(*views, 0.0, False, attn_mask=mask, scale=scale)
            if grouped:
                out_c, lse_c = out_c.transpose(0, 1), lse_c.transpose(0, 1)
            rows = slice(r0, r0 + n * BAND_ROWS)
            out[i, :, rows].view(heads, n, BAND_ROWS, value_dim).copy_(out_c)
            lse[i, :, rows].view(heads, n, BAND_ROWS).copy_(lse_c)
