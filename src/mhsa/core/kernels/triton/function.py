"""Launch code for the Triton kernels: the autograd Function, attention probabilities
and the dropout mask.

Every launch walks the tile lists of .tiles (the flash engine's block plan).
Backward is atomic-free: one program per query block writes dQ (and its dS tiles
into a dBias buffer of the full (B, H, L, S) shape, reduced over broadcast dims with
torch), one program per (key block, kv head) accumulates dK and dV over the query
heads of its group. Score functions' tensors get their gradients from per-program
partial sums of the dQ programs (see .scores); sinks from lse and delta in torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from ...checks import as_4d
from ...scores import ScoreFunction
from ..dense import stats_dtype
from ..dropout import draw_seed
from ..scored import sink_grad
from . import band_launch
from .attention import _attn_bwd_dkv, _attn_bwd_dq, _attn_fwd, _attn_probs, _keep_mask
from .band_launch import BandPlan, band_backward, band_forward, band_plan
from .checks import check_inputs, check_score, interpreting
from .delta import row_delta
from .options import block_dim, kernel_options, strides
from .scores import KernelScore, block_buckets, kernel_score
from .tiles import TileLists, broadcast4d, build_tiles

NO_SCORE = KernelScore()
NO_TENSORS = (None, None, None)  # (slopes, table, sinks)

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


def _dropout_args(dropout: tuple[float, int] | None) -> list:
    """seed, threshold, keep_scale of (p, seed) (zeros without dropout)."""
    if dropout is None:
        return [0, 0, 1.0]
    p, seed = dropout
    return [seed, int(p * 2**32), 1.0 / (1.0 - p)]


class LaunchCall(NamedTuple):
    """One call of the kernels: q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v),
    bias (broadcastable to (B, H, L, S)) or None, the tile lists, scale, dropout (p, seed)
    or None, the kernel score function and its tensors (slopes, table, sinks), None where
    absent."""

    q: Tensor
    k: Tensor
    v: Tensor
    bias: Tensor | None
    tiles: TileLists
    scale: float
    dropout: tuple[float, int] | None
    score: KernelScore = NO_SCORE
    tensors: tuple = NO_TENSORS


def _row_lists(tiles: TileLists) -> list[Tensor]:
    """The tile lists by query block, as the forward and dQ kernels take them."""
    return [tiles.row_ptr, tiles.row_blk, tiles.row_kind, tiles.row_tile]


def _options(tiles: TileLists, bias, score: KernelScore, q: Tensor, value_dim=None) -> dict:
    """The constexprs and launch options that every kernel takes (BLOCK_DV with
    value_dim; EVEN where L and S are multiples of the tiles, S = L + shift)."""
    launch = (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages)
    q_len = q.shape[2]
    options = dict(
        kernel_options(q, score, launch),
        HAS_BIAS=bias is not None,
        MASK_MODE=tiles.mask_mode,
        CAUSAL=tiles.causal,
        EVEN=q_len % tiles.block_m == 0 and (q_len + tiles.shift) % tiles.block_n == 0,
    )
    if value_dim is not None:
        options["BLOCK_DV"] = block_dim(value_dim)
    return options


def launch_forward(call: LaunchCall, ahead: bool | None = None) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D_v), lse (B, H, L)); ahead: each tile's scores issued before the
    previous tile's softmax (same bits; default band_launch's FORWARD_AHEAD for band
    calls, TILES_AHEAD for tile lists)."""
    q, k, v, bias, tiles, scale, dropout, score, tensors = call
    if isinstance(tiles, BandPlan):
        return band_forward(q, k, v, tiles, scale, score, tensors, ahead=ahead)
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    out = q.new_empty(batch, num_heads, q_len, value_dim)
    lse = torch.empty(batch, num_heads, q_len, dtype=stats_dtype(q.dtype), device=q.device)
    masks = _mask_args(tiles, bias, q, (batch, num_heads, q_len, kv_len))
    _attn_fwd[(tiles.num_q_blocks, batch * num_heads)](
        q,
        k,
        v,
        out,
        lse,
        *masks[:3],
        *_row_lists(tiles),
        *strides(q, k, v, out),
        *masks[3:],
        num_heads,
        num_heads // num_kv_heads,
        q_len,
        kv_len,
        head_dim,
        value_dim,
        scale,
        tiles.shift,
        *_dropout_args(dropout),
        *score.args(*tensors, like=q),
        HAS_SINKS=tensors[2] is not None,
        DROPOUT=dropout is not None,
        AHEAD=band_launch.TILES_AHEAD if ahead is None else ahead,
        **_options(tiles, bias, score, q, value_dim),
    )
    return out, lse


