"""Attention over a paged key/value cache: keys and values live in a pool of
fixed-size blocks, and a block table lists each sequence's blocks in order.

    q            (N, H, T, D): T new queries per sequence
    k_pool       (num_blocks, block_size, H_kv, D), v_pool (..., H_kv, D_v)
    block_table  (N, max_blocks) int64: sequence n's key j is row j % block_size of
                 block block_table[n, j // block_size]
    lengths      N ints: sequence n holds keys 0..lengths[n]-1, and its queries sit at
                 positions lengths[n] - T .. lengths[n] - 1 (causal, bottom-right per
                 sequence); a query at p sees keys <= p, and >= p - window with a window

mhsa.attention(q, k_pool, v_pool, block_table=..., seq_lens=...) validates a call and
dispatches it to a backend's forward_paged, which calls one of these two.
`paged_reference` (the reference backend) gathers every sequence's pages and computes
dense attention (the golden answer, differentiable). `paged_tiled` (flash) gathers one
tile of pages at a time and merges the tiles with an online softmax: it never holds a
sequence's whole cache, and a tile is computed only for the sequences long enough to
reach it (longest first).
Score functions get per-sequence positions: q_pos (N, 1, T, 1), k_pos (1, 1, 1, keys).
Without one, on CPU, each tile runs on PyTorch's fused flash kernel (the query heads of
a group as rows of their kv head, in blocks that make every row's result independent of
the call's other rows: see fused_row_blocks) and the tiles merge by their logsumexp; with one, the
tiles are computed in plain torch. Statistics are float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..masks.causal import causal_allows, causal_shift
from ..scores import ScoreFunction
from .dense import grouped_scores, masked_softmax, probs_times_v, stats_dtype
from .merge import merge_partials

QUERY_CHUNK = 512  # query rows per pass of the tiled loop (bounds a score tile)
TILE_SIZE = 256  # keys per tile of paged_tiled (whole pages), as the flash backend calls it
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
KERNEL_BLOCK_ROWS = 32  # query rows per fused call: one of the kernel's blocks (it splits at 32)
MIN_KERNEL_ROWS = 4  # fewer rows in a kernel block are computed another way (fused_row_blocks)


def gather_pages(pool: Tensor, table: Tensor) -> Tensor:
    """pool (num_blocks, block_size, H_kv, X), table (N, P) -> (N, H_kv, P * block_size, X),
    a view after one index_select."""
    rows = pool.index_select(0, table.reshape(-1))
    return rows.view(table.shape[0], -1, pool.shape[2], pool.shape[3]).transpose(1, 2)


def query_positions(lengths: Tensor, q_len: int) -> Tensor:
    """(N, 1, T, 1) position of each query: lengths[n] - T + row."""
    rows = torch.arange(q_len, device=lengths.device)
    return (rows + causal_shift(q_len, lengths.view(-1, 1))).view(-1, 1, q_len, 1)


def _allowed(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Causal (and windowed) visibility of keys k_pos (1, 1, 1, K) from q_pos."""
    allowed = causal_allows(q_pos, k_pos)
    return allowed if window is None else allowed & (k_pos >= q_pos - window)


def _scored(
    score: ScoreFunction | None, scores: Tensor, batch: Tensor, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    if score is None:
        return scores
    head = torch.arange(scores.shape[1], device=scores.device).view(1, -1, 1, 1)
    out = score(scores, batch.view(-1, 1, 1, 1), head, q_pos, k_pos)
    return out.expand(scores.shape).contiguous()  # (a tile the engine then overwrites)


class PagedCall(NamedTuple):
    """One attention call on paged keys (shapes above): q, k_pool, v_pool, block_table,
    lengths, the scale, and optionally a score function and a window."""

    q: Tensor
    k_pool: Tensor
    v_pool: Tensor
    block_table: Tensor
    lengths: Sequence[int]
    scale: float
    score: ScoreFunction | None = None
    window: int | None = None


def paged_reference(call: PagedCall) -> Tensor:
    """(N, H, T, D_v): every sequence's pages gathered, then dense attention."""
    q, k_pool, v_pool, block_table, lengths, scale, score, window = call
    batch, _, q_len, _ = q.shape
    keys, values = gather_pages(k_pool, block_table), gather_pages(v_pool, block_table)
    dtype = stats_dtype(q.dtype)
    lens = torch.as_tensor(list(lengths), device=q.device)
    q_pos = query_positions(lens, q_len)
    k_pos = torch.arange(keys.shape[2], device=q.device).view(1, 1, 1, -1)
    scores = grouped_scores(q, keys, scale, dtype)
    scores = _scored(score, scores, torch.arange(batch, device=q.device), q_pos, k_pos)
    scores = scores.masked_fill(~_allowed(q_pos, k_pos, window), -torch.inf)
    probs, _ = masked_softmax(scores)
    real = (k_pos < lens.view(-1, 1, 1, 1)).transpose(2, 3)  # (N, 1, S, 1)
    values = values.masked_fill(~real, 0)  # unwritten slots may hold anything
    return probs_times_v(probs, values).to(q.dtype)


def paged_tiled(call: PagedCall, tile_size: int = TILE_SIZE) -> Tensor:
    """(N, H, T, D_v) by an online softmax over tiles of about tile_size keys (whole
    pages), gathered one at a time. Inference only (it updates its state in place)."""
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"tile_size must be an int >= 1, got {tile_size!r}")
    q, lengths = call.q, list(call.lengths)
    order = sorted(range(len(lengths)), key=lambda n: -lengths[n])  # longest first
    if order != sorted(order):
        index = torch.tensor(order, device=q.device)
        ordered = call._replace(
            q=q.index_select(0, index),
            block_table=call.block_table.index_select(0, index),
            lengths=[lengths[n] for n in order],
        )
        out = _tiled(ordered, index, tile_size)
        return out.index_select(0, torch.argsort(index))
    index = torch.arange(len(lengths), device=q.device)
    return _tiled(call._replace(lengths=lengths), index, tile_size)


