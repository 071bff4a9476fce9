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
the call's other rows: see fused_row_blocks) and the tiles merge by their logsumexp;
with one, the tiles are computed unfused (torch matmuls). A tile's slots past a sequence's end
may hold anything (nan, inf): its keys and values there are zeroed before use, as the
fused kernel adds its -inf mask to their scores. Statistics are float32 (float64 for
float64 inputs).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..checks import int_at_least
from ..masks.base import Pattern
from ..masks.causal import causal_shift
from ..masks.patterns import Causal, SlidingWindow
from ..scores import ScoreFunction
from .dense import grouped_scores, masked_softmax, probs_times_v, stats_dtype
from .merge import merge_partials

QUERY_CHUNK = 512  # query rows per pass of the tiled loop (bounds a score tile)
TILE_SIZE = 256  # keys per tile of paged_tiled (whole pages), as the flash backend calls it
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
KERNEL_BLOCK_ROWS = 32  # query rows per fused call: one of the kernel's blocks (it splits at 32)
MIN_KERNEL_ROWS = 4  # fewer rows in a kernel block are computed another way (fused_row_blocks)


def gather_pages(pool: Tensor, table: Tensor, unwritten: Tensor | None = None) -> Tensor:
    """pool (num_blocks, block_size, H_kv, X), table (N, P) -> (N, H_kv, P * block_size, X),
    a view after one index_select; unwritten: the slots (n * P * block_size + key) to
    zero in the gathered copy, as indices (only those rows are written: on CPU many
    times faster than a mask) or as a bool mask (N * P * block_size,)."""
    rows = pool.index_select(0, table.reshape(-1))
    if unwritten is not None:
        flat = rows.view(-1, pool.shape[2] * pool.shape[3])
        if unwritten.dtype == torch.bool:
            flat.masked_fill_(unwritten.view(-1, 1), 0)
        else:
            flat.index_fill_(0, unwritten, 0)
    return rows.view(table.shape[0], -1, pool.shape[2], pool.shape[3]).transpose(1, 2)


def query_positions(lengths: Tensor, q_len: int) -> Tensor:
    """(N, 1, T, 1) position of each query: lengths[n] - T + row."""
    rows = torch.arange(q_len, device=lengths.device)
    return (rows + causal_shift(q_len, lengths.view(-1, 1))).view(-1, 1, q_len, 1)


def _visibility(window: int | None) -> Pattern:
    """What a paged call's queries see, as a rule of positions (Pattern.positions):
    Causal(), or SlidingWindow(window, 0) with a window. Made once a call, not a tile."""
    return Causal() if window is None else SlidingWindow(window, 0)


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
    scores = scores.masked_fill(~_visibility(window).positions(q_pos, k_pos), -torch.inf)
    probs, _ = masked_softmax(scores)
    real = (k_pos < lens.view(-1, 1, 1, 1)).transpose(2, 3)  # (N, 1, S, 1)
    values = values.masked_fill(~real, 0)  # unwritten slots may hold anything
    return probs_times_v(probs, values).to(q.dtype)


def paged_tiled(
    call: PagedCall, tile_size: int = TILE_SIZE, layout: FusedLayout | None = None
) -> Tensor:
    """(N, H, T, D_v) by an online softmax over tiles of about tile_size keys (whole
    pages), gathered one at a time. Inference only (it updates its state in place).
    layout: fused_layout of a call like this one (the same shapes, table and lengths,
    window), made once for every layer of a decoding step; None: made here as needed."""
    int_at_least("tile_size", tile_size, 1)
    if layout is not None and layout.tile_size == tile_size:  # (the fused kernel's)
        if layout.order is None:
            return _fused(call, layout.chunks)
        ordered = call._replace(
            q=call.q.index_select(0, layout.order),
            block_table=layout.block_table,
            lengths=layout.lengths,
        )
        return _fused(ordered, layout.chunks).index_select(0, layout.back)
    q, lengths = call.q, list(call.lengths)
    order = _longest_first(lengths)
    if order != sorted(order):
        index = torch.tensor(order, device=q.device)
        ordered = call._replace(
            q=q.index_select(0, index),
            block_table=call.block_table.index_select(0, index),
            lengths=[lengths[n] for n in order],
        )
        return _tiled(ordered, index, tile_size).index_select(0, torch.argsort(index))
    index = torch.arange(len(lengths), device=q.device)
    return _tiled(call._replace(lengths=lengths), index, tile_size)


