"""The backward's delta = rowsum(dO * O) - dlse in one pass over dO and O.

Every gradient kernel subtracts delta from dP. In torch it took four passes over
(B, H, L, D) float32 temporaries (two conversions, the product, the sum); this kernel
reads dO and O once in their own dtype and accumulates in the statistics dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .options import block_dim, dot_options, strides


# fmt: off
@triton.jit
def _delta(DO, Out, Lse, DLse, Delta, sdb, sdh, sdl, sdd, sob, soh, sol, sod, num_heads, q_len,
           dim, HAS_DLSE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
           ACC: tl.constexpr):
    """Grid (row blocks, B * H): Delta (B, H, L) contiguous, in ACC, of BLOCK_L rows;
    with HAS_DLSE minus DLse (contiguous like Lse) where Lse is finite."""
    li, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // num_heads, bh % num_heads
    rows = li * BLOCK_L + tl.arange(0, BLOCK_L)
    dims = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < q_len) & (dims[None, :] < dim)
    rows64 = rows.to(tl.int64)[:, None]
    do = tl.load(DO + b * sdb + h * sdh + rows64 * sdl + dims[None, :] * sdd, mask=inside,
                 other=0.0)
    o = tl.load(Out + b * sob + h * soh + rows64 * sol + dims[None, :] * sod, mask=inside,
                other=0.0)
    delta = tl.sum(do.to(ACC) * o.to(ACC), 1)
    if HAS_DLSE:
        lse = tl.load(Lse + bh * q_len + rows, mask=rows < q_len, other=0.0)
        dlse = tl.load(DLse + bh * q_len + rows, mask=rows < q_len, other=0.0).to(ACC)
        finite = (lse == lse) & (tl.abs(lse) != float("inf"))
        delta -= tl.where(finite, dlse, 0.0)
    tl.store(Delta + bh * q_len + rows, delta, mask=rows < q_len)
# fmt: on


def row_delta(grad_out: Tensor, out: Tensor, lse: Tensor, grad_lse: Tensor | None) -> Tensor:
    """(B, H, L) contiguous delta in lse's dtype (the statistics dtype) of grad_out and
    out (B, H, L, D_v), any strides; minus grad_lse (B, H, L) where lse is finite."""
    batch, num_heads, q_len, dim = out.shape
    delta = torch.empty(batch, num_heads, q_len, dtype=lse.dtype, device=out.device)
    if delta.numel() == 0:
        return delta
    block_d = block_dim(dim)
    block_l = max(1, 4096 // block_d)  # (a tile of 4096 entries of each)
    dlse = None if grad_lse is None else grad_lse.contiguous()
    grid = (triton.cdiv(q_len, block_l), batch * num_heads)
    _delta[grid](
        grad_out,
        out,
        lse.contiguous(),
        dlse,
        delta,
        *strides(grad_out, out),
        num_heads,
        q_len,
        dim,
        HAS_DLSE=dlse is not None,
        BLOCK_L=block_l,
        BLOCK_D=block_d,
        ACC=dot_options(out.dtype)["ACC"],  # (the statistics dtype, as the lse's)
    )
    return delta
