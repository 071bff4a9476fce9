"""Ready-made sparse patterns from the literature."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..checks import int_at_least
from .base import Pattern, block_ranges
from .block_sparse import RandomBlocks
from .causal import causal_shift
from .patterns import GlobalTokens, SlidingWindow, _kinds_from


class BlockBand(Pattern):
    """Block-aligned local attention: query block a attends key blocks a - radius ..
    a + radius (blocks of block_size, by position, queries aligned bottom-right)."""

    def __init__(self, block_size: int, radius: int) -> None:
        self.block_size = int_at_least("block_size", block_size, 1)
        self.radius = int_at_least("radius", radius, 0)

    def allowed(self, rows, cols, q_len, kv_len):
        q_block = (rows + causal_shift(q_len, kv_len)) // self.block_size
        return (cols // self.block_size - q_block).abs() <= self.radius

    def kinds(self, q_len, kv_len, block_q, block_k):
        """Exact at any tile size, from each tile's first and last query and key block."""
        size, shift = self.block_size, causal_shift(q_len, kv_len)
        q_first, q_last = (((p + shift) // size).view(-1, 1) for p in block_ranges(q_len, block_q))
        k_first, k_last = ((p // size).view(1, -1) for p in block_ranges(kv_len, block_k))
        some = (k_last >= q_first - self.radius) & (k_first <= q_last + self.radius)
        every = (k_last - q_first <= self.radius) & (q_last - k_first <= self.radius)
        return _kinds_from(every, ~some)

    def __repr__(self) -> str:
        return f"BlockBand({self.block_size}, {self.radius})"


def longformer(window: int, global_indices: Sequence[int] | Tensor) -> Pattern:
    """Longformer: a sliding window of `window` keys on each side, plus global tokens."""
    return SlidingWindow(window, window) | GlobalTokens(global_indices)


def bigbird(
    block_size: int,
    window_blocks: int = 3,
    global_blocks: int = 2,
    random_blocks: int = 3,
    seed: int = 0,
) -> Pattern:
    """BigBird (ITC): each query block attends `window_blocks` neighbouring key blocks
    (itself in the middle), the first `global_blocks` blocks are global tokens, plus
    `random_blocks` random key blocks per query block, fixed by the seed."""
    int_at_least("window_blocks", window_blocks, 1)
    if window_blocks % 2 == 0:
        raise ValueError(
            f"window_blocks must be odd (the block itself in the middle), got {window_blocks}"
        )
    int_at_least("global_blocks", global_blocks, 0)
    int_at_least("random_blocks", random_blocks, 0)
    return (
        BlockBand(block_size, window_blocks // 2)
        | GlobalTokens(range(global_blocks * block_size), beyond_keys="ignore")
        | RandomBlocks(random_blocks, block_size, seed)
    )


__all__ = ["BlockBand", "bigbird", "longformer"]
