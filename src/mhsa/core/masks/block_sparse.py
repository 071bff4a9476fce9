"""Block-sparse patterns: an explicit layout of query blocks by key blocks (BlockSparse),
and BigBird's random blocks drawn over blocks of positions (RandomBlocks), with their
tile kinds counted on the layout in O(blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import an_int, int_at_least
from .base import Pattern, block_ranges
from .blocks import num_blocks
from .causal import causal_shift
from .patterns import _kinds_from


def _layout_kinds(
    layout: Tensor,
    size: int,
    q_len: int,
    kv_len: int,
    block_q: int,
    block_k: int,
    first_row: int = 0,
) -> Tensor:
    """Tile kinds of a block layout (rows and keys in blocks of size, from 0) at any tile
    size, in O(blocks): a tile is FULL when every layout block it touches is allowed,
    EMPTY when none is (counted on the layout's 2-D prefix sums). first_row: the
    position (in rows of the layout's blocks) of query row 0."""
    sums = F.pad(layout.long().cumsum(0).cumsum(1), (1, 0, 1, 0))
    q_first, q_last = ((p + first_row) // size for p in block_ranges(q_len, block_q))
    k_first, k_last = (p // size for p in block_ranges(kv_len, block_k))
    top, bottom = q_first.view(-1, 1), q_last.view(-1, 1) + 1
    left, right = k_first.view(1, -1), k_last.view(1, -1) + 1
    allowed = sums[bottom, right] - sums[top, right] - sums[bottom, left] + sums[top, left]
    return _kinds_from(allowed == (bottom - top) * (right - left), allowed == 0)


class BlockSparse(Pattern):
    """An explicit layout: query block a attends key block b where layout[a, b].

    layout is bool (ceil(L / block_size), ceil(S / block_size)), blocks counted from
    query row 0 and key 0.
    """

    plain_values = False  # holds tensors

    def __init__(self, layout: Tensor, block_size: int) -> None:
        if not isinstance(layout, Tensor) or layout.dtype != torch.bool or layout.dim() != 2:
            raise TypeError("layout must be a 2-D bool tensor (query blocks, key blocks)")
        self.layout = layout.cpu()
        self.block_size = int_at_least("block_size", block_size, 1)

    def check_lengths(self, q_len, kv_len):
        want = (num_blocks(q_len, self.block_size), num_blocks(kv_len, self.block_size))
        if tuple(self.layout.shape) != want:
            raise ValueError(
                f"layout has shape {tuple(self.layout.shape)} but L={q_len}, S={kv_len} with "
                f"block_size={self.block_size} need (ceil(L/block), ceil(S/block)) = {want}"
            )

    def layout_for(self, q_len: int, kv_len: int) -> Tensor:
        return self.layout

    def allowed(self, rows, cols, q_len, kv_len):
        layout = self.layout_for(q_len, kv_len).to(rows.device)
        return layout[rows // self.block_size, cols // self.block_size]

    def kinds(self, q_len, kv_len, block_q, block_k):
        layout = self.layout_for(q_len, kv_len)
        if block_q == block_k == self.block_size:
            return _kinds_from(layout, ~layout)
        return _layout_kinds(layout, self.block_size, q_len, kv_len, block_q, block_k)

    def __repr__(self) -> str:
        return f"BlockSparse(<{tuple(self.layout.shape)} layout>, {self.block_size})"


LAYOUTS_KEPT = 8  # RandomBlocks' layouts for the latest key lengths


class RandomBlocks(BlockSparse):
    """BigBird's random attention: each block of query positions attends num_blocks key
    blocks drawn uniformly without replacement, fixed by the seed and S (all if fewer
    exist). Queries sit bottom-right (row i at position i + S - L), so a decoding step's
    query sees the blocks its position sees in the whole prompt; positions before 0
    (L > S) see none."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.num_blocks = int_at_least("num_blocks", num_blocks, 0)
        self.block_size = int_at_least("block_size", block_size, 1)
        self.seed = an_int("seed", seed)
        self._layouts: dict[int, Tensor] = {}  # key blocks -> their rows' draws

    def check_lengths(self, q_len, kv_len):
        pass

    def layout_for(self, q_len: int, kv_len: int) -> Tensor:
        """(blocks of positions before 0, then of 0..S-1; key blocks) bool."""
        size, shift = self.block_size, causal_shift(q_len, kv_len)
        cols, before = num_blocks(kv_len, size), num_blocks(max(0, -shift), size)
        drawn = self._layouts.get(cols)
        if drawn is None:
            generator = torch.Generator().manual_seed(self.seed)
            drawn = torch.zeros(cols, cols, dtype=torch.bool)
            for r in range(cols):
                drawn[r, torch.randperm(cols, generator=generator)[: self.num_blocks]] = True
            self._layouts[cols] = drawn
            while len(self._layouts) > LAYOUTS_KEPT:  # (decoding grows S a token a step:
                self._layouts.pop(next(iter(self._layouts)), None)  # all kept grew cubically)
        if not before:
            return drawn
        return torch.cat((torch.zeros(before, cols, dtype=torch.bool), drawn))

    def _first_row(self, q_len: int, kv_len: int) -> int:
        """Query row 0's position, counted from the layout's first row."""
        shift = causal_shift(q_len, kv_len)
        return shift + num_blocks(max(0, -shift), self.block_size) * self.block_size

    def allowed(self, rows, cols, q_len, kv_len):
        layout = self.layout_for(q_len, kv_len).to(rows.device)
        first = self._first_row(q_len, kv_len)
        return layout[(rows + first) // self.block_size, cols // self.block_size]

    def kinds(self, q_len, kv_len, block_q, block_k):
        layout, first = self.layout_for(q_len, kv_len), self._first_row(q_len, kv_len)
        return _layout_kinds(layout, self.block_size, q_len, kv_len, block_q, block_k, first)

    def __repr__(self) -> str:
        return f"RandomBlocks({self.num_blocks}, {self.block_size}, seed={self.seed})"