def _longest_first(lengths: list[int]) -> list[int]:
    """The sequences' order in the tiled loop: longest first (a stable sort)."""
    return sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)


class _Chunk(NamedTuple):
    """Query rows start..stop at q_pos (N, 1, R, 1) of sequences of lens keys: those of
    sequence n see keys below ends[n] (ends descending) from first_key on."""

    start: int
    stop: int
    q_pos: Tensor
    lens: Tensor
    ends: list[int]
    first_key: int


class _Tile(NamedTuple):
    """Keys k_pos (1, 1, 1, K) of the block table's columns `pages`, for the `active`
    first sequences (ends descending) that reach them. unwritten: the slots past a
    sequence's end (n * K + key, see gather_pages: they may hold anything, so they are
    zeroed), or None. masked: some query row of the chunk must not see some key (else
    each sees each)."""

    active: int
    pages: slice
    k_pos: Tensor
    unwritten: Tensor | None
    masked: bool


def _runs_fused(call: PagedCall) -> bool:
    """Whether the call's tiles run on the fused CPU kernel (else unfused, in torch matmuls)."""
    return (
        call.score is None
        and _FUSED is not None
        and call.q.device.type == "cpu"
        and call.q.shape[-1] == call.v_pool.shape[-1]
    )


def _tiled(call: PagedCall, batch_ids: Tensor, tile_size: int) -> Tensor:
    """paged_tiled on sequences sorted longest first (batch_ids: their indices in the
    caller's batch, for score functions), query rows QUERY_CHUNK at a time."""
    if _runs_fused(call):
        return _fused(call, _fused_chunks(call, tile_size))
    chunks = [_tiled_rows(call, chunk, batch_ids, tile_size) for chunk in _chunks(call)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)


def _chunks(call: PagedCall) -> Iterator[_Chunk]:
    """The query rows in chunks of QUERY_CHUNK."""
    q_len, lengths, window = call.q.shape[2], call.lengths, call.window
    lens = torch.tensor(lengths, device=call.q.device)
    q_pos = query_positions(lens, q_len)
    for r0 in range(0, q_len, QUERY_CHUNK):
        r1 = min(q_len, r0 + QUERY_CHUNK)
        ends = [length - q_len + r1 for length in lengths]  # keys the chunk's rows can see
        starts = [max(0, end - (r1 - r0) - window) for end in ends] if window is not None else [0]
        yield _Chunk(r0, r1, q_pos[:, :, r0:r1], lens, ends, min(starts))


