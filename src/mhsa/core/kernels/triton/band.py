"""Triton kernels for band attention: dense, causal and sliding windows, the calls
where each query block's keys (and each key block's queries) are one contiguous range.

The query at global position p = i + shift (shift = S - L, bottom-right) may see the
keys j with p - left <= j <= p + right and j < S; dense is left = right = BIG, causal
right = 0. So no tile list is read: each program computes its range of blocks and
splits it into masked edges and an unmasked middle, each its own loop, so the middle
loop (where the time goes) holds no mask, no bounds check and no index load, and
Triton pipelines its loads.

Softmax runs in base 2: scores are multiplied by scale * log2(e) once, exp2 replaces
exp, and lse is stored in the natural log as the other kernels store it. Score
functions (mhsa.core.kernels.triton.scores) are applied to the natural scaled scores
first. Padding rows and rows with no allowed key have lse +inf in the backward, so
their probabilities recompute as exactly 0. The gradients' kernels are in .band_grad.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import LOG2E, _dot, _program_heads
from .scores import _head_score, _score_fn, key_offsets

LN2 = tl.constexpr(0.6931471805599453)
BIG = 1 << 30  # a window side that covers any length


@triton.jit
def _band_blocks(r0, r1, shift, left, right, kv_len, BLOCK_N: tl.constexpr):
    """Key blocks of query rows r0..r1: (first, first unmasked, end of unmasked, end);
    blocks in [first, full_lo) and [full_hi, end) need the mask."""
    k_lo = tl.maximum(r0 + shift - left, 0)
    k_hi = tl.minimum(r1 + shift + right + 1, kv_len)  # one past the last key seen
    first = k_lo // BLOCK_N
    end = tl.maximum(tl.cdiv(k_hi, BLOCK_N), first)
    # an unmasked block starts at or after every row's first key and ends at or
    # before every row's last key (and before S)
    full_lo = tl.cdiv(tl.maximum(r1 + shift - left, 0), BLOCK_N)
    full_hi = tl.maximum(tl.minimum(r0 + shift + right + 1, kv_len), 0) // BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, first), end)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return first, full_lo, full_hi, end


@triton.jit
def _query_block(LAST_FIRST: tl.constexpr):
    """The query block of a program on grid (query blocks, B * H): program_id(0), or
    with LAST_FIRST counted from the last, so that with causal the blocks that see the
    most keys start first and the short ones fill the GPU's tail (FlashAttention-3
    schedules the longest first; here only within a head, whose programs run side by
    side and share its keys in L2)."""
    qi = tl.program_id(0)
    if LAST_FIRST:
        qi = tl.num_programs(0) - 1 - qi
    return qi


@triton.jit
def _float_positions(first, BLOCK: tl.constexpr):
    """(BLOCK,) float32 positions first, first + 1, ...: one conversion for the block.
    ALiBi's offsets are taken from these (an add per entry, where an integer offset
    costs an add and a quarter-rate conversion beside exp2); exact below 2**24, which
    band_plan ensures for calls with ALiBi."""
    return tl.cast(first, tl.float32) + tl.arange(0, BLOCK).to(tl.float32)


@triton.jit
def _allowed(offset, col_ok, left, right):
    """Where the band allows a key at offset (key minus query position) and col_ok
    (the key bound, broadcast alike)."""
    return (offset >= -left) & (offset <= right) & col_ok


@triton.jit
def _tile(base, idx, limit, stride, dims, dim, stride_d, CHECK: tl.constexpr):
    """The tile base[idx, dims]; with CHECK rows idx >= limit and columns dims >= dim
    read as 0."""
    ptrs = base + idx.to(tl.int64)[:, None] * stride + dims[None, :] * stride_d
    if CHECK:
        return tl.load(ptrs, mask=(idx[:, None] < limit) & (dims[None, :] < dim), other=0.0)
    return tl.load(ptrs)


# Triton takes no structs: kernels and their helpers keep dense argument lists, which
# the formatter would spread one per line.
# fmt: off
@triton.jit
def _scores2(qk, offset, scale, slope, table, stn, Buckets, span, cap,
             ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr,
             RAW: tl.constexpr = False):
    """(base-2 scores of the dot products qk, tanh of the softcap for the backward);
    offset: the keys' offsets from the queries, in qk's orientation. With RAW and no
    score function: qk itself, for the caller to multiply by _unit."""
    if ALIBI or RELATIVE or SOFTCAP:
        s, t = _score_fn(qk * scale, offset, slope, table, stn, Buckets, span, cap,
                         ALIBI, RELATIVE, SOFTCAP, tl.float32)
        return s * LOG2E, t
    if RAW:
        return qk, qk
    return qk * (scale * LOG2E), qk


@triton.jit
def _unit(scale, ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr):
    """What scores from _scores2(RAW=True) are multiplied by to be base 2: 1 where a
    score function made them, else scale * log2(e)."""
    unit = scale * LOG2E
    if ALIBI or RELATIVE or SOFTCAP:
        unit = 1.0
    return unit


@triton.jit
def _rows_of(base, block, stride, stride_d, head_dim, kv_len, desc, b, hk,
             MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """Key block `block` (BLOCK_N, BLOCK_D) of keys or values: from base, or with TMA
    through the tensor descriptor desc of (B, H_kv, S, D) at batch b, kv head hk."""
    if TMA:
        return desc.load([b, hk, block * BLOCK_N, 0]).reshape([BLOCK_N, BLOCK_D])
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    return _tile(base, cols, kv_len, stride, dims, head_dim, stride_d, MASKED or not EVEN_D)


@triton.jit
def _key_block(q, rows, block, k_base, v_base, sks, skd, svs, svd, head_dim, kv_len, scale,
               shift, left, right, slope, table, stn, Buckets, span, cap, k_desc, v_desc, b, hk,
               MASKED: tl.constexpr, ALIBI: tl.constexpr, RELATIVE: tl.constexpr,
               SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               EVEN_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
               TMA: tl.constexpr, RAW: tl.constexpr = False):
    """Key block `block` of the query rows of q (the forward and dQ kernels): its keys
    (BLOCK_N, BLOCK_D), values, base-2 scores (BLOCK_M, BLOCK_N; with RAW as
    _scores2), the softcap's tanh, and where the band allows (with MASKED; else True).
    Each caller applies the mask where it fuses best: the forward to the scores, dQ to
    the probabilities. With TMA the keys and values come through the tensor
    descriptors k_desc, v_desc of (B, H_kv, S, D) at batch b, kv head hk (Hopper's TMA;
    it reads past S and D as 0)."""
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _rows_of(k_base, block, sks, skd, head_dim, kv_len, k_desc, b, hk, MASKED, BLOCK_N,
                 BLOCK_D, EVEN_D, TMA)
    v = _rows_of(v_base, block, svs, svd, head_dim, kv_len, v_desc, b, hk, MASKED, BLOCK_N,
                 BLOCK_D, EVEN_D, TMA)
    qk = _dot(q, tl.trans(k), PREC, UPCAST, tl.float32)
    offset = key_offsets(rows, cols, shift)
    score_offset = offset  # (RelativeBias looks buckets up by integer offset)
    if ALIBI and not RELATIVE:
        keys = _float_positions(block * BLOCK_N, BLOCK_N)
        score_offset = keys[None, :] - (rows + shift).to(tl.float32)[:, None]
    s, t = _scores2(qk, score_offset, scale, slope, table, stn, Buckets, span, cap,
                    ALIBI, RELATIVE, SOFTCAP, RAW)
    allowed = True
    if MASKED:
        allowed = _allowed(offset, cols[None, :] < kv_len, left, right)
    return k, v, s, t, allowed


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, rows, k_base, v_base, sks, skd, svs, svd, lo, hi,
                head_dim, q_len, kv_len, scale, shift, left, right, slope, table, stn,
                Buckets, span, cap, k_desc, v_desc, b, hk,
                MASKED: tl.constexpr, ALIBI: tl.constexpr, RELATIVE: tl.constexpr,
                SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                EVEN_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                TMA: tl.constexpr, AHEAD: tl.constexpr):
    """The online softmax over key blocks lo..hi-1; MASKED applies the band. Without a
    score function the row max is taken over the raw products and then scaled: for
    scale > 0 rounding keeps their order, so the max is that of the scaled scores, bit
    for bit, and each score is scaled once, in exp2's multiply-add. With AHEAD (the
    unmasked blocks) each block's q k^T is issued before the previous block's softmax,
    whose exp2s then run while the tensor cores work; its values are carried in
    registers to the next iteration, which stores them for the product. (Loading each
    block's values in its own iteration instead lets Triton pipeline them through shared
    memory, but then the compiled code waits for the scores before the exp2s again.)"""
    unit = _unit(scale, ALIBI, RELATIVE, SOFTCAP)
    if AHEAD and not MASKED:
        if lo < hi:  # the first block's scores; then each block's, and the last's softmax
            _, v, s, _, _ = _key_block(q, rows, lo, k_base, v_base, sks, skd, svs, svd,
                                       head_dim, kv_len, scale, shift, left, right, slope,
                                       table, stn, Buckets, span, cap, k_desc, v_desc, b, hk,
                                       False, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D,
                                       EVEN_D, PREC, UPCAST, TMA, True)
            for block in range(lo + 1, hi):
                _, v_next, s_next, _, _ = _key_block(
                    q, rows, block, k_base, v_base, sks, skd, svs, svd, head_dim, kv_len,
                    scale, shift, left, right, slope, table, stn, Buckets, span, cap, k_desc,
                    v_desc, b, hk, False, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                    PREC, UPCAST, TMA, True)
                acc, l_i, m_i = _online_step(acc, l_i, m_i, s, v, True, unit, False, PREC,
                                             UPCAST)
                s = s_next
                v = v_next
            acc, l_i, m_i = _online_step(acc, l_i, m_i, s, v, True, unit, False, PREC, UPCAST)
    else:
        for block in range(lo, hi):
            k, v, s, _, allowed = _key_block(q, rows, block, k_base, v_base, sks, skd, svs,
                                             svd, head_dim, kv_len, scale, shift, left, right,
                                             slope, table, stn, Buckets, span, cap, k_desc,
                                             v_desc, b, hk, MASKED, ALIBI, RELATIVE, SOFTCAP,
                                             BLOCK_N, BLOCK_D, EVEN_D, PREC, UPCAST, TMA, True)
            acc, l_i, m_i = _online_step(acc, l_i, m_i, s, v, allowed, unit, MASKED, PREC,
                                         UPCAST)
    return acc, l_i, m_i


@triton.jit
def _online_step(acc, l_i, m_i, s, v, allowed, unit, MASKED: tl.constexpr,
                 PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of the online softmax: scores s (BLOCK_M, BLOCK_N), to be
    multiplied by unit, values v (BLOCK_N, BLOCK_D); MASKED: only where allowed.
    Returns acc (BLOCK_M, BLOCK_D), l_i and m_i (BLOCK_M,)."""
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * unit)
    m_safe = m_new
    if MASKED:  # rows with nothing yet subtract 0, and keep their max at -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * unit - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST, tl.float32)
    return acc, l_i, m_new


