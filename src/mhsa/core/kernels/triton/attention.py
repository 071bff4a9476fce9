"""The Triton kernels: tiled online-softmax attention over a block plan.

Every kernel walks a tile list made from mhsa.core.kernels.plan (see function.py):
for each query block (forward, dQ, probabilities) the key blocks it visits, or for
each key block (dK/dV) the query blocks that visit it, each with its kind:
    FULL (2)     no mask is applied (only the bounds of the last block);
    PARTIAL (1)  the causal condition (bottom-right, computed from indices) and the
                 call's mask: MASK_MODE 1 reads a bool tensor broadcast to
                 (B, H, L, S) through its strides, MASK_MODE 2 reads the tile's own
                 (BLOCK_M, BLOCK_N) slice of a compact buffer of partial tiles.
EMPTY tiles are not in the lists, so they are never visited. A score function
(ALIBI, RELATIVE, SOFTCAP) is applied to each tile's scaled scores before the bias and
the mask, and sinks start each row's softmax (see scores.py).

Conventions: scores, softmax statistics and gradients accumulate in ACC, float32
(float64 for float64 inputs, under the interpreter, for gradcheck); a row with no allowed key
has lse -inf (its probabilities are recomputed as exp(s - inf) = 0); dropout keeps
entry (b, h, row, col) where a counter-based hash of (seed, b * H + h, row, col)
clears the threshold, the same hash as mhsa.core.kernels.dropout.keep_mask.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .scores import _head_score, _score_fn, _score_grad, key_offsets

LOG2E = tl.constexpr(1.4426950408889634)
BIAS_FLOOR = tl.constexpr(-1e38)  # (times LOG2E still a finite float32)


@triton.jit
def _exp_from(s, m):
    """exp(s - m) as exp2(s * log2(e) - m * log2(e)): a multiply-add and the GPU's
    flush-to-zero exp2 per entry, where tl.exp wraps its exp2 in a fix-up for results
    below 2**-126 (nothing, as a probability) that costs four more instructions."""
    return tl.exp2(s * LOG2E - m * LOG2E)


@triton.jit
def _mix32(x):
    """The invertible 32-bit hash of mhsa.core.kernels.dropout._mix32, on uint32."""
    x = (x ^ (x >> 16)) * 0x45D9F3B
    x = (x ^ (x >> 16)) * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _keep(seed, bh, rows, cols, threshold):
    """(BLOCK_M, BLOCK_N) bool: entries of head bh (= b * H + h) kept by dropout."""
    # tl.cast: an int argument equal to 1 arrives as a constexpr
    head = _mix32(bh.to(tl.uint32) + tl.cast(seed, tl.uint32))
    row = _mix32(head ^ rows.to(tl.uint32))
    return _mix32(row[:, None] ^ cols.to(tl.uint32)[None, :]) >= tl.cast(threshold, tl.uint32)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """a @ b accumulated in ACC (float32; float64 for float64 inputs); UPCAST (bfloat16
    under the interpreter, whose dot cannot take it) multiplies the same values in
    float32."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b, input_precision=PREC, out_dtype=ACC)
    return out


