"""Tile lists: the flash engine's block plan (mhsa.core.kernels.plan) in the form the
Triton kernels walk.

Per query block (CSR) the key blocks it visits and per key block (CSC) the query
blocks that visit it, each tile FULL or PARTIAL; EMPTY tiles appear in neither.
Partial tiles take their mask from the causal condition (computed in the kernel), a
bool tensor mask read through broadcast strides, or, for patterns, a compact buffer
holding only the partial tiles (memory follows the partial tiles, not L * S).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import as_4d
from ...masks import with_causal
from ...masks.blocks import FULL, PARTIAL
from ...masks.causal import causal_shift
from ..memo import PatternCache
from ..plan import build_plan

MASK_NONE, MASK_TENSOR, MASK_TILES = 0, 1, 2


@dataclass
class TileLists:
    """The kernels' view of a block plan; all index tensors int32 on the call's device.

    row_ptr (num_q_blocks + 1,) and row_blk/row_kind/row_tile (tiles,): per query block,
    its key blocks, kinds (FULL or PARTIAL) and compact-tile indices (MASK_TILES).
    col_ptr (num_k_blocks + 1,) and col_blk/col_kind/col_tile: the same tiles per key
    block, with query blocks. mask: (B, H, L, S) uint8 broadcast view (MASK_TENSOR);
    tiles: (1 or B, partial tiles, BLOCK_M, BLOCK_N) uint8 (MASK_TILES).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    causal: bool
    shift: int
    row_ptr: Tensor
    row_blk: Tensor
    row_kind: Tensor
    row_tile: Tensor
    col_ptr: Tensor
    col_blk: Tensor
    col_kind: Tensor
    col_tile: Tensor
    mask_mode: int
    mask: Tensor | None
    tiles: Tensor | None

    @property
    def num_q_blocks(self) -> int:
        return self.row_ptr.numel() - 1

    @property
    def num_k_blocks(self) -> int:
        return self.col_ptr.numel() - 1


def _pointers(block: Tensor, count: int, device) -> Tensor:
    """CSR pointers (count + 1,) int32 of entries sorted by block."""
    ptr = torch.zeros(count + 1, dtype=torch.int64)
    ptr[1:] = torch.bincount(block, minlength=count).cumsum(0)
    return ptr.to(device=device, dtype=torch.int32)


