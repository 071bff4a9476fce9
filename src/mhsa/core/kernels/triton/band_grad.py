"""Triton kernels for the band calls' gradients (see .band): dQ per query block, dK and
dV per key block, each over the query (or key) blocks its band reaches, split like the
forward into masked edges and an unmasked middle. Scores are recomputed from the
forward's lse; dK/dV can also add dQ with atomics (band_launch.DQ_IN_DKV).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import LOG2E, _dot, _program_heads
from .band import (
    _allowed,
    _band_blocks,
    _float_positions,
    _key_block,
    _query_block,
    _scores2,
    _tile,
)
from .scores import _head_score


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


# Triton takes no structs: kernels and their helpers keep dense argument lists, which
# the formatter would spread one per line.
# fmt: off
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
    PREC: tl.constexpr, UPCAST: tl.constexpr, LAST_FIRST: tl.constexpr,
):
    """Grid (query blocks, B * H): dQ of one query block into DQ (B, H, L, D),
    contiguous, in q's dtype; LAST_FIRST as the forward's."""
    qi, bh = _query_block(LAST_FIRST), tl.program_id(1)
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
        # (issued before the softmax needs qk_t, dO V^T runs on the tensor cores while
        # the exp2s do)
        dp_t = _dot(v, tl.trans(do), PREC, UPCAST, tl.float32)
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
    in DK's dtype, summed over the query heads of its group (no atomics for them). With PER_HEAD
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
