"""Attention over paged keys in Triton: a paged-decode (and small-prefill) kernel, with a
split-K (flash-decoding) variant for long contexts, on the layout of
mhsa.core.kernels.paged:

    q            (N, H, T, D): T new queries per sequence
    k_pool       (num_blocks, block_size, H_kv, D), v_pool (..., H_kv, D_v)
    block_table  (N, max_blocks) int64: sequence n's key j is row j % block_size of
                 block block_table[n, j // block_size]
    lengths      N ints: query t of sequence n sits at lengths[n] - T + t and sees the
                 keys <= it (causal, bottom-right per sequence), and >= it - window
                 with a window

One program serves a sequence, a kv head and a block of rows, and optionally a
partition of the keys (split-K). Its rows are the G = H / H_kv query heads of the kv
head times the T queries (row m is query m // G of head h * G + m % G), so each page
of K and V is read once per kv head, whatever G. Keys are gathered BLOCK_N at a time
through the block table (any block_size); slots past a sequence's keys are never
read. ALiBi, RelativeBias and Softcap are evaluated per tile at the sequence's own
positions (.scores). Scores and softmax statistics are float32 (float64 for float64
inputs, under the interpreter); a row with no allowed key gets 0.

Split-K (flash-decoding): on CUDA the keys are cut into partitions of SPLIT_KEYS keys
at fixed positions (0, SPLIT_KEYS, ...), computed by programs of their own, so a long
context gives many programs however few the sequences; each writes its normalised
partial output and logsumexp, and _merge_splits combines a row's partitions in one
launch by the logsumexp merge of mhsa.core.kernels.merge (the same formula: lse = log
sum exp lse_r, out = sum exp(lse_r - lse) out_r; tested equal to merge_partials).
Because the partitions and the key tiles sit at fixed positions, and a partition or
tile a row cannot see changes nothing (weight exactly 0), a row's result does not
depend on the other sequences of the call: alone or batched, the same bits. It can
differ in the last bits between a decoding step and the same position in a prefill
(other row blocks, other tile shapes in the matrix units). Inference only: no backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...checks import int_at_least
from ..dense import stats_dtype
from ..paged import PagedCall
from .attention import _dot, _exp_from
from .checks import DTYPES, MAX_HEAD_DIM, interpreting
from .scores import _score_fn, kernel_score

MAX_ROWS = 64  # rows (G * T) per program: more rows make more programs along axis 1
SPLIT_KEYS = 256  # keys per partition of split-K on CUDA (fixed: see the module docstring)
MERGE_BLOCK = 16  # partitions per step of the merge


# Triton takes no structs: the kernels keep dense argument lists, which the formatter
# would spread one per line.
# fmt: off
@triton.jit
def _paged_fwd(
    Q, K, V, Table, Lens, Out, Lse, Slopes, ScoreTable, Buckets,
    sqn, sqh, sqt, sqd, skb, sks, skh, skd, svb, svs, svh, svd, stn_table,
    son, soh, sot, sos, sod, sln, slh, slt, sls,
    stn, sth, span, cap, num_heads, group, q_len, head_dim, value_dim, block_size,
    scale, window, split_keys, m_blocks,
    HAS_WINDOW: tl.constexpr, ALIBI: tl.constexpr, RELATIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    """Grid (N, H_kv * m_blocks, splits): the rows of block mb of kv head h of sequence
    n over the keys of partition s (split_keys of them, a multiple of BLOCK_N): out
    normalised over those keys at Out[n, head, t, s] and their logsumexp at Lse[n, head,
    t, s] (-inf for a row that sees none of them)."""
    n, hb, s_id = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h, mb = hb // m_blocks, hb % m_blocks
    n64, h64 = n.to(tl.int64), h.to(tl.int64)
    length = tl.load(Lens + n)
    shift = length - q_len  # query t sits at t + shift
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < group * q_len
    t = m // group
    head = (h * group + m % group).to(tl.int64)
    q_pos = t + shift
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    t64 = t.to(tl.int64)
    q_ptrs = Q + n64 * sqn + head[:, None] * sqh + t64[:, None] * sqt + dims[None, :] * sqd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (dims[None, :] < head_dim), other=0.0)
    slope = 0.0
    if ALIBI != 0:
        slope = tl.load(Slopes + head, mask=row_ok, other=0.0).to(ACC)[:, None]
    table = ScoreTable + head[:, None] * sth
    # the keys this block's rows can see, within this partition
    t_first = (mb * BLOCK_M) // group
    t_last = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)
    hi = tl.minimum(length, t_last + shift + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(t_first + shift - window, 0)
    start = tl.maximum(lo, s_id * split_keys) // BLOCK_N * BLOCK_N
    end = tl.minimum(hi, s_id * split_keys + split_keys)
    table_row = Table + n64 * stn_table
    k_head, v_head = K + h64 * skh, V + h64 * svh
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    for k0 in range(start, end, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        inside = cols < end
        page = tl.load(table_row + cols // block_size, mask=inside, other=0).to(tl.int64)
        slot = (cols % block_size).to(tl.int64)
        k_rows = k_head + page * skb + slot * sks
        k = tl.load(k_rows[:, None] + dims[None, :] * skd,
                    mask=inside[:, None] & (dims[None, :] < head_dim), other=0.0)
        v_rows = v_head + page * svb + slot * svs
        v = tl.load(v_rows[:, None] + vdims[None, :] * svd,
                    mask=inside[:, None] & (vdims[None, :] < value_dim), other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST, ACC) * scale
        offset = cols[None, :] - q_pos[:, None]  # j - p, as .scores reads positions
        s, _ = _score_fn(s, offset, slope, table, stn, Buckets, span, cap,
                         ALIBI, RELATIVE, SOFTCAP, ACC)
        allowed = row_ok[:, None] & inside[None, :] & (cols[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (cols[None, :] >= q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
        p = _exp_from(s, m_safe[:, None])
        alpha = _exp_from(m_i, m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST, ACC)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_ptrs = (Out + n64 * son + head[:, None] * soh + t64[:, None] * sot + s_id * sos
              + vdims[None, :] * sod)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (vdims[None, :] < value_dim))
    tl.store(Lse + n64 * sln + head * slh + t64 * slt + s_id * sls, lse, mask=row_ok)


@triton.jit
def _merge_splits(
    Part, Lse, Out, splits, value_dim, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Grid (N * H * T,): row r's partitions Part (rows, splits, D_v) with Lse (rows,
    splits) merged into Out (rows, D_v) by mhsa.core.kernels.merge's formula, BLOCK_S
    partitions at a time: their max lse, then the sum of the weights, then the output."""
    r = tl.program_id(0).to(tl.int64)
    vdims = tl.arange(0, BLOCK_DV)
    tops = tl.full([BLOCK_S], float("-inf"), Lse.dtype.element_ty)
    for s0 in range(0, splits, BLOCK_S):
        parts = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(Lse + r * splits + parts, mask=parts < splits, other=float("-inf"))
        tops = tl.maximum(tops, lse)
    top = tl.max(tops, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no key in any partition
    totals = tl.zeros([BLOCK_S], Lse.dtype.element_ty)
    for s0 in range(0, splits, BLOCK_S):
        parts = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(Lse + r * splits + parts, mask=parts < splits, other=float("-inf"))
        totals += tl.exp(lse - top)
    total = tl.sum(totals, 0)
    total = tl.where(total > 0, total, 1.0)
    out = tl.zeros([BLOCK_DV], Lse.dtype.element_ty)
    for s0 in range(0, splits, BLOCK_S):
        parts = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(Lse + r * splits + parts, mask=parts < splits, other=float("-inf"))
        weights = tl.exp(lse - top) / total
        mask = (parts[:, None] < splits) & (vdims[None, :] < value_dim)
        ptrs = Part + (r * splits + parts[:, None]) * value_dim + vdims[None, :]
        out += tl.sum(weights[:, None] * tl.load(ptrs, mask=mask, other=0.0), 0)
    tl.store(Out + r * value_dim + vdims, out.to(Out.dtype.element_ty), mask=vdims < value_dim)
# fmt: on


class PagedLaunch(NamedTuple):
    """What every call like one call of a decoding step launches with (made once per
    step by prepare_paged_launch; it reads no block id and no key): the lengths on the
    device, the row blocks, the key partitions, and the launch config."""

    lens: Tensor  # (N,) int32 on q's device
    block_m: int
    m_blocks: int  # row blocks per kv head: ceil(G * T / block_m)
    block_n: int
    splits: int  # key partitions per sequence (1: no split)
    split_keys: int  # keys per partition, a multiple of block_n
    num_warps: int
    num_stages: int


def prepare_paged_launch(call: PagedCall, split_keys: int | None = None) -> PagedLaunch:
    """The launch of calls like `call` (its shapes and lengths): the lengths on the
    device and the grid. split_keys: keys per partition (rounded up to a multiple of
    the key block); None: SPLIT_KEYS, or one partition off CUDA (the interpreter)."""
    q, lengths = call.q, list(call.lengths)
    num_heads, q_len = q.shape[1:3]
    rows = num_heads // call.k_pool.shape[2] * q_len
    block_m = min(MAX_ROWS, max(16, triton.next_power_of_2(rows)))
    block_n = 16 if interpreting() else 64
    longest = max(lengths, default=0)
    if split_keys is None:
        split_keys = SPLIT_KEYS if q.device.type == "cuda" else max(longest, 1)
    int_at_least("split_keys", split_keys, 1)
    split_keys = triton.cdiv(split_keys, block_n) * block_n
    splits = max(1, triton.cdiv(longest, split_keys))
    lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    warps = 8 if max(q.shape[3], call.v_pool.shape[3]) > 128 else 4
    return PagedLaunch(
        lens, block_m, triton.cdiv(rows, block_m), block_n, splits, split_keys, warps, 2
    )


def check_paged_call(call: PagedCall) -> None:
    """Raise TypeError/ValueError for what the kernel cannot take, saying what to do."""
    q, k_pool, v_pool = call.q, call.k_pool, call.v_pool
    dtypes = DTYPES + ((torch.float64,) if interpreting() else ())
    if q.dtype not in dtypes or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(
            f"the triton paged kernel takes float32, float16 or bfloat16 q and pools of one "
            f"dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}; use backend='flash'"
        )
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"q is on {q.device}: the triton paged kernel needs a CUDA device (or "
            "TRITON_INTERPRET=1 set before importing triton, slow, for tests)"
        )
    if max(q.shape[3], v_pool.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(
            f"head dims up to {MAX_HEAD_DIM}, got D={q.shape[3]}, D_v={v_pool.shape[3]}; "
            "use backend='flash'"
        )
    if call.block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must be int32 or int64, got {call.block_table.dtype}")


def triton_paged_attention(
    call: PagedCall, launch: PagedLaunch | None = None, *, split_keys: int | None = None
) -> Tensor:
    """(N, H, T, D_v) in q's dtype: attention of call.q over its paged keys (the module
    docstring's layout), the block table's entries that hold keys valid block ids.
    launch: prepare_paged_launch of a call like this one (a decoding step's), or None
    (made here, with split_keys keys per partition: see prepare_paged_launch)."""
    check_paged_call(call)
    q, k_pool, v_pool, table = call.q, call.k_pool, call.v_pool, call.block_table
    if launch is None:
        launch = prepare_paged_launch(call, split_keys)
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, value_dim = k_pool.shape[2], v_pool.shape[3]
    out = q.new_empty(batch, num_heads, q_len, value_dim)
    if out.numel() == 0:
        return out
    acc = stats_dtype(q.dtype)
    split = launch.splits > 1
    part = out
    if split:  # (N, H, T, splits, D_v) partial outputs, float32
        part = q.new_empty(batch, num_heads, q_len, launch.splits, value_dim, dtype=acc)
    lse = q.new_empty(batch, num_heads, q_len, launch.splits, dtype=acc)
    out_strides = part.stride() if split else (*out.stride()[:3], 0, out.stride(3))
    ks, slopes, bias_table = kernel_score(call.score)
    slopes, bias_table, buckets, _, stn, sth, span, cap = ks.args(slopes, bias_table, None, q)
    prec = None
    if q.dtype == torch.float32:
        prec = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    tensors = (q, k_pool, v_pool, table, launch.lens, part, lse, slopes, bias_table, buckets)
    strides = (*q.stride(), *k_pool.stride(), *v_pool.stride(), table.stride(0))
    strides += (*out_strides, *lse.stride())
    group = num_heads // num_kv_heads
    sizes = (stn, sth, span, cap, num_heads, group, q_len, head_dim, value_dim, k_pool.shape[1])
    sizes += (call.scale, call.window or 0, launch.split_keys, launch.m_blocks)
    constants = {
        "HAS_WINDOW": call.window is not None,
        **ks.constants(q),
        "BLOCK_M": launch.block_m,
        "BLOCK_N": launch.block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(value_dim)),
        "PREC": prec,
        "UPCAST": interpreting() and q.dtype == torch.bfloat16,
        "ACC": tl.float64 if acc == torch.float64 else tl.float32,
    }
    grid = (batch, num_kv_heads * launch.m_blocks, launch.splits)
    _paged_fwd[grid](
        *tensors,
        *strides,
        *sizes,
        **constants,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if split:
        # (a fixed BLOCK_S: the sums' order is the same for any number of partitions)
        block_dv = triton.next_power_of_2(value_dim)
        merge = _merge_splits[(batch * num_heads * q_len,)]
        merge(part, lse, out, launch.splits, value_dim, BLOCK_S=MERGE_BLOCK, BLOCK_DV=block_dv)
    return out
