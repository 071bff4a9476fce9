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
their probabilities recompute as exactly 0.
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
def _query_blocks(c0, c1, shift, left, right, q_len, kv_len, BLOCK_M: tl.constexpr):
    """Query blocks that see keys c0..c1, as _band_blocks: (first, first unmasked, end
    of unmasked, end)."""
    i_lo = tl.maximum(c0 - shift - right, 0)
    i_hi = tl.minimum(c1 - shift + left + 1, q_len)  # one past the last row seeing them
    first = i_lo // BLOCK_M
    end = tl.maximum(tl.cdiv(i_hi, BLOCK_M), first)
    full_lo = tl.cdiv(tl.maximum(c1 - shift - right, 0), BLOCK_M)
    full_hi = tl.maximum(c0 - shift + left + 1, 0) // BLOCK_M
    full_hi = tl.where(c1 < kv_len, full_hi, 0)  # past S: every tile needs the mask
    full_lo = tl.minimum(tl.maximum(full_lo, first), end)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return first, full_lo, full_hi, end


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
    dims = tl.arange(0, BLOCK_D)
    if TMA:
        k = k_desc.load([b, hk, block * BLOCK_N, 0]).reshape([BLOCK_N, BLOCK_D])
        v = v_desc.load([b, hk, block * BLOCK_N, 0]).reshape([BLOCK_N, BLOCK_D])
    else:
        k = _tile(k_base, cols, kv_len, sks, dims, head_dim, skd, MASKED or not EVEN_D)
        v = _tile(v_base, cols, kv_len, svs, dims, head_dim, svd, MASKED or not EVEN_D)
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
                TMA: tl.constexpr):
    """The online softmax over key blocks lo..hi-1; MASKED applies the band. Without a
    score function the row max is taken over the raw products and then scaled: for
    scale > 0 rounding keeps their order, so the max is that of the scaled scores, bit
    for bit, and each score is scaled once, in exp2's multiply-add."""
    unit = _unit(scale, ALIBI, RELATIVE, SOFTCAP)
    for block in range(lo, hi):
        k, v, s, _, allowed = _key_block(q, rows, block, k_base, v_base, sks, skd, svs, svd,
                                         head_dim, kv_len, scale, shift, left, right, slope,
                                         table, stn, Buckets, span, cap, k_desc, v_desc, b, hk,
                                         MASKED, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D,
                                         EVEN_D, PREC, UPCAST, TMA, True)
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
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _band_fwd(
    Q, K, V, Out, Lse, sqb, sqh, sql, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sob, soh, sol, sod, num_heads, group, q_len, kv_len, head_dim, scale, shift, left, right,
    Slopes, Table, Buckets, Sinks, stn, sth, span, cap, KDesc, VDesc,
    ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    """Grid (query blocks, B * H): out (B, H, L, D) and lse (B, H, L) float32 of one
    query block. With HAS_SINKS each row starts at max = its sink and sum = 1. With TMA,
    keys and values are read through the tensor descriptors KDesc, VDesc (else None)."""
    qi, bh = tl.program_id(0), tl.program_id(1)
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
                                PREC, UPCAST, TMA)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, k_base, v_base, sks, skd, svs, svd,
                                full_lo, full_hi, head_dim, q_len, kv_len, scale, shift, left,
                                right, slope, table, stn, Buckets, span, cap, KDesc, VDesc, b,
                                hk, False, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                                PREC, UPCAST, TMA)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, rows, k_base, v_base, sks, skd, svs, svd,
                                full_hi, end, head_dim, q_len, kv_len, scale, shift, left,
                                right, slope, table, stn, Buckets, span, cap, KDesc, VDesc, b,
                                hk, True, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D, EVEN_D,
                                PREC, UPCAST, TMA)
    alive = l_i > 0.0
    lse = tl.where(alive, (m_i + tl.log2(tl.where(alive, l_i, 1.0))) * LN2, float("-inf"))
    out = acc / tl.where(alive, l_i, 1.0)[:, None]
    o_ptrs = (Out + b64 * sob + h64 * soh + rows.to(tl.int64)[:, None] * sol
              + dims[None, :] * sod)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=(rows[:, None] < q_len) & (dims[None, :] < head_dim))
    tl.store(Lse + bh.to(tl.int64) * q_len + rows, lse, mask=rows < q_len)