@triton.jit
def _band_fwd(
    Q, K, V, Out, Lse, sqb, sqh, sql, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sob, soh, sol, sod, num_heads, group, q_len, kv_len, head_dim, scale, shift, left, right,
    Slopes, Table, Buckets, Sinks, stn, sth, span, cap, KDesc, VDesc,
    ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, AHEAD: tl.constexpr,
    LAST_FIRST: tl.constexpr,
):
    """Grid (query blocks, B * H): out (B, H, L, D) and lse (B, H, L) float32 of one
    query block. With HAS_SINKS each row starts at max = its sink and sum = 1. With TMA,
    keys and values are read through the tensor descriptors KDesc, VDesc (else None).
    With LAST_FIRST each head's query blocks are launched from the last."""
    qi, bh = _query_block(LAST_FIRST), tl.program_id(1)
    b64, h64, hk64 = _program_heads(bh, num_heads, group)
    b, hk = bh // num_heads, bh % num_heads // group  # (int32: the descriptors' indices)
    slope, table, sink = _head_score(Slopes, Table, Sinks, h64, sth, ALIBI, HAS_SINKS, tl.float32)
    rows = qi * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _tile(Q + b64 * sqb + h64 * sqh, rows, q_len, sql, dims, head_dim, sqd, True)
    k_base, v_base = K + b64 * skb + hk64 * skh, V + b64 * svb + hk64 * svh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + sink * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first, full_lo, full_hi, end = _band_blocks(qi * BLOCK_M, qi * BLOCK_M + BLOCK_M - 1,
                                                shift, left, right, kv_len, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, k_base, v_base, sks, skd, svs, svd,
                                first, full_lo, head_dim, q_len, kv_len, scale, shift, left,
                                right, slope, table, stn, Buckets, span, cap, KDesc, VDesc, b,
                                hk, True, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                                PREC, UPCAST, TMA, AHEAD)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, k_base, v_base, sks, skd, svs, svd,
                                full_lo, full_hi, head_dim, q_len, kv_len, scale, shift, left,
                                right, slope, table, stn, Buckets, span, cap, KDesc, VDesc, b,
                                hk, False, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                                PREC, UPCAST, TMA, AHEAD)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, k_base, v_base, sks, skd, svs, svd,
                                full_hi, end, head_dim, q_len, kv_len, scale, shift, left,
                                right, slope, table, stn, Buckets, span, cap, KDesc, VDesc, b,
                                hk, True, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                                PREC, UPCAST, TMA, AHEAD)
    alive = l_i > 0.0
    lse = tl.where(alive, (m_i + tl.log2(tl.where(alive, l_i, 1.0))) * LN2, float("-inf"))
    out = acc / tl.where(alive, l_i, 1.0)[:, None]
    o_ptrs = (Out + b64 * sob + h64 * soh + rows.to(tl.int64)[:, None] * sol
              + dims[None, :] * sod)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=(rows[:, None] < q_len) & (dims[None, :] < head_dim))
    tl.store(Lse + bh.to(tl.int64) * q_len + rows, lse, mask=rows < q_len)
# fmt: on