def launch_backward(
    call: LaunchCall,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    out: Tensor,
    lse: Tensor,
    bias_grad: bool,
    wanted: tuple = (False, False, False),
):
    """(dq, dk, dv, dbias, dsinks, dslopes, dtable) of call given the gradients of its
    out and lse, each in its input's dtype; dbias when bias_grad, the others where wanted
    (sinks, slopes, table) says so, else None."""
    q, k, v, bias, tiles, scale, dropout, score, tensors = call
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    shape = (batch, num_heads, q_len, kv_len)
    acc = stats_dtype(q.dtype)
    grad_out = grad_out.to(q.dtype)
    # (B, H, L); d lse / d scores is P: grad_lse enters as a shift of delta
    delta = row_delta(grad_out, out, lse, grad_lse)
    if isinstance(tiles, BandPlan):  # (only planned where no score tensor needs a gradient)
        dq, dk, dv = band_backward(q, k, v, grad_out, delta, lse, tiles, scale, score, tensors)
        dsinks = sink_grad(tensors[2], lse, delta) if wanted[0] else None
        return dq, dk, dv, None, dsinks, None, None
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    dbias = torch.zeros(shape, dtype=acc, device=q.device) if bias_grad else q
    slope_grad, table_grad = wanted[1] and score.alibi > 0, wanted[2] and score.relative > 0
    block_nb = block_buckets(score.num_buckets)
    partial = (batch * num_heads, tiles.num_q_blocks)
    d_slope = torch.empty(partial, dtype=acc, device=q.device) if slope_grad else q
    d_table = torch.empty(*partial, block_nb, dtype=acc, device=q.device) if table_grad else q
    masks = _mask_args(tiles, bias, q, shape)
    common = dict(DROPOUT=dropout is not None, **_options(tiles, bias, score, q, value_dim))
    stride_args = [*strides(q, k, v, grad_out), *masks[3:]]
    sizes = [
        q_len,
        kv_len,
        head_dim,
        value_dim,
        scale,
        tiles.shift,
        *_dropout_args(dropout),
        *score.args(*tensors, like=q),
    ]
    _attn_bwd_dq[(tiles.num_q_blocks, batch * num_heads)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dq,
        dbias,
        *masks[:3],
        *_row_lists(tiles),
        *stride_args,
        num_heads,
        num_heads // num_kv_heads,
        *sizes,
        d_slope,
        d_table,
        BIAS_GRAD=bias_grad,
        SLOPE_GRAD=slope_grad,
        TABLE_GRAD=table_grad,
        BLOCK_NB=block_nb,
        **common,
    )
    _attn_bwd_dkv[(tiles.num_k_blocks, batch * num_kv_heads)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dk,
        dv,
        *masks[:3],
        tiles.col_ptr,
        tiles.col_blk,
        tiles.col_kind,
        tiles.col_tile,
        *stride_args,
        num_heads,
        num_kv_heads,
        num_heads // num_kv_heads,
        *sizes,
        **common,
    )
    grad_bias = None
    if bias_grad:
        bias4 = as_4d(bias)
        dims = [i for i in range(4) if bias4.shape[i] == 1 and shape[i] != 1]
        grad_bias = (dbias.sum(dim=dims, keepdim=True) if dims else dbias).view(bias.shape)
        grad_bias = grad_bias.to(bias.dtype)
    slopes, table, sinks = tensors
    grads = [
        sink_grad(sinks, lse, delta) if wanted[0] else None,
        d_slope.view(batch, num_heads, -1).sum(dim=(0, 2)).to(slopes.dtype) if slope_grad else None,
        (
            d_table.view(batch, num_heads, -1, block_nb)
            .sum(dim=(0, 2))[:, : score.num_buckets]
            .t()
            .to(table.dtype)
            if table_grad
            else None
        ),
    ]
    return dq, dk, dv, grad_bias, *grads


class TritonAttention(torch.autograd.Function):
    """(q, k, v, bias, sinks, slopes, table) -> (out, lse); saves only those inputs, out
    and lse. slopes and table are the ALiBi and RelativeBias tensors of the score
    function that KernelScore describes (None where absent)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, slopes, table, tiles, scale, dropout, score):
        tensors = (slopes, table, sinks)
        out, lse = launch_forward(LaunchCall(q, k, v, bias, tiles, scale, dropout, score, tensors))
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.save_for_backward(q, k, v, bias, sinks, slopes, table, out, lse)
        ctx.tiles, ctx.scale, ctx.dropout, ctx.score = tiles, scale, dropout, score
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, sinks, slopes, table, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        needs = ctx.needs_input_grad[4:7]
        wanted = tuple(
            t is not None and need for t, need in zip((sinks, slopes, table), needs, strict=True)
        )
        tensors = (slopes, table, sinks)
        call = LaunchCall(q, k, v, bias, ctx.tiles, ctx.scale, ctx.dropout, ctx.score, tensors)
        grads = launch_backward(call, grad_out, grad_lse, out, lse, bias_grad, wanted)
        return (*grads, None, None, None, None)


def _no_keys(q: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out, lse) of a call with no query rows or no keys: zeros, and lse -inf (each
    row's sink with sinks: its only "key")."""
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    lse = q.new_full(q.shape[:3], -math.inf, dtype=stats_dtype(q.dtype))
    if sinks is not None:
        lse = sinks.to(lse.dtype).view(1, -1, 1).expand(lse.shape)
    return out, lse