class _Chunk(NamedTuple):
    """Query rows q (N, H, R, D) at q_pos (N, 1, R, 1) of sequences of lens keys: those
    of sequence n see keys below ends[n] (ends descending) from first_key on."""

    q: Tensor
    q_pos: Tensor
    lens: Tensor
    ends: list[int]
    first_key: int


def _tiled(call: PagedCall, batch_ids: Tensor, tile_size: int) -> Tensor:
    """paged_tiled on sequences sorted longest first (batch_ids: their indices in the
    caller's batch, for score functions), query rows QUERY_CHUNK at a time."""
    q, lengths, window = call.q, call.lengths, call.window
    q_len = q.shape[2]
    lens = torch.tensor(lengths, device=q.device)
    q_pos = query_positions(lens, q_len)
    chunks = []
    for r0 in range(0, q_len, QUERY_CHUNK):
        r1 = min(q_len, r0 + QUERY_CHUNK)
        ends = [length - q_len + r1 for length in lengths]  # keys the chunk's rows can see
        starts = [max(0, end - (r1 - r0) - window) for end in ends] if window is not None else [0]
        chunk = _Chunk(q[:, :, r0:r1], q_pos[:, :, r0:r1], lens, ends, min(starts))
        chunks.append(_tiled_rows(call, chunk, batch_ids, tile_size))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)


