"""Chunked causal attention (Llama 4's local layers): positions are cut into chunks of
`size`, and a query attends the keys of its own chunk up to itself.

Key j sits at position start + j and query i at start + i + S - L (the causal rule's
bottom-right alignment), so a decoding step with every key cached sees its chunk so
far. A chunk is positions c * size .. (c + 1) * size - 1, counted from position 0:
`start` says where key 0 is when a cache has dropped the keys before it (or, negative,
how many left-padding slots precede the first real token).

Its blocks are computed from the positions: tiles that lie inside one chunk below the
diagonal are FULL (no mask), tiles across chunk borders or above the diagonal EMPTY
(never visited), and each chunk is one diagonal piece (the keys before its first query,
unmasked, then a causal triangle), so the tiled engines pay only for allowed entries.
"""

from __future__ import annotations

import torch

from ..checks import an_int, int_at_least
from .base import Pattern, block_ranges
from .blocks import EMPTY, FULL, PARTIAL
from .causal import causal_allows, causal_shift

# below this chunk size a chunk is too small to be a kernel call of its own: the block
# plan's masked tiles are cheaper than one call per chunk
MIN_PIECE_ROWS = 64


class Chunked(Pattern):
    """A query at position p attends the keys at positions c * size .. p, where
    c = p // size: its own chunk of `size` positions, causally (Llama 4).

    Args:
        size: positions per chunk, >= 1 (Llama 4: attention_chunk_size, 8192).
        start: the position of key 0 (default 0); queries sit bottom-right.
    """

    within_causal = True

    def __init__(self, size: int, *, start: int = 0) -> None:
        self.size = int_at_least("size", size, 1, " (positions per chunk)")
        self.start = an_int("start", start, " (the position of key 0)")

    def _query_position(self, q_len: int, kv_len: int) -> int:
        """The position of query row 0."""
        return self.start + causal_shift(q_len, kv_len)

    def _chunk(self, positions):
        return positions.div(self.size, rounding_mode="floor")

    def _chunk_start(self, positions):
        return self._chunk(positions) * self.size

    def allowed(self, rows, cols, q_len, kv_len):
        q_pos = rows + self._query_position(q_len, kv_len)
        k_pos = cols + self.start
        return causal_allows(q_pos, k_pos) & (self._chunk(q_pos) == self._chunk(k_pos))

    def kinds(self, q_len, kv_len, block_q, block_k):
        q_first, q_last = block_ranges(q_len, block_q)
        k_first, k_last = block_ranges(kv_len, block_k)
        p_first = (q_first + self._query_position(q_len, kv_len)).view(-1, 1)
        p_last = (q_last + self._query_position(q_len, kv_len)).view(-1, 1)
        k_first, k_last = k_first + self.start, k_last + self.start
        # row p sees [chunk_start(p), p]; both ends grow with p, so a block's rows see
        # together [chunk_start(first), last] and each of them [chunk_start(last), first]
        full = (k_first >= self._chunk_start(p_last)) & causal_allows(p_first, k_last)
        empty = (k_last < self._chunk_start(p_first)) | ~causal_allows(p_last, k_first)
        kinds = torch.full(full.shape, PARTIAL, dtype=torch.int8)
        kinds[empty] = EMPTY
        kinds[full & ~empty] = FULL
        return kinds

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        # keys from the first row's position, and all rows in that position's chunk
        first = q0 + self._query_position(q_len, kv_len)
        last = first + q1 - q0 - 1
        return k0 + self.start == first and last // self.size == first // self.size

    def diagonal_pieces(self, q_len, kv_len):
        if self.size < MIN_PIECE_ROWS:
            return None
        shift = self._query_position(q_len, kv_len)  # position of row 0
        pieces = []
        row = max(0, self.start - shift)  # rows before key 0's position see no key
        while row < q_len:
            position = row + shift
            end = min(q_len, (position // self.size + 1) * self.size - shift)
            first_key = max(self.start, position // self.size * self.size) - self.start
            own = position - self.start  # the key at the first row's position
            runs = [(first_key, own, "full")] if own > first_key else []
            runs.append((own, own + end - row, "lower"))
            pieces.append((row, end, runs))
            row = end
        return pieces

    def __repr__(self) -> str:
        start = f", start={self.start}" if self.start else ""
        return f"Chunked({self.size}{start})"


__all__ = ["Chunked"]