def _prepare(q, k, v, mask, bias, causal, scale, blocks, score=None, sinks=None, band=False):
    """(plan, scale, kernel score, slopes, table) of a checked call (v None: no values).
    The plan is a BandPlan where band allows it (no dropout, no score-tensor gradient
    wanted by the caller) and the band kernels serve the call, else the tile lists.
    The band kernels do not accumulate in float64, give no gradient to ALiBi slopes or
    RelativeBias tables, do not take blocks, and take scale > 0 (their forward takes the
    row max of the unscaled products)."""
    kernel, slopes, table = kernel_score(score)
    check_inputs(q, k, v, mask, bias)
    check_score(score, sinks, q)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    band = (
        band and scale > 0 and not any(t is not None and t.requires_grad for t in (slopes, table))
    )
    if band and blocks is None and q.dtype != torch.float64:
        plan = band_plan(q, k, v, mask, bias, causal, alibi=kernel.alibi > 0)
        if plan is not None:
            return plan, scale, kernel, slopes, table
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
    return tiles, scale, kernel, slopes, table


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
    score: ScoreFunction | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention in Triton: (out (B, H, L, D_v) in q's dtype, lse (B, H, L) float32,
    float64 for float64 inputs, which only the interpreter takes).

    q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v) with H % H_kv == 0 and
    D, D_v <= 256; mask an mhsa.core.masks pattern or a bool tensor broadcastable to
    (B, H, L, S) (True = may attend); bias float, broadcastable, differentiable;
    causal aligned bottom-right (query i sees keys <= i + S - L); scale defaults to
    1/sqrt(D). Dropout keeps exactly the entries of mhsa.core.kernels.dropout.keep_mask
    with the given seed (default: drawn from torch's generator). blocks overrides
    (BLOCK_M, BLOCK_N), each a power of two >= 16, and optionally (num_warps,
    num_stages) after them. score: ALiBi, RelativeBias, Softcap or a composition holding
    each at most once (mhsa.core.scores), applied to the scaled scores before the bias and
    the mask, query row i at position i + S - L; its slopes and table are
    differentiable. sinks (H,): differentiable logits of a key without a value in each
    row's denominator. A row with no allowed key gets output 0, lse -inf (its sink with
    sinks) and zero gradients.
    """
    if q.shape[2] == 0 or k.shape[2] == 0:
        return _no_keys(q, v, sinks)
    band = dropout_p == 0
    prepared = _prepare(q, k, v, mask, bias, causal, scale, blocks, score, sinks, band)
    tiles, scale, kernel, slopes, table = prepared
    dropout = None
    if dropout_p > 0:
        dropout = (float(dropout_p), draw_seed() if seed is None else int(seed))
    return TritonAttention.apply(q, k, v, bias, sinks, slopes, table, tiles, scale, dropout, kernel)


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
    score: ScoreFunction | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Softmax probabilities (B, H, L, S) of score(q k^T * scale) + bias, float32 (the
    statistics dtype), masked as in triton_attention and normalised by lse (B, H, L)
    (default: the one the forward kernel computes, sinks in its denominator). Only
    visited tiles are computed; rows with no allowed key and empty tiles are 0. No
    dropout is applied."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        return q.new_zeros(*q.shape[:3], k.shape[2], dtype=stats_dtype(q.dtype))
    prepared = _prepare(q, k, None, mask, bias, causal, scale, blocks, score, sinks)
    tiles, scale, kernel, slopes, table = prepared
    if lse is None:
        call = LaunchCall(q, k, k, bias, tiles, scale, None, kernel, (slopes, table, sinks))
        lse = launch_forward(call)[1]
    batch, num_heads, q_len, head_dim = q.shape
    shape = (batch, num_heads, q_len, k.shape[2])
    if lse.shape != shape[:3]:
        raise ValueError(f"lse must have shape {shape[:3]}, got {tuple(lse.shape)}")
    lse = lse.to(stats_dtype(q.dtype)).contiguous()
    probs = torch.zeros(shape, dtype=stats_dtype(q.dtype), device=q.device)
    masks = _mask_args(tiles, bias, q, shape)
    _attn_probs[(tiles.num_q_blocks, batch * num_heads)](
        q,
        k,
        lse,
        probs,
        *masks[:3],
        *_row_lists(tiles),
        *strides(q, k),
        *masks[3:],
        num_heads,
        num_heads // k.shape[1],
        q_len,
        k.shape[2],
        head_dim,
        scale,
        tiles.shift,
        *kernel.args(slopes, table, None, like=q),
        **_options(tiles, bias, kernel, q),
    )
    return probs


def triton_keep_mask(
    seed: int, batch: int, num_heads: int, q_len: int, kv_len: int, p: float, device
) -> Tensor:
    """(B, H, L, S) bool: the dropout keep mask the kernels draw for (seed, p); equal to
    mhsa.core.kernels.dropout.keep_mask(seed, B, H, 0, L, arange(S), p)."""
    out = torch.empty(batch, num_heads, q_len, kv_len, dtype=torch.bool, device=device)
    grid = (triton.cdiv(q_len, 16), triton.cdiv(kv_len, 16), batch * num_heads)
    _keep_mask[grid](out, seed, int(p * 2**32), q_len, kv_len, BLOCK_M=16, BLOCK_N=16)
    return out
