"""Launch code for the Triton kernels: the autograd Function, attention probabilities
and the dropout mask.

Every launch walks the tile lists of .tiles (the flash engine's block plan).
Backward is atomic-free: one program per query block writes dQ (and its dS tiles
into a dBias buffer of the full (B, H, L, S) shape, reduced over broadcast dims with
torch), one program per (key block, kv head) accumulates dK and dV over the query
heads of its group.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..dense import stats_dtype
from ..dropout import draw_seed
from .attention import _attn_bwd_dkv, _attn_bwd_dq, _attn_fwd, _attn_probs, _keep_mask
from .tiles import TileLists, broadcast4d, build_tiles

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by (16-bit inputs, head dim up to): chosen
# from ptxas register reports for sm_90 / sm_80 (no spills in forward and dQ), not timed
_LAUNCH = {
    (True, 64): (64, 64, 4, 2),
    (True, 128): (64, 64, 8, 2),
    (True, 256): (32, 32, 8, 2),
    (False, 64): (32, 32, 4, 2),  # float32 products are IEEE FMAs: smaller tiles
    (False, 128): (64, 32, 8, 2),
    (False, 256): (32, 32, 8, 1),
}


def block_sizes(head_dim: int, value_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a call; 16 x 16 under the interpreter."""
    if interpreting():
        return 16, 16, 4, 1
    dim = next(d for d in (64, 128, 256) if max(head_dim, value_dim) <= d)
    return _LAUNCH[(dtype in (torch.float16, torch.bfloat16), dim)]


def _mask_args(tiles: TileLists, bias: Tensor | None, like: Tensor, shape) -> list:
    """Bias, Mask, Tiles pointers and their strides (dummies where absent)."""
    bias4 = like if bias is None else broadcast4d(bias, shape)
    mask = like if tiles.mask is None else tiles.mask
    buf = like if tiles.tiles is None else tiles.tiles
    bias_strides = (0,) * 4 if bias is None else bias4.stride()
    mask_strides = (0,) * 4 if tiles.mask is None else mask.stride()
    tile_stride = 0 if tiles.tiles is None or buf.shape[0] == 1 else buf.stride(0)
    return [bias4, mask, buf, *bias_strides, *mask_strides, tile_stride]


def _dot_options(dtype: torch.dtype) -> dict:
    """IEEE float32 products unless torch allows TF32; bfloat16 dots are upcast under
    the interpreter, whose dot cannot take them; ACC is the statistics dtype."""
    prec = None
    if dtype == torch.float32:
        prec = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    return {"PREC": prec, "UPCAST": interpreting() and dtype == torch.bfloat16, "ACC": acc}


def _dropout_args(dropout: tuple[float, int] | None) -> list:
    """seed, threshold, keep_scale of (p, seed) (zeros without dropout)."""
    if dropout is None:
        return [0, 0, 1.0]
    p, seed = dropout
    return [seed, int(p * 2**32), 1.0 / (1.0 - p)]