@triton.jit
def _program_heads(bh, num_heads, group):
    """(batch, query head, kv head) of a program over B * H, as int64: pointer offsets
    of a head can pass 2**31."""
    b, h = bh // num_heads, bh % num_heads
    return b.to(tl.int64), h.to(tl.int64), (h // group).to(tl.int64)


@triton.jit
def _load_2d(base, idx, limit, stride, dims, dim, stride_d):
    """The tile base[idx, dims] for rows idx < limit and columns dims < dim, 0 elsewhere."""
    ptrs = base + idx.to(tl.int64)[:, None] * stride + dims[None, :] * stride_d
    return tl.load(ptrs, mask=(idx[:, None] < limit) & (dims[None, :] < dim), other=0.0)


@triton.jit
def _load_lse(Lse, bh, rows, q_len):
    """lse of the rows, +inf for rows with no allowed key and padding rows: exp(s - lse)
    then recomputes their probabilities as exactly 0."""
    lse = tl.load(Lse + bh.to(tl.int64) * q_len + rows, mask=rows < q_len, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _entry(e, blk_idx, blk_kind, blk_tile, BLOCK: tl.constexpr):
    """Entry e of a tile list: (the BLOCK indices of its block, kind, compact tile index)."""
    block, kind, tile = tl.load(blk_idx + e), tl.load(blk_kind + e), tl.load(blk_tile + e)
    return block * BLOCK + tl.arange(0, BLOCK), kind, tile


@triton.jit
def _head_slices(Bias, Mask, Tiles, b64, h64, sbb, sbh, smb, smh, stb):
    """Pointers to head (b64, h64)'s (L, S) slices of the bias and the mask, and to its
    batch's compact partial-tile buffer."""
    return Bias + b64 * sbb + h64 * sbh, Mask + b64 * smb + h64 * smh, Tiles + b64 * stb


# Triton takes no structs: kernels and their helpers keep dense argument lists, which
# the formatter would spread one per line.
# fmt: off
@triton.jit
def _scores(
    q, k, rows, cols, kind, tile, bias, sbl, sbs, mask, sml, sms, tiles,
    scale, q_len, kv_len, shift, slope, table, stn, Buckets, span, cap,
    HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr, CAUSAL: tl.constexpr,
    ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    ACC: tl.constexpr, EVEN: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) ACC scores score_fn(q k^T * scale) + bias, -inf where not
    allowed, and the softcap's tanh for the backward (see scores._score_fn). EVEN: L and
    S are multiples of the tiles, so no tile reaches past them.

    bias and mask point at this (batch, head)'s (L, S) slice (row/column strides sbl,
    sbs and sml, sms); tiles at this batch's compact partial-tile buffer; slope, table
    (with bucket stride stn), Buckets, span and cap are the score function's.
    """
    s = _dot(q, tl.trans(k), PREC, UPCAST, ACC) * scale
    s, t = _score_fn(s, key_offsets(rows, cols, shift), slope, table, stn, Buckets, span, cap,
                     ALIBI, RELATIVE, SOFTCAP, ACC)
    inside = (rows[:, None] < q_len) & (cols[None, :] < kv_len)
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    if HAS_BIAS:
        offs = rows64[:, None] * sbl + cols64[None, :] * sbs
        b = tl.load(bias + offs, mask=inside, other=0.0).to(ACC)
        # transformers' padding, finfo.min, times log2(e) in _exp_from is -inf, and a
        # row's max there made -inf - -inf = nan: finite biases end at BIAS_FLOOR
        s += tl.where((b < BIAS_FLOOR) & (b > float("-inf")), BIAS_FLOOR, b)
    if not EVEN:
        s = tl.where(inside, s, float("-inf"))
    # the branch yields the float scores, not a bool mask: an i1 tensor crossing the
    # branch can need a layout conversion through shared memory, which i1 cannot take
    if kind == 1:  # PARTIAL
        if CAUSAL:
            s = tl.where(cols[None, :] <= rows[:, None] + shift, s, float("-inf"))
        if MASK_MODE == 1:
            offs = rows64[:, None] * sml + cols64[None, :] * sms
            s = tl.where(tl.load(mask + offs, mask=inside, other=0) != 0, s, float("-inf"))
        if MASK_MODE == 2:
            local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            offs = tile.to(tl.int64) * (BLOCK_M * BLOCK_N) + local
            s = tl.where(tl.load(tiles + offs) != 0, s, float("-inf"))
    return s, t


@triton.jit
def _key_tile(
    e, blk_idx, blk_kind, blk_tile, q, rows, k_base, sks, skd, head_dim, v_base, svs, svd,
    value_dim, bias, sbl, sbs, mask, sml, sms, tiles, scale, q_len, kv_len, shift,
    slope, table, stn, Buckets, span, cap,
    HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr, CAUSAL: tl.constexpr,
    ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr, VALUES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr, EVEN: tl.constexpr,
):
    """Entry e of a query block's tile list (the forward, dQ and probability kernels):
    (its key columns, the key tile (BLOCK_N, BLOCK_D), the value tile (BLOCK_N,
    BLOCK_DV) with VALUES (else the key tile again), and s, t of _scores for q's rows)."""
    cols, kind, tile = _entry(e, blk_idx, blk_kind, blk_tile, BLOCK_N)
    k = _load_2d(k_base, cols, kv_len, sks, tl.arange(0, BLOCK_D), head_dim, skd)
    v = k
    if VALUES:  # loaded before the scores are computed, as the pipeliner expects
        v = _load_2d(v_base, cols, kv_len, svs, tl.arange(0, BLOCK_DV), value_dim, svd)
    s, t = _scores(q, k, rows, cols, kind, tile, bias, sbl, sbs, mask, sml, sms, tiles,
                   scale, q_len, kv_len, shift, slope, table, stn, Buckets, span, cap,
                   HAS_BIAS, MASK_MODE, CAUSAL, ALIBI, RELATIVE, SOFTCAP,
                   BLOCK_M, BLOCK_N, PREC, UPCAST, ACC, EVEN)
    return cols, k, v, s, t


@triton.jit
def _softmax_tile(acc, l_i, m_i, s, v, rows, cols, bh, seed, threshold, keep_scale,
                  DROPOUT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                  ACC: tl.constexpr):
    """One tile of the online softmax: scores s (BLOCK_M, BLOCK_N), -inf where not
    allowed, values v (BLOCK_N, BLOCK_DV). Returns acc (BLOCK_M, BLOCK_DV), l_i, m_i
    (BLOCK_M,)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
    p = _exp_from(s, m_safe[:, None])
    alpha = _exp_from(m_i, m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_keep(seed, bh, rows, cols, threshold), p * keep_scale, 0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST, ACC)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse, Bias, Mask, Tiles, row_ptr, blk_idx, blk_kind, blk_tile,
    sqb, sqh, sql, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, soh, sol, sod,
    sbb, sbh, sbl, sbs, smb, smh, sml, sms, stb,
    num_heads, group, q_len, kv_len, head_dim, value_dim, scale, shift,
    seed, threshold, keep_scale, Slopes, Table, Buckets, Sinks, stn, sth, span, cap,
    HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr, CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr, ALIBI: tl.constexpr, RELATIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, ACC: tl.constexpr, EVEN: tl.constexpr, AHEAD: tl.constexpr,
):
    """Grid (query blocks, B * H): out (B, H, L, D_v) and lse (B, H, L) of one block.
    With HAS_SINKS each row starts at max = its head's sink and sum = exp(0) = 1."""
    qi, bh = tl.program_id(0), tl.program_id(1)
    b64, h64, hk64 = _program_heads(bh, num_heads, group)
    slope, table, sink = _head_score(Slopes, Table, Sinks, h64, sth, ALIBI, HAS_SINKS, ACC)
    bias, mask, tiles = _head_slices(Bias, Mask, Tiles, b64, h64, sbb, sbh, smb, smh, stb)
    rows = qi * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = _load_2d(Q + b64 * sqb + h64 * sqh, rows, q_len, sql, dims, head_dim, sqd)
    k_base, v_base = K + b64 * skb + hk64 * skh, V + b64 * svb + hk64 * svh
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    if HAS_SINKS:
        m_i = tl.full([BLOCK_M], 0.0, ACC) + sink
        l_i = tl.full([BLOCK_M], 1.0, ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    lo, hi = tl.load(row_ptr + qi), tl.load(row_ptr + qi + 1)
    # With AHEAD each tile's scores are issued before the previous tile's softmax (as
    # band._fwd_blocks does): ptxas then runs the exp2s while the tensor cores work
    if AHEAD:
        if lo < hi:
            cols, _, v, s, _ = _key_tile(
                lo, blk_idx, blk_kind, blk_tile, q, rows, k_base, sks, skd, head_dim, v_base,
                svs, svd, value_dim, bias, sbl, sbs, mask, sml, sms, tiles, scale, q_len, kv_len,
                shift, slope, table, stn, Buckets, span, cap, HAS_BIAS, MASK_MODE, CAUSAL, ALIBI,
                RELATIVE, SOFTCAP, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PREC, UPCAST, ACC,
                EVEN)
            for e in range(lo + 1, hi):
                cols_next, _, v_next, s_next, _ = _key_tile(
                    e, blk_idx, blk_kind, blk_tile, q, rows, k_base, sks, skd, head_dim, v_base,
                    svs, svd, value_dim, bias, sbl, sbs, mask, sml, sms, tiles, scale, q_len,
                    kv_len, shift, slope, table, stn, Buckets, span, cap, HAS_BIAS, MASK_MODE,
                    CAUSAL, ALIBI, RELATIVE, SOFTCAP, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                    PREC, UPCAST, ACC, EVEN)
                acc, l_i, m_i = _softmax_tile(acc, l_i, m_i, s, v, rows, cols, bh, seed,
                                              threshold, keep_scale, DROPOUT, PREC, UPCAST, ACC)
                cols, v, s = cols_next, v_next, s_next
            acc, l_i, m_i = _softmax_tile(acc, l_i, m_i, s, v, rows, cols, bh, seed, threshold,
                                          keep_scale, DROPOUT, PREC, UPCAST, ACC)
    else:
        for e in range(lo, hi):
            cols, _, v, s, _ = _key_tile(
                e, blk_idx, blk_kind, blk_tile, q, rows, k_base, sks, skd, head_dim, v_base,
                svs, svd, value_dim, bias, sbl, sbs, mask, sml, sms, tiles, scale, q_len, kv_len,
                shift, slope, table, stn, Buckets, span, cap, HAS_BIAS, MASK_MODE, CAUSAL, ALIBI,
                RELATIVE, SOFTCAP, True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PREC, UPCAST, ACC,
                EVEN)
            acc, l_i, m_i = _softmax_tile(acc, l_i, m_i, s, v, rows, cols, bh, seed, threshold,
                                          keep_scale, DROPOUT, PREC, UPCAST, ACC)
    alive = l_i > 0.0
    lse = tl.where(alive, m_i + tl.log(tl.where(alive, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(alive, l_i, 1.0)[:, None]
    o_ptrs = (Out + b64 * sob + h64 * soh + rows.to(tl.int64)[:, None] * sol
              + vdims[None, :] * sod)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=(rows[:, None] < q_len) & (vdims[None, :] < value_dim))
    tl.store(Lse + bh.to(tl.int64) * q_len + rows, lse, mask=rows < q_len)


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, Lse, Delta, DQ, DBias, Bias, Mask, Tiles,
    row_ptr, blk_idx, blk_kind, blk_tile,
    sqb, sqh, sql, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdb, sdh, sdl, sdd,
    sbb, sbh, sbl, sbs, smb, smh, sml, sms, stb,
    num_heads, group, q_len, kv_len, head_dim, value_dim, scale, shift,
    seed, threshold, keep_scale, Slopes, Table, Buckets, Sinks, stn, sth, span, cap,
    DSlope, DTable,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, MASK_MODE: tl.constexpr,
    CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, ALIBI: tl.constexpr, RELATIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, SLOPE_GRAD: tl.constexpr, TABLE_GRAD: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    ACC: tl.constexpr, EVEN: tl.constexpr,
):
    """Grid (query blocks, B * H): dQ (B, H, L, D) of one block, summed in ACC and
    stored in DQ's dtype; with BIAS_GRAD
    also the block's dS tiles into dBias (B, H, L, S) ACC (each entry written once);
    with SLOPE_GRAD / TABLE_GRAD the block's slope gradient and per-bucket table
    gradient sums into DSlope (B * H, query blocks) and DTable (B * H, query blocks,
    BLOCK_NB), ACC, reduced by the caller."""
    qi, bh = tl.program_id(0), tl.program_id(1)
    b64, h64, hk64 = _program_heads(bh, num_heads, group)
    slope, table, _ = _head_score(Slopes, Table, Sinks, h64, sth, ALIBI, False, ACC)
    bias, mask, tiles = _head_slices(Bias, Mask, Tiles, b64, h64, sbb, sbh, smb, smh, stb)
    bh64 = bh.to(tl.int64)
    rows = qi * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    row_ok = rows < q_len
    q = _load_2d(Q + b64 * sqb + h64 * sqh, rows, q_len, sql, dims, head_dim, sqd)
    do = _load_2d(DO + b64 * sdb + h64 * sdh, rows, q_len, sdl, vdims, value_dim, sdd)
    lse = _load_lse(Lse, bh, rows, q_len)
    delta = tl.load(Delta + bh64 * q_len + rows, mask=row_ok, other=0.0)
    k_base, v_base = K + b64 * skb + hk64 * skh, V + b64 * svb + hk64 * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    d_slope = tl.zeros([], ACC)
    d_table = tl.zeros([BLOCK_NB], ACC)
    for e in range(tl.load(row_ptr + qi), tl.load(row_ptr + qi + 1)):
        cols, k, v, s, t = _key_tile(
            e, blk_idx, blk_kind, blk_tile, q, rows, k_base, sks, skd, head_dim, v_base, svs, svd,
            value_dim, bias, sbl, sbs, mask, sml, sms, tiles, scale, q_len, kv_len, shift, slope,
            table, stn, Buckets, span, cap, HAS_BIAS, MASK_MODE, CAUSAL, ALIBI, RELATIVE, SOFTCAP,
            True, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PREC, UPCAST, ACC, EVEN)
        dp = _dot(do, tl.trans(v), PREC, UPCAST, ACC)  # (issued first: it runs beside exp2)
        p = _exp_from(s, lse[:, None])
        if DROPOUT:
            dp = tl.where(_keep(seed, bh, rows, cols, threshold), dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if BIAS_GRAD:
            offs = (bh64 * q_len + rows.to(tl.int64))[:, None] * kv_len + cols[None, :]
            tl.store(DBias + offs, ds, mask=row_ok[:, None] & (cols[None, :] < kv_len))
        offset = key_offsets(rows, cols, shift)
        ds, d_slope, d_table = _score_grad(ds, t, offset, Buckets, span, d_slope, d_table,
                                           ALIBI, RELATIVE, SOFTCAP, SLOPE_GRAD, TABLE_GRAD,
                                           BLOCK_NB, ACC)
        dq += _dot(ds.to(k.dtype), k, PREC, UPCAST, ACC)
    offs = (bh64 * q_len + rows.to(tl.int64))[:, None] * head_dim + dims[None, :]
    tl.store(DQ + offs, (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (dims[None, :] < head_dim))
    partial = bh64 * tl.num_programs(0) + qi
    if SLOPE_GRAD:
        tl.store(DSlope + partial, d_slope)
    if TABLE_GRAD:
        tl.store(DTable + partial * BLOCK_NB + tl.arange(0, BLOCK_NB), d_table)


@triton.jit
def _attn_bwd_dkv(
    Q, K, V, DO, Lse, Delta, DK, DV, Bias, Mask, Tiles,
    col_ptr, blk_idx, blk_kind, blk_tile,
    sqb, sqh, sql, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sdb, sdh, sdl, sdd,
    sbb, sbh, sbl, sbs, smb, smh, sml, sms, stb,
    num_heads, num_kv_heads, group, q_len, kv_len, head_dim, value_dim, scale, shift,
    seed, threshold, keep_scale, Slopes, Table, Buckets, Sinks, stn, sth, span, cap,
    HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr, CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr, ALIBI: tl.constexpr, RELATIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    ACC: tl.constexpr, EVEN: tl.constexpr,
):
    """Grid (key blocks, B * H_kv): dK (B, H_kv, S, D) and dV (B, H_kv, S, D_v) of one
    key block, summed in ACC over the query heads of its group and the query blocks
    that visit it (col_ptr/blk_* list them per key block; no atomics), stored in DK's
    and DV's dtype."""
    kj, bhk = tl.program_id(0), tl.program_id(1)
    b, hk = bhk // num_kv_heads, bhk % num_kv_heads
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)  # offsets of a head can pass 2**31
    cols = kj * BLOCK_N + tl.arange(0, BLOCK_N)
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    col_ok = cols < kv_len
    k = _load_2d(K + b64 * skb + hk64 * skh, cols, kv_len, sks, dims, head_dim, skd)
    v = _load_2d(V + b64 * svb + hk64 * svh, cols, kv_len, svs, vdims, value_dim, svd)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], ACC)
    start, end = tl.load(col_ptr + kj), tl.load(col_ptr + kj + 1)
    for g in range(0, group):
        h = hk * group + g
        bh = b * num_heads + h
        h64 = h.to(tl.int64)
        slope, table, _ = _head_score(Slopes, Table, Sinks, h64, sth, ALIBI, False, ACC)
        bias, mask, tiles = _head_slices(Bias, Mask, Tiles, b64, h64, sbb, sbh, smb, smh, stb)
        q_base, do_base = Q + b64 * sqb + h64 * sqh, DO + b64 * sdb + h64 * sdh
        for e in range(start, end):
            rows, kind, tile = _entry(e, blk_idx, blk_kind, blk_tile, BLOCK_M)
            q = _load_2d(q_base, rows, q_len, sql, dims, head_dim, sqd)
            do = _load_2d(do_base, rows, q_len, sdl, vdims, value_dim, sdd)
            lse = _load_lse(Lse, bh, rows, q_len)
            delta = tl.load(Delta + bh.to(tl.int64) * q_len + rows, mask=rows < q_len, other=0.0)
            s, t = _scores(q, k, rows, cols, kind, tile, bias, sbl, sbs, mask, sml, sms, tiles,
                           scale, q_len, kv_len, shift, slope, table, stn, Buckets, span, cap,
                           HAS_BIAS, MASK_MODE, CAUSAL, ALIBI, RELATIVE, SOFTCAP,
                           BLOCK_M, BLOCK_N, PREC, UPCAST, ACC, EVEN)
            dp = _dot(do, tl.trans(v), PREC, UPCAST, ACC)  # (issued first, as in dQ)
            p = _exp_from(s, lse[:, None])
            if DROPOUT:
                keep = _keep(seed, bh, rows, cols, threshold)
                kept = tl.where(keep, p * keep_scale, 0.0)
                dv += _dot(tl.trans(kept.to(do.dtype)), do, PREC, UPCAST, ACC)
                dp = tl.where(keep, dp * keep_scale, 0.0)
            else:
                dv += _dot(tl.trans(p.to(do.dtype)), do, PREC, UPCAST, ACC)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:  # dS of the scaled scores
                ds = ds * (1.0 - t * t)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, PREC, UPCAST, ACC)
    key = bhk.to(tl.int64) * kv_len + cols.to(tl.int64)
    tl.store(DK + key[:, None] * head_dim + dims[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=col_ok[:, None] & (dims[None, :] < head_dim))
    tl.store(DV + key[:, None] * value_dim + vdims[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None] & (vdims[None, :] < value_dim))


@triton.jit
def _attn_probs(
    Q, K, Lse, P, Bias, Mask, Tiles, row_ptr, blk_idx, blk_kind, blk_tile,
    sqb, sqh, sql, sqd, skb, skh, sks, skd,
    sbb, sbh, sbl, sbs, smb, smh, sml, sms, stb,
    num_heads, group, q_len, kv_len, head_dim, scale, shift,
    Slopes, Table, Buckets, Sinks, stn, sth, span, cap,
    HAS_BIAS: tl.constexpr, MASK_MODE: tl.constexpr, CAUSAL: tl.constexpr,
    ALIBI: tl.constexpr, RELATIVE: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr, EVEN: tl.constexpr,
):
    """Grid (query blocks, B * H): probabilities exp(s - lse) of the visited tiles into
    P (B, H, L, S) ACC (zero-filled by the caller: empty tiles stay 0)."""
    qi, bh = tl.program_id(0), tl.program_id(1)
    b64, h64, hk64 = _program_heads(bh, num_heads, group)
    slope, table, _ = _head_score(Slopes, Table, Sinks, h64, sth, ALIBI, False, ACC)
    bias, mask, tiles = _head_slices(Bias, Mask, Tiles, b64, h64, sbb, sbh, smb, smh, stb)
    rows = qi * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_2d(Q + b64 * sqb + h64 * sqh, rows, q_len, sql, tl.arange(0, BLOCK_D), head_dim, sqd)
    lse = _load_lse(Lse, bh, rows, q_len)
    k_base = K + b64 * skb + hk64 * skh
    for e in range(tl.load(row_ptr + qi), tl.load(row_ptr + qi + 1)):
        cols, k, v, s, t = _key_tile(  # (no values: v is the key tile again)
            e, blk_idx, blk_kind, blk_tile, q, rows, k_base, sks, skd, head_dim, k_base, sks, skd,
            head_dim, bias, sbl, sbs, mask, sml, sms, tiles, scale, q_len, kv_len, shift, slope,
            table, stn, Buckets, span, cap, HAS_BIAS, MASK_MODE, CAUSAL, ALIBI, RELATIVE, SOFTCAP,
            False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_D, PREC, UPCAST, ACC, EVEN)
        offs = (bh.to(tl.int64) * q_len + rows.to(tl.int64))[:, None] * kv_len + cols[None, :]
        tl.store(P + offs, _exp_from(s, lse[:, None]),
                 mask=(rows[:, None] < q_len) & (cols[None, :] < kv_len))
# fmt: on


@triton.jit
def _keep_mask(Out, seed, threshold, q_len, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query blocks, key blocks, B * H): the dropout keep mask (B, H, L, S) bool
    exactly as the attention kernels draw it (for tests against keep_mask on CPU)."""
    qi, kj, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = qi * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kj * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _keep(seed, bh, rows, cols, threshold)
    offs = (bh.to(tl.int64) * q_len + rows.to(tl.int64))[:, None] * kv_len + cols[None, :]
    tl.store(Out + offs, keep, mask=(rows[:, None] < q_len) & (cols[None, :] < kv_len))