@triton.jit
def _lse2(Lse, row0, rows, q_len):
    """Base-2 lse of rows (row0: this head's first entry), +inf for padding rows and
    rows with no allowed key, so their probabilities recompute as 0."""
    lse = tl.load(Lse + row0 + rows, mask=rows < q_len, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, rows, k_base, v_base, sks, skd, svs, svd, lo, hi,
               head_dim, kv_len, scale, shift, left, right, slope, table, stn, Buckets, span,
               cap, MASKED: tl.constexpr, ALIBI: tl.constexpr, RELATIVE: tl.constexpr,
               SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               EVEN_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """dq (unscaled) summed over key blocks lo..hi-1; MASKED applies the band."""
    for block in range(lo, hi):
        k, v, s, t, allowed = _key_block(q, rows, block, k_base, v_base, sks, skd, svs, svd,
                                         head_dim, kv_len, scale, shift, left, right, slope,
                                         table, stn, Buckets, span, cap, None, None, 0, 0,
                                         MASKED, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D,
                                         EVEN_D, PREC, UPCAST, False)
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            p = tl.where(allowed, p, 0.0)
        dp = _dot(do, tl.trans(v), PREC, UPCAST, tl.float32)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += _dot(ds.to(k.dtype), k, PREC, UPCAST, tl.float32)
    return dq


@triton.jit
def _band_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, sqb, sqh, sql, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
    sdb, sdh, sdl, sdd, num_heads, group, q_len, kv_len, head_dim, scale, shift, left, right,
    Slopes, Table, Buckets, stn, sth, span, cap,
    ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid (query blocks, B * H): dQ of one query block into DQ (B, H, L, D),
    contiguous, in q's dtype."""
    qi, bh = tl.program_id(0), tl.program_id(1)
    b64, h64, hk64 = _program_heads(bh, num_heads, group)
    slope, table, _ = _head_score(Slopes, Table, Slopes, h64, sth, ALIBI, False, tl.float32)
    rows = qi * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _tile(Q + b64 * sqb + h64 * sqh, rows, q_len, sql, dims, head_dim, sqd, True)
    do = _tile(DO + b64 * sdb + h64 * sdh, rows, q_len, sdl, dims, head_dim, sdd, True)
    row0 = bh.to(tl.int64) * q_len
    lse2 = _lse2(Lse, row0, rows, q_len)
    delta = tl.load(Delta + row0 + rows, mask=rows < q_len, other=0.0)
    k_base, v_base = K + b64 * skb + hk64 * skh, V + b64 * svb + hk64 * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first, full_lo, full_hi, end = _band_blocks(qi * BLOCK_M, qi * BLOCK_M + BLOCK_M - 1,
                                                shift, left, right, kv_len, BLOCK_N)
    dq = _dq_blocks(dq, q, do, lse2, delta, rows, k_base, v_base, sks, skd, svs, svd, first,
                    full_lo, head_dim, kv_len, scale, shift, left, right, slope, table, stn,
                    Buckets, span, cap, True, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D,
                    EVEN_D, PREC, UPCAST)
    dq = _dq_blocks(dq, q, do, lse2, delta, rows, k_base, v_base, sks, skd, svs, svd, full_lo,
                    full_hi, head_dim, kv_len, scale, shift, left, right, slope, table, stn,
                    Buckets, span, cap, False, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D,
                    EVEN_D, PREC, UPCAST)
    dq = _dq_blocks(dq, q, do, lse2, delta, rows, k_base, v_base, sks, skd, svs, svd, full_hi,
                    end, head_dim, kv_len, scale, shift, left, right, slope, table, stn,
                    Buckets, span, cap, True, ALIBI, RELATIVE, SOFTCAP, BLOCK_N, BLOCK_D,
                    EVEN_D, PREC, UPCAST)
    offs = (row0 + rows.to(tl.int64))[:, None] * head_dim + dims[None, :]
    tl.store(DQ + offs, (dq * scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < q_len) & (dims[None, :] < head_dim))


@triton.jit
def _dkv_blocks(dk, dv, k, v, cols, q_base, do_base, sql, sqd, sdl, sdd, Lse, Delta, DQ, row0,
                lo, hi, head_dim, q_len, kv_len, scale, shift, left, right, slope, table, stn,
                Buckets, span, cap, MASKED: tl.constexpr, ALIBI: tl.constexpr,
                RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr,
                PREC: tl.constexpr, UPCAST: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """dk (unscaled) and dv of key block cols summed over query blocks lo..hi-1 of one
    query head. The tiles are transposed (keys by rows: sT, pT, dsT), so that dV and
    dK are products of them without a transpose of a result. With DQ_ATOMIC each query
    block's share of dq (scaled) is also added to the float32 DQ (B, H, L, D) with
    atomics: 5 products a tile where the dQ kernel's recomputation makes 7, in an order
    that varies from run to run."""
    dims = tl.arange(0, BLOCK_D)
    for block in range(lo, hi):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _tile(q_base, rows, q_len, sql, dims, head_dim, sqd,
                  MASKED or not (EVEN_M and EVEN_D))
        do = _tile(do_base, rows, q_len, sdl, dims, head_dim, sdd,
                   MASKED or not (EVEN_M and EVEN_D))
        lse2 = _lse2(Lse, row0, rows, q_len)
        delta = tl.load(Delta + row0 + rows, mask=rows < q_len, other=0.0)
        qk_t = _dot(k, tl.trans(q), PREC, UPCAST, tl.float32)
        offset_t = cols[:, None] - (rows + shift)[None, :]
        score_offset = offset_t
        if ALIBI and not RELATIVE:
            queries = _float_positions(block * BLOCK_M + shift, BLOCK_M)
            score_offset = cols.to(tl.float32)[:, None] - queries[None, :]
        s_t, t_t = _scores2(qk_t, score_offset, scale, slope, table, stn, Buckets, span, cap,
                            ALIBI, RELATIVE, SOFTCAP)
        p_t = tl.exp2(s_t - lse2[None, :])
        if MASKED:
            p_t = tl.where(_allowed(offset_t, cols[:, None] < kv_len, left, right), p_t, 0.0)
        dv += _dot(p_t.to(do.dtype), do, PREC, UPCAST, tl.float32)
        dp_t = _dot(v, tl.trans(do), PREC, UPCAST, tl.float32)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        ds_t = ds_t.to(q.dtype)
        dk += _dot(ds_t, q, PREC, UPCAST, tl.float32)
        if DQ_ATOMIC:
            dq = _dot(tl.trans(ds_t), k, PREC, UPCAST, tl.float32) * scale
            dq_ptrs = DQ + (row0 + rows.to(tl.int64))[:, None] * head_dim + dims[None, :]
            inside = (rows[:, None] < q_len) & (dims[None, :] < head_dim)
            tl.atomic_add(dq_ptrs, dq, mask=inside, sem="relaxed")
    return dk, dv


@triton.jit
def _band_bwd_dkv(
    Q, K, V, DO, Lse, Delta, DK, DV, DQ, sqb, sqh, sql, sqd, skb, skh, sks, skd, svb, svh, svs,
    svd, sdb, sdh, sdl, sdd, num_heads, num_kv_heads, group, q_len, kv_len, head_dim, scale,
    shift, left, right, Slopes, Table, Buckets, stn, sth, span, cap,
    ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, PER_HEAD: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
):
    """Grid (key blocks, B * H_kv): dK, dV (B, H_kv, S, D) of one key block, contiguous,
    in DK's dtype, summed over the query heads of its group: no atomics. With PER_HEAD
    the grid is (key blocks, B * H) and each program writes one query head's share into
    DK, DV (B, H, S, D), for the caller to sum over each group (more programs where
    B * H_kv is small). With DQ_ATOMIC the programs also add dQ into DQ (B, H, L, D)
    float32 (see _dkv_blocks; else DQ is None and the dQ kernel makes it)."""
    kj, bhk = tl.program_id(0), tl.program_id(1)
    if PER_HEAD:  # bhk runs over B * H: one query head h of kv head h // group
        b, h = bhk // num_heads, bhk % num_heads
        hk, g_lo, g_hi = h // group, h % group, h % group + 1
    else:
        b, hk = bhk // num_kv_heads, bhk % num_kv_heads
        g_lo, g_hi = 0, group
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)
    cols = kj * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = _tile(K + b64 * skb + hk64 * skh, cols, kv_len, sks, dims, head_dim, skd, True)
    v = _tile(V + b64 * svb + hk64 * svh, cols, kv_len, svs, dims, head_dim, svd, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first, full_lo, full_hi, end = _query_blocks(kj * BLOCK_N, kj * BLOCK_N + BLOCK_N - 1,
                                                 shift, left, right, q_len, kv_len, BLOCK_M)
    for g in range(g_lo, g_hi):
        h64 = hk64 * group + g
        slope, table, _ = _head_score(Slopes, Table, Slopes, h64, sth, ALIBI, False, tl.float32)
        q_base, do_base = Q + b64 * sqb + h64 * sqh, DO + b64 * sdb + h64 * sdh
        row0 = (b64 * num_heads + h64) * q_len
        dk, dv = _dkv_blocks(dk, dv, k, v, cols, q_base, do_base, sql, sqd, sdl, sdd, Lse, Delta,
                             DQ, row0, first, full_lo, head_dim, q_len, kv_len, scale, shift,
                             left, right, slope, table, stn, Buckets, span, cap, True, ALIBI,
                             RELATIVE, SOFTCAP, BLOCK_M, BLOCK_D, EVEN_M, EVEN_D, PREC, UPCAST,
                             DQ_ATOMIC)
        dk, dv = _dkv_blocks(dk, dv, k, v, cols, q_base, do_base, sql, sqd, sdl, sdd, Lse, Delta,
                             DQ, row0, full_lo, full_hi, head_dim, q_len, kv_len, scale, shift,
                             left, right, slope, table, stn, Buckets, span, cap, False, ALIBI,
                             RELATIVE, SOFTCAP, BLOCK_M, BLOCK_D, EVEN_M, EVEN_D, PREC, UPCAST,
                             DQ_ATOMIC)
        dk, dv = _dkv_blocks(dk, dv, k, v, cols, q_base, do_base, sql, sqd, sdl, sdd, Lse, Delta,
                             DQ, row0, full_hi, end, head_dim, q_len, kv_len, scale, shift,
                             left, right, slope, table, stn, Buckets, span, cap, True, ALIBI,
                             RELATIVE, SOFTCAP, BLOCK_M, BLOCK_D, EVEN_M, EVEN_D, PREC, UPCAST,
                             DQ_ATOMIC)
    key = (bhk.to(tl.int64) * kv_len + cols.to(tl.int64))[:, None] * head_dim + dims[None, :]
    inside = (cols[:, None] < kv_len) & (dims[None, :] < head_dim)
    tl.store(DK + key, (dk * scale).to(DK.dtype.element_ty), mask=inside)
    tl.store(DV + key, dv.to(DV.dtype.element_ty), mask=inside)
# fmt: on