def _page_tiles(call: PagedCall, chunk: _Chunk, tile_size: int) -> Iterator[_Tile]:
    """The key tiles of a chunk: whole pages, about tile_size keys, from chunk.first_key
    on, each for the sequences that reach it."""
    block_size, max_blocks = call.k_pool.shape[1], call.block_table.shape[1]
    lens, ends, rows = chunk.lens, chunk.ends, chunk.stop - chunk.start
    pages = max(1, tile_size // block_size)
    span = pages * block_size
    negated = [-end for end in ends]  # ascending, for bisect
    for k0 in range(chunk.first_key // span * span, max(ends, default=0), span):
        active = bisect.bisect_left(negated, -k0)  # sequences with ends[n] > k0
        p0 = k0 // block_size
        p1 = min(p0 + pages, max_blocks)
        k_end = p1 * block_size
        k_pos = torch.arange(k0, k_end, device=call.q.device).view(1, 1, 1, -1)
        unwritten = None
        if k_end > ends[active - 1]:  # slots past some sequence's end
            unwritten = (k_pos.view(1, -1) >= lens[:active].view(-1, 1)).view(-1)  # (a * K,)
            if unwritten.device.type == "cpu":  # (nonzero would wait for a GPU)
                unwritten = unwritten.nonzero().view(-1)
        masked = call.window is not None or k_end > ends[active - 1] - rows + 1
        yield _Tile(active, slice(p0, p1), k_pos, unwritten, masked)


def _gathered(call: PagedCall, tile: _Tile) -> tuple[Tensor, Tensor]:
    """A tile's keys (a, H_kv, K, D) and values (a, H_kv, K, D_v), unwritten slots
    zeroed."""
    blocks = call.block_table[: tile.active, tile.pages]
    keys = gather_pages(call.k_pool, blocks, tile.unwritten)
    return keys, gather_pages(call.v_pool, blocks, tile.unwritten)


def _tiled_rows(call: PagedCall, chunk: _Chunk, batch_ids: Tensor, tile_size: int) -> Tensor:
    """Online softmax over key tiles for a chunk of query rows, unfused (torch matmuls)."""
    q, q_pos, v_pool = call.q[:, :, chunk.start : chunk.stop], chunk.q_pos, call.v_pool
    scale, score, visible = call.scale, call.score, _visibility(call.window)
    batch, num_heads, rows, head_dim = q.shape
    num_kv_heads = call.k_pool.shape[2]
    dtype = stats_dtype(q.dtype)
    grouped = q.to(dtype).reshape(batch, num_kv_heads, -1, head_dim)  # (N, H_kv, G*R, D)
    out = q.new_zeros((batch, num_heads, rows, v_pool.shape[3]), dtype=dtype)
    lse = q.new_full((batch, num_heads, rows), -torch.inf, dtype=dtype)
    for tile in _page_tiles(call, chunk, tile_size):
        active, k_pos = tile.active, tile.k_pos
        keys, values = (x.to(dtype) for x in _gathered(call, tile))
        scores = (grouped[:active] @ keys.transpose(-1, -2)).mul_(scale)
        scores = scores.view(active, num_heads, rows, -1)
        scores = _scored(score, scores, batch_ids[:active], q_pos[:active], k_pos)
        if tile.masked:
            scores = scores.masked_fill_(~visible.positions(q_pos[:active], k_pos), -torch.inf)
        probs, lse_t = masked_softmax(scores)
        out_t = probs.view(active, num_kv_heads, -1, keys.shape[2]) @ values
        out[:active], lse[:active] = merge_partials(
            [(out[:active], lse[:active]), (out_t.view(active, num_heads, rows, -1), lse_t)]
        )
    return out.to(q.dtype)


class _FusedTile(NamedTuple):
    """A tile as the fused kernel takes it: masks, one additive mask (a, 1, rows, K) per
    call of fused_row_blocks, padded as it pads the query rows, or None where each row
    sees each key; keyless (a, 1, G*R): the rows that see no key of the tile (the kernel
    reports lse 0 there), or None."""

    tile: _Tile
    masks: list[Tensor | None]
    keyless: Tensor | None


class FusedLayout(NamedTuple):
    """What the fused engine computes for the calls of one kind of a decoding step
    besides their keys: the sequences' order in the tiled loop (longest first) and the
    step's block table and lengths in it, and each query chunk's rows and its tiles
    (positions, masks). Made from the step's table and lengths and the call's shapes,
    it reads no key: every layer of the step shares one (mhsa.core.paged)."""

    tile_size: int
    order: Tensor | None  # (N,) the sequences longest first; None: they already are
    back: Tensor | None  # (N,) argsort(order): the caller's order again
    block_table: Tensor  # the step's table, in that order
    lengths: list[int]  # and its lengths
    chunks: list[tuple[tuple[int, int], list[_FusedTile]]]


MEMO_QUERIES = 32  # calls of at most this many queries (decoding, drafts) have a layout


def fused_layout(call: PagedCall, tile_size: int = TILE_SIZE) -> FusedLayout | None:
    """The layout of paged_tiled for calls like `call`, made whole; None where the call
    does not run on the fused kernel or has more than MEMO_QUERIES queries (a prefill's
    tiles are then made one at a time, their masks never all held at once)."""
    if not _runs_fused(call) or call.q.shape[2] > MEMO_QUERIES:
        return None
    lengths = list(call.lengths)
    order = _longest_first(lengths)
    index = back = None
    table = call.block_table
    if order != sorted(order):
        index = torch.tensor(order, device=call.q.device)
        back = torch.argsort(index)
        table = table.index_select(0, index)
        lengths = [lengths[n] for n in order]
    ordered = call._replace(block_table=table, lengths=lengths)  # (q: its shape alone is read)
    chunks = [(rows, list(tiles)) for rows, tiles in _fused_chunks(ordered, tile_size)]
    return FusedLayout(tile_size, index, back, table, lengths, chunks)


def _fused_chunks(call: PagedCall, tile_size: int):
    """Each query chunk's rows and its tiles for the fused kernel: query rows (g, r) of
    kv head h are query head h * G + g's row r."""
    q = call.q
    batch, num_heads = q.shape[:2]
    group = num_heads // call.k_pool.shape[2]
    for chunk in _chunks(call):
        rows = chunk.stop - chunk.start
        row_pos = chunk.q_pos.view(batch, 1, 1, rows).expand(batch, 1, group, rows)
        row_pos = row_pos.reshape(batch, 1, group * rows, 1)
        yield (chunk.start, chunk.stop), _fused_tiles(call, chunk, row_pos, tile_size)


def _fused_tiles(call: PagedCall, chunk: _Chunk, row_pos: Tensor, tile_size: int):
    """A chunk's tiles with their masks, for query rows at row_pos (N, 1, G*R, 1)."""
    blocks, visible = kernel_row_blocks(row_pos.shape[2]), _visibility(call.window)
    for tile in _page_tiles(call, chunk, tile_size):
        if not tile.masked:
            yield _FusedTile(tile, [None] * len(blocks), None)
            continue
        allowed = visible.positions(row_pos[: tile.active], tile.k_pos)  # (a, 1, G*R, K)
        mask = torch.zeros(allowed.shape, dtype=call.q.dtype, device=call.q.device)
        mask.masked_fill_(~allowed, -torch.inf)
        masks = [_pad_rows(mask[:, :, r0:r1]) for r0, r1 in blocks]
        yield _FusedTile(tile, masks, ~allowed.any(dim=-1).view(tile.active, 1, -1))


def _fused(call: PagedCall, layout) -> Tensor:
    """_tiled without a score function, each tile on the fused CPU kernel, the tiles
    merged by their logsumexp."""
    q = call.q
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads = call.k_pool.shape[2]
    group = num_heads // num_kv_heads
    outs = []
    for (start, stop), tiles in layout:
        rows = stop - start
        grouped = q[:, :, start:stop].reshape(batch, num_kv_heads, group * rows, head_dim)
        # sequences with no key in any tile (empty ones) keep output 0 and lse -inf
        shape = (batch, num_kv_heads, group * rows)
        out = q.new_zeros(*shape, call.v_pool.shape[3], dtype=stats_dtype(q.dtype))
        lse = torch.full(shape, -torch.inf, dtype=out.dtype, device=q.device)
        for index, fused in enumerate(tiles):
            active = fused.tile.active
            keys, values = _gathered(call, fused.tile)
            out_t, lse_t = fused_row_blocks(grouped[:active], keys, values, fused.masks, call.scale)
            if fused.keyless is not None:  # the kernel reports lse 0 for rows with no key
                lse_t = lse_t.masked_fill(fused.keyless, -torch.inf)
            if index == 0:  # nothing to merge with yet: the common one-tile decoding step
                out[:active], lse[:active] = out_t, lse_t
                continue
            parts = [(out[:active], lse[:active]), (out_t.to(out.dtype), lse_t.to(out.dtype))]
            out[:active], lse[:active] = merge_partials(parts)
        out = out.reshape(batch, num_kv_heads, group, rows, -1)
        outs.append(out.reshape(batch, num_heads, rows, -1).to(q.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def kernel_row_blocks(rows: int) -> list[tuple[int, int]]:
    """(start, stop) of the query rows of each fused call: KERNEL_BLOCK_ROWS at most."""
    return [(r0, min(rows, r0 + KERNEL_BLOCK_ROWS)) for r0 in range(0, rows, KERNEL_BLOCK_ROWS)]


def _pad_rows(x: Tensor) -> Tensor:
    """x (N, H, R, X) with copies of its last row appended to a multiple of
    MIN_KERNEL_ROWS rows."""
    extra = -x.shape[2] % MIN_KERNEL_ROWS
    if not extra:
        return x
    return torch.cat([x, x[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)


def fused_row_blocks(
    q: Tensor, keys: Tensor, values: Tensor, masks: list[Tensor | None], scale: float
) -> tuple[Tensor, Tensor]:
    """PyTorch's fused CPU flash kernel on q (N, H, R, D) over keys (N, H, K, D), values
    (N, H, K, D_v) -> out (N, H, R, D_v), lse (N, H, R), with every row's result
    independent of the other rows of the call. masks: one additive mask (N, 1, rows, K)
    or None per block of kernel_row_blocks(R), padded by _pad_rows.

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
    for (r0, r1), mask in zip(kernel_row_blocks(q.shape[2]), masks, strict=True):
        rows = _pad_rows(q[:, :, r0:r1])
        out, lse = _FUSED(rows, keys, values, 0.0, False, attn_mask=mask, scale=scale)
        outs.append(out[:, :, : r1 - r0])
        lses.append(lse[:, :, : r1 - r0])
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