def _page_tiles(call: PagedCall, chunk: _Chunk, tile_size: int):
    """The key tiles of _tiled_rows and _fused_rows, whole pages of about tile_size keys
    from chunk.first_key on: (active, keys (a, H_kv, K, D), values (a, H_kv, K, D_v),
    k_pos (1, 1, 1, K), masked) per tile, for the a = active first sequences (ends
    descending) that reach it; unwritten slots' values are zeroed; masked: some of the
    tile's query rows must not see some of its keys (else each sees each)."""
    k_pool, v_pool, table, window = call.k_pool, call.v_pool, call.block_table, call.window
    lens, ends, first_key, rows = chunk.lens, chunk.ends, chunk.first_key, chunk.q.shape[2]
    block_size = k_pool.shape[1]
    pages = max(1, tile_size // block_size)
    span = pages * block_size
    negated = [-end for end in ends]  # ascending, for bisect
    for k0 in range(first_key // span * span, max(ends, default=0), span):
        active = bisect.bisect_left(negated, -k0)  # sequences with ends[n] > k0
        blocks = table[:active, k0 // block_size : k0 // block_size + pages]
        keys, values = gather_pages(k_pool, blocks), gather_pages(v_pool, blocks)
        k_end = k0 + keys.shape[2]
        k_pos = torch.arange(k0, k_end, device=keys.device).view(1, 1, 1, -1)
        if k_end > ends[active - 1]:  # slots past some sequence's end
            real = (k_pos < lens[:active].view(-1, 1, 1, 1)).transpose(2, 3)
            values = values.masked_fill(~real, 0)  # unwritten slots may hold anything
        masked = window is not None or k_end > ends[active - 1] - rows + 1
        yield active, keys, values, k_pos, masked


def _tiled_rows(call: PagedCall, chunk: _Chunk, batch_ids: Tensor, tile_size: int) -> Tensor:
    """Online softmax over key tiles for a chunk of query rows."""
    q, q_pos, v_pool = chunk.q, chunk.q_pos, call.v_pool
    if (
        call.score is None
        and _FUSED is not None
        and q.device.type == "cpu"
        and q.shape[-1] == v_pool.shape[-1]
    ):
        return _fused_rows(call, chunk, tile_size)
    scale, score, window = call.scale, call.score, call.window
    batch, num_heads, rows, head_dim = q.shape
    num_kv_heads = call.k_pool.shape[2]
    dtype = stats_dtype(q.dtype)
    grouped = q.to(dtype).reshape(batch, num_kv_heads, -1, head_dim)  # (N, H_kv, G*R, D)
    out = q.new_zeros((batch, num_heads, rows, v_pool.shape[3]), dtype=dtype)
    lse = q.new_full((batch, num_heads, rows), -torch.inf, dtype=dtype)
    for active, keys, values, k_pos, masked in _page_tiles(call, chunk, tile_size):
        keys, values = keys.to(dtype), values.to(dtype)
        scores = (grouped[:active] @ keys.transpose(-1, -2)).mul_(scale)
        scores = scores.view(active, num_heads, rows, -1)
        scores = _scored(score, scores, batch_ids[:active], q_pos[:active], k_pos)
        if masked:
            scores = scores.masked_fill_(~_allowed(q_pos[:active], k_pos, window), -torch.inf)
        probs, lse_t = masked_softmax(scores)
        out_t = probs.view(active, num_kv_heads, -1, keys.shape[2]) @ values
        out[:active], lse[:active] = merge_partials(
            [(out[:active], lse[:active]), (out_t.view(active, num_heads, rows, -1), lse_t)]
        )
    return out.to(q.dtype)


def fused_row_blocks(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """PyTorch's fused CPU flash kernel on q (N, H, R, D) over keys (N, H, K, D), values
    (N, H, K, D_v) and an additive mask (N, 1, R, K) or None -> out (N, H, R, D_v), lse
    (N, H, R), with every row's result independent of the other rows of the call.

    The kernel computes a block of fewer than MIN_KERNEL_ROWS query rows another way
    (bitwise different), so a row's numbers would depend on how many rows share its
    block: a decoding step (one query, its G grouped heads as rows) would not equal the
    same position prefilled with others, nor a prompt prefilled whole equal one prefilled
    after a cached prefix. With several threads and little work it also splits a call's
    rows into smaller blocks (multiples of 4 rows, measured on torch 2.13). So rows go
    in calls of at most KERNEL_BLOCK_ROWS, each padded to a multiple of MIN_KERNEL_ROWS
    with copies of its last row (whose results are dropped): every block the kernel
    makes then holds 4 rows or more."""
    outs, lses = [], []
    for r0 in range(0, q.shape[2], KERNEL_BLOCK_ROWS):
        rows = q[:, :, r0 : r0 + KERNEL_BLOCK_ROWS]
        part = None if mask is None else mask[:, :, r0 : r0 + KERNEL_BLOCK_ROWS]
        count = rows.shape[2]
        if count % MIN_KERNEL_ROWS:
            pad = MIN_KERNEL_ROWS - count % MIN_KERNEL_ROWS
            rows = torch.cat([rows, rows[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
            if part is not None:
                part = torch.cat([part, part[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
        out, lse = _FUSED(rows, keys, values, 0.0, False, attn_mask=part, scale=scale)
        outs.append(out[:, :, :count])
        lses.append(lse[:, :, :count])
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _fused_rows(call: PagedCall, chunk: _Chunk, tile_size: int) -> Tensor:
    """_tiled_rows without a score function, each tile on the fused CPU kernel: query
    rows (g, r) of kv head h are query head h * G + g's row r."""
    q, q_pos, window = chunk.q, chunk.q_pos, call.window
    batch, num_heads, rows, head_dim = q.shape
    num_kv_heads = call.k_pool.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.reshape(batch, num_kv_heads, group * rows, head_dim)
    row_pos = q_pos.view(batch, 1, 1, rows).expand(batch, 1, group, rows)
    row_pos = row_pos.reshape(batch, 1, group * rows, 1)
    out = lse = None
    for active, keys, values, k_pos, masked in _page_tiles(call, chunk, tile_size):
        mask = None
        if masked:
            allowed = _allowed(row_pos[:active], k_pos, window)  # (a, 1, G*R, K)
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(~allowed, -torch.inf)
        out_t, lse_t = fused_row_blocks(grouped[:active], keys, values, mask, call.scale)
        if mask is not None:  # the kernel reports lse 0 for rows with no allowed key
            lse_t = lse_t.masked_fill(~allowed.any(dim=-1).view(active, 1, -1), -torch.inf)
        if out is None:
            out, lse = out_t.to(lse_t.dtype), lse_t
            continue
        out[:active], lse[:active] = merge_partials([(out[:active], lse[:active]), (out_t, lse_t)])
    out = out.reshape(batch, num_kv_heads, group, rows, -1).reshape(batch, num_heads, rows, -1)
    return out.to(q.dtype)