def _block_dim(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _forward(q, k, v, bias, tiles: TileLists, scale, dropout) -> tuple[Tensor, Tensor]:
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    out = q.new_empty(batch, num_heads, q_len, value_dim)
    lse = torch.empty(batch, num_heads, q_len, dtype=stats_dtype(q.dtype), device=q.device)
    masks = _mask_args(tiles, bias, q, (batch, num_heads, q_len, kv_len))
    _attn_fwd[(tiles.num_q_blocks, batch * num_heads)](
        q, k, v, out, lse, *masks[:3], tiles.row_ptr, tiles.row_blk, tiles.row_kind,
        tiles.row_tile, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *masks[3:],
        num_heads, num_heads // num_kv_heads, q_len, kv_len, head_dim, value_dim,
        scale, tiles.shift, *_dropout_args(dropout),
        HAS_BIAS=bias is not None, MASK_MODE=tiles.mask_mode, CAUSAL=tiles.causal,
        DROPOUT=dropout is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=_block_dim(head_dim), BLOCK_DV=_block_dim(value_dim), **_dot_options(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out, lse


def _backward(grad_out, grad_lse, q, k, v, bias, out, lse, tiles: TileLists, scale, dropout,
              bias_grad: bool):  # fmt: skip
    """(dq, dk, dv, dbias or None), each in its input's dtype."""
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    shape = (batch, num_heads, q_len, kv_len)
    acc = stats_dtype(q.dtype)
    grad_out = grad_out.to(q.dtype)
    delta = (grad_out.to(acc) * out.to(acc)).sum(dim=-1)  # (B, H, L)
    if grad_lse is not None:  # d lse / d scores is P: it enters as a shift of delta
        delta = delta - torch.where(torch.isfinite(lse), grad_lse.to(acc), 0.0)
    delta = delta.contiguous()
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty(v.shape, dtype=acc, device=q.device)
    dbias = torch.zeros(shape, dtype=acc, device=q.device) if bias_grad else q
    masks = _mask_args(tiles, bias, q, shape)
    common = dict(
        HAS_BIAS=bias is not None, MASK_MODE=tiles.mask_mode, CAUSAL=tiles.causal,
        DROPOUT=dropout is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=_block_dim(head_dim), BLOCK_DV=_block_dim(value_dim), **_dot_options(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    strides = [*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *masks[3:]]
    sizes = [q_len, kv_len, head_dim, value_dim, scale, tiles.shift, *_dropout_args(dropout)]
    _attn_bwd_dq[(tiles.num_q_blocks, batch * num_heads)](
        q, k, v, grad_out, lse, delta, dq, dbias, *masks[:3],
        tiles.row_ptr, tiles.row_blk, tiles.row_kind, tiles.row_tile,
        *strides, num_heads, num_heads // num_kv_heads, *sizes, BIAS_GRAD=bias_grad, **common,
    )  # fmt: skip
    _attn_bwd_dkv[(tiles.num_k_blocks, batch * num_kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, *masks[:3],
        tiles.col_ptr, tiles.col_blk, tiles.col_kind, tiles.col_tile,
        *strides, num_heads, num_kv_heads, num_heads // num_kv_heads, *sizes, **common,
    )  # fmt: skip
    grad_bias = None
    if bias_grad:
        bias4 = bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))
        dims = [i for i in range(4) if bias4.shape[i] == 1 and shape[i] != 1]
        grad_bias = (dbias.sum(dim=dims, keepdim=True) if dims else dbias).view(bias.shape)
        grad_bias = grad_bias.to(bias.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grad_bias


class TritonAttention(torch.autograd.Function):
    """(q, k, v, bias) -> (out, lse); saves only q, k, v, bias, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, bias, tiles, scale, dropout):
        out, lse = _forward(q, k, v, bias, tiles, scale, dropout)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.tiles, ctx.scale, ctx.dropout = tiles, scale, dropout
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = _backward(
            grad_out, grad_lse, q, k, v, bias, out, lse, ctx.tiles, ctx.scale, ctx.dropout,
            bias_grad,
        )  # fmt: skip
        return dq, dk, dv, dbias, None, None, None


def check_inputs(q: Tensor, k: Tensor, v: Tensor | None, mask, bias: Tensor | None) -> None:
    """Raise ValueError/TypeError for what the kernels cannot take, saying what to do."""
    v = k if v is None else v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, length, dim), got {got}")
    dtypes = DTYPES + ((torch.float64,) if interpreting() else ())
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"the triton kernels take float32, float16 or bfloat16 q, k, v of one dtype "
            f"(float64 only under the interpreter), got {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them, or use backend='flash' for float64"
        )
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"q is on {q.device}: the triton kernels need a CUDA device (or TRITON_INTERPRET=1 "
            "set before importing triton, slow, for tests); move q, k, v with .cuda()"
        )
    batch, num_heads, _, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must be (batch, H_kv, S, D) for q {tuple(q.shape)}")
    if v.shape[1:3] != k.shape[1:3] or num_heads % k.shape[1] != 0:
        raise ValueError(
            f"v {tuple(v.shape)} must share k's heads and length, and q's {num_heads} heads "
            f"must be a multiple of k's {k.shape[1]}"
        )
    if max(head_dim, v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(
            f"head dims up to {MAX_HEAD_DIM} are supported, got D={head_dim}, D_v={v.shape[3]}; "
            "use backend='flash' for larger heads"
        )
    shape = (batch, num_heads, q.shape[2], k.shape[2])
    for name, t in (("mask", mask), ("bias", bias)):
        if isinstance(t, Tensor) and (
            t.dim() > 4
            or any(a not in (1, b) for a, b in zip(t.shape[::-1], shape[::-1], strict=False))
        ):
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} does not broadcast to (B, H, L, S) = "
                f"{shape}; give it size-1 dimensions where it is shared"
            )
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool (True = may attend), got {mask.dtype}; use bias=")
    if bias is not None and not bias.is_floating_point():
        raise TypeError(f"bias must be a float tensor, got {bias.dtype}")


def _prepare(q, k, v, mask, bias, causal, scale, blocks):
    check_inputs(q, k, v, mask, bias)
    value_dim = q.shape[3] if v is None else v.shape[3]
    launch = block_sizes(q.shape[3], value_dim, q.dtype)
    if blocks is not None:
        blocks = tuple(blocks)
        tiles_ok = len(blocks) in (2, 4) and all(b >= 16 and not b & (b - 1) for b in blocks[:2])
        if not tiles_ok or any(b < 1 for b in blocks[2:]):
            raise ValueError(
                "blocks must be (BLOCK_M, BLOCK_N) or (BLOCK_M, BLOCK_N, num_warps, "
                f"num_stages), tiles powers of two >= 16, got {blocks}"
            )
        launch = blocks + launch[len(blocks) :]
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    tiles = build_tiles(mask, causal, shape, q.device, launch)
    return tiles, 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask=None,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    blocks: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention in Triton: (out (B, H, L, D_v) in q's dtype, lse (B, H, L) float32,
    float64 for float64 inputs, which only the interpreter takes).

    q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v) with H % H_kv == 0 and
    D, D_v <= 256; mask an mhsa.masks pattern or a bool tensor broadcastable to
    (B, H, L, S) (True = may attend); bias float, broadcastable, differentiable;
    causal aligned bottom-right (query i sees keys <= i + S - L); scale defaults to
    1/sqrt(D). Dropout keeps exactly the entries of mhsa.kernels.dropout.keep_mask
    with the given seed (default: drawn from torch's generator). blocks overrides
    (BLOCK_M, BLOCK_N), each a power of two >= 16, and optionally (num_warps,
    num_stages) after them. A row with no allowed key gets
    output 0, lse -inf and zero gradients.
    """
    if q.shape[2] == 0 or k.shape[2] == 0:
        out = q.new_zeros(*q.shape[:3], v.shape[3])
        return out, q.new_full(q.shape[:3], -math.inf, dtype=stats_dtype(q.dtype))
    tiles, scale = _prepare(q, k, v, mask, bias, causal, scale, blocks)
    dropout = None
    if dropout_p > 0:
        dropout = (float(dropout_p), draw_seed() if seed is None else int(seed))
    return TritonAttention.apply(q, k, v, bias, tiles, scale, dropout)


@torch.no_grad()
def triton_attention_weights(
    q: Tensor,
    k: Tensor,
    mask=None,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    lse: Tensor | None = None,
    blocks: tuple[int, ...] | None = None,
) -> Tensor:
    """Softmax probabilities (B, H, L, S) of q k^T * scale + bias, float32 (the statistics
    dtype), masked as in triton_attention and normalised by lse (B, H, L) (default: the
    one the forward kernel computes). Only visited tiles are computed; rows with no
    allowed key and empty tiles are 0. No dropout is applied."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(*q.shape[:3], k.shape[2], dtype=stats_dtype(q.dtype))
    tiles, scale = _prepare(q, k, None, mask, bias, causal, scale, blocks)
    if lse is None:
        lse = _forward(q, k, k, bias, tiles, scale, None)[1]
    batch, num_heads, q_len, head_dim = q.shape
    shape = (batch, num_heads, q_len, k.shape[2])
    if lse.shape != shape[:3]:
        raise ValueError(f"lse must have shape {shape[:3]}, got {tuple(lse.shape)}")
    lse = lse.to(stats_dtype(q.dtype)).contiguous()
    probs = torch.zeros(shape, dtype=stats_dtype(q.dtype), device=q.device)
    masks = _mask_args(tiles, bias, q, shape)
    _attn_probs[(tiles.num_q_blocks, batch * num_heads)](
        q, k, lse, probs, *masks[:3], tiles.row_ptr, tiles.row_blk, tiles.row_kind,
        tiles.row_tile, *q.stride(), *k.stride(), *masks[3:],
        num_heads, num_heads // k.shape[1], q_len, k.shape[2], head_dim, scale, tiles.shift,
        HAS_BIAS=bias is not None, MASK_MODE=tiles.mask_mode, CAUSAL=tiles.causal,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=_block_dim(head_dim),
        **_dot_options(q.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return probs


def triton_keep_mask(
    seed: int, batch: int, num_heads: int, q_len: int, kv_len: int, p: float, device
) -> Tensor:
    """(B, H, L, S) bool: the dropout keep mask the kernels draw for (seed, p); equal to
    mhsa.kernels.dropout.keep_mask(seed, B, H, 0, L, arange(S), p)."""
    out = torch.empty(batch, num_heads, q_len, kv_len, dtype=torch.bool, device=device)
    grid = (triton.cdiv(q_len, 16), triton.cdiv(kv_len, 16), batch * num_heads)
    _keep_mask[grid](out, seed, int(p * 2**32), q_len, kv_len, BLOCK_M=16, BLOCK_N=16)
    return out