def _plan_entries(plan, block_m: int, block_n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(query block, key block, kind) int64 of every visited tile, sorted by query block."""
    runs = [
        (r.q0 // block_m, run.k0 // block_n, -(-run.k1 // block_n), FULL if run.full else PARTIAL)
        for r in plan.rows
        for run in r.runs
    ]
    if not runs:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    qi, k_first, k_end, kind = torch.tensor(runs, dtype=torch.int64).unbind(1)
    counts = k_end - k_first
    starts = counts.cumsum(0) - counts
    within = torch.arange(int(counts.sum())) - starts.repeat_interleave(counts)
    kj = k_first.repeat_interleave(counts) + within
    return qi.repeat_interleave(counts), kj, kind.repeat_interleave(counts)


def _pattern_tiles(
    pattern, qi: Tensor, kj: Tensor, q_len: int, kv_len: int, block_m: int, block_n: int, device
) -> Tensor | None:
    """(1 or B, tiles, BLOCK_M, BLOCK_N) uint8: the pattern's element mask on each tile
    (query block qi, key block kj) in order (sorted by qi), one evaluation per query block;
    None for a pattern that differs by head (the kernels index tiles by batch alone)."""
    pieces = []
    blocks, counts = qi.unique_consecutive(return_counts=True)
    for block, keys in zip(blocks.tolist(), kj.split(counts.tolist()), strict=True):
        keys = keys.to(device)
        cols = (keys.view(-1, 1) * block_n + torch.arange(block_n, device=device)).flatten()
        q0, q1 = block * block_m, min(q_len, (block + 1) * block_m)
        keys_at = cols.clamp(max=kv_len - 1)
        tile = pattern.tile(q0, q1, keys_at, q_len, kv_len)  # (B?, H?, rows, n * BLOCK_N)
        if tile.dim() >= 3 and tile.shape[-3] > 1:  # (B?, H, ...): broadcast from the right
            return None
        # rows may broadcast (key padding)
        tile = tile.reshape(-1, *tile.shape[-2:]).expand(-1, q1 - q0, cols.numel())
        tile = F.pad(tile.to(torch.uint8), (0, 0, 0, block_m - (q1 - q0)))
        pieces.append(tile.view(tile.shape[0], block_m, keys.numel(), block_n).transpose(1, 2))
    if not pieces:
        return torch.zeros(1, 0, block_m, block_n, dtype=torch.uint8, device=device)
    batch = max(p.shape[0] for p in pieces)
    return torch.cat([p.expand(batch, -1, -1, -1) for p in pieces], dim=1).contiguous()


def broadcast4d(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A (B, H, L, S)-broadcastable tensor as a 4-D view expanded to shape."""
    return as_4d(t).expand(shape)


def build_tiles(
    mask,
    causal: bool,
    shape: tuple[int, int, int, int],
    device,
    blocks: tuple[int, int, int, int],
) -> TileLists:
    """Tile lists for a call: mask (None, bool tensor or pattern), causal, shape
    (B, H, L, S), blocks (BLOCK_M, BLOCK_N, num_warps, num_stages). Cached for patterns
    and no mask (building them runs the plan in Python and copies to the device);
    rebuilt for tensor masks, which may change in place."""
    if isinstance(mask, Tensor):
        return _build_tiles(mask, causal, shape, device, blocks)
    build = functools.partial(_build_tiles, mask, causal, shape, device, blocks)
    lists = _CACHE.get(mask, (causal, tuple(shape), str(device), tuple(blocks)), build)
    if lists is None:  # a pattern that differs by head: its dense mask, never kept
        dense = mask.dense(shape[2], shape[3], device)
        return _build_tiles(dense, causal, shape, device, blocks)
    return lists


_CACHE = PatternCache(size=64)


def _build_tiles(mask, causal: bool, shape: tuple, device, blocks: tuple) -> TileLists | None:
    """build_tiles' lists; None for a pattern that differs by head (_pattern_tiles)."""
    batch, num_heads, q_len, kv_len = shape
    block_m, block_n = blocks[:2]
    pattern = with_causal(mask, causal)
    plan = build_plan(pattern, q_len, kv_len, block_q=block_m, block_k=block_n, merge_rows=False)
    qi, kj, kind = _plan_entries(plan, block_m, block_n)
    partial = kind == PARTIAL
    tile = torch.full_like(qi, -1)
    mask_mode, dense, tiles = MASK_NONE, None, None
    if isinstance(mask, Tensor):
        mask_mode = MASK_TENSOR
        dense = broadcast4d(mask, shape).view(torch.uint8)
    elif mask is not None:
        mask_mode = MASK_TILES
        tile[partial] = torch.arange(int(partial.sum()))
        tiles = _pattern_tiles(
            mask, qi[partial], kj[partial], q_len, kv_len, block_m, block_n, device
        )
        if tiles is None:
            return None
    num_q, num_k = -(-q_len // block_m), -(-kv_len // block_n)
    order = torch.argsort(kj * num_q + qi)

    def on_device(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=torch.int32)

    return TileLists(
        block_m,
        block_n,
        blocks[2],
        blocks[3],
        causal,
        causal_shift(q_len, kv_len),
        _pointers(qi, num_q, device),
        on_device(kj),
        on_device(kind),
        on_device(tile),
        _pointers(kj[order], num_k, device),
        on_device(qi[order]),
        on_device(kind[order]),
        on_device(tile[order]),
        mask_mode,
        dense,
        tiles,
    )
