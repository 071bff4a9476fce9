"""Packed sequences (FlashAttention's varlen layout) as a pattern.

Several sequences are packed into one row: query segment s holds the rows
cu_q[s]..cu_q[s+1]-1 and key segment s the keys cu_k[s]..cu_k[s+1]-1, and a query
attends only keys of its own segment: a block-diagonal mask. Within a segment,
causality and a window are aligned bottom-right as for a sequence alone (the causal
rule of .causal): local query i of a segment with Lq queries and Lk keys sits at
position i + Lk - Lq. Segments may be empty (cu_seqlens repeats an offset).

Its blocks are computed from the offsets alone, in time and memory proportional to
the blocks a query block may reach, never from the (L, S) mask nor the grid of all
block pairs: a thousand segments plan as fast as a few.
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor

from ...data.packing import check_cu_seqlens
from ..checks import int_at_least
from .base import Pattern
from .blocks import EMPTY, FULL, PARTIAL, num_blocks
from .causal import causal_allows, causal_shift


def check_segment_counts(cu_q: Tensor, cu_k: Tensor) -> None:
    """One key segment per query segment."""
    if cu_k.numel() != cu_q.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel() - 1} segments but cu_seqlens_k has "
            f"{cu_k.numel() - 1}: give one key segment per query segment"
        )


def check_window(window) -> tuple[int, int] | None:
    """None, an int w (the same as (w, w)) or (left, right) ints >= 0, as (left, right)."""
    if window is None:
        return None
    pair = (window, window) if isinstance(window, int) and not isinstance(window, bool) else window
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise TypeError(f"window must be None, an int or (left, right), got {window!r}")
    return int_at_least("window's left", pair[0], 0), int_at_least("window's right", pair[1], 0)


def _tile_hint(lengths: Tensor) -> int:
    """Tiles about half the median sequence (64 to 256 rows): each tile then meets few
    sequences, so little of it is masked, at few tiles per sequence."""
    nonempty = lengths[lengths > 0]
    half = int(nonempty.median()) // 2 if nonempty.numel() else 0
    block = 64
    while block < half and block < 256:
        block *= 2
    return block


def _segment_of(cu: Tensor, index: Tensor) -> Tensor:
    """The segment holding each packed index (the last of equal offsets: empty segments
    hold no index)."""
    return torch.searchsorted(cu, index, right=True) - 1


class Segments(Pattern):
    """Packed sequences: query segment s attends only key segment s; with causal, and
    within window (left, right), aligned bottom-right inside each segment.

    cu_seqlens_q (B+1,) int32/int64 offsets of the query segments in the packed rows;
    cu_seqlens_k those of the keys (default: the same). window: a query at local
    position p sees local keys p - left .. p + right (an int w is (w, w)); with causal
    the keys after p are hidden whatever right is.
    """

    plain_values = False  # holds tensors

    def __init__(
        self,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor | None = None,
        *,
        causal: bool = False,
        window: int | tuple[int, int] | None = None,
    ) -> None:
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
        cu_k = cu_q if cu_seqlens_k is None else check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
        check_segment_counts(cu_q, cu_k)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be True or False, got {type(causal).__name__}")
        self.cu_seqlens_q, self.cu_seqlens_k = cu_q, cu_k
        self.causal = causal
        self.window = check_window(window)
        self._starts_q, self._starts_k = cu_q.tolist(), cu_k.tolist()
        self.block_size = _tile_hint(cu_q.diff())
        self._tables: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    @property
    def num_segments(self) -> int:
        return len(self._starts_q) - 1

    def _on(self, device) -> tuple[Tensor, Tensor, Tensor]:
        """(cu_q, cu_k, shift) on device: shift[s] = the position of segment s's first
        query (its keys minus its queries, the causal rule's bottom-right shift)."""
        key = str(device)
        if key not in self._tables:
            cu_q, cu_k = self.cu_seqlens_q, self.cu_seqlens_k
            shift = causal_shift(cu_q.diff(), cu_k.diff())
            self._tables[key] = (cu_q.to(device), cu_k.to(device), shift.to(device))
        return self._tables[key]

    def _right(self) -> int | None:
        """How far right of its position a query sees (None: to its segment's end)."""
        if self.causal:
            return 0
        return None if self.window is None else self.window[1]

    def check_lengths(self, q_len, kv_len):
        if (q_len, kv_len) != (self._starts_q[-1], self._starts_k[-1]):
            raise ValueError(
                f"the segments cover {self._starts_q[-1]} queries and {self._starts_k[-1]} "
                f"keys, but the call has L = {q_len}, S = {kv_len}"
            )

    def allowed(self, rows, cols, q_len, kv_len):
        cu_q, cu_k, shift = self._on(rows.device)
        seg_q, seg_k = _segment_of(cu_q, rows), _segment_of(cu_k, cols)
        position = rows - cu_q[seg_q] + shift[seg_q]  # the query's within its segment
        key = cols - cu_k[seg_k]
        allowed = seg_q == seg_k
        if self.causal:
            allowed = allowed & causal_allows(position, key)
        if self.window is not None:
            offset = key - position
            allowed = allowed & (offset >= -self.window[0]) & (offset <= self.window[1])
        return allowed

    def block_entries(self, q_len, kv_len, block_q, block_k):
        self.check_lengths(q_len, kv_len)
        cu_q, cu_k, shift = self._on("cpu")
        lengths_k = cu_k.diff()
        # the keys a query block may reach: from its first row's lowest key to its last
        # row's highest (both never decrease along the rows)
        first = torch.arange(num_blocks(q_len, block_q)) * block_q
        last = (first + block_q).clamp(max=q_len) - 1
        s_first = _segment_of(cu_q, first)
        s_last = _segment_of(cu_q, last)
        low = cu_k[s_first]
        if self.window is not None:
            reach = first - cu_q[s_first] + shift[s_first] - self.window[0]
            low = low + torch.minimum(reach.clamp(min=0), lengths_k[s_first])
        high = cu_k[s_last + 1]
        right = self._right()
        if right is not None:
            reach = last - cu_q[s_last] + shift[s_last] + right + 1
            high = cu_k[s_last] + torch.minimum(reach.clamp(min=0), lengths_k[s_last])
        block_low = low // block_k
        counts = torch.where(high > low, -(-high // block_k) - block_low, 0)
        qi = torch.arange(first.numel()).repeat_interleave(counts)
        offsets = counts.cumsum(0) - counts
        kj = (
            block_low.repeat_interleave(counts)
            + torch.arange(qi.numel())
            - (offsets.repeat_interleave(counts))
        )
        kind = self._kinds_of(qi, kj, q_len, kv_len, block_q, block_k)
        keep = kind != EMPTY
        return qi[keep], kj[keep], kind[keep]

    def _kinds_of(self, qi, kj, q_len, kv_len, block_q, block_k) -> Tensor:
        """The kind of each tile (qi, kj): FULL or EMPTY where it lies in one segment's
        block and that segment's causal rule and window say so, else PARTIAL."""
        cu_q, cu_k, shift = self._on("cpu")
        q0, k0 = qi * block_q, kj * block_k
        q1, k1 = (q0 + block_q).clamp(max=q_len), (k0 + block_k).clamp(max=kv_len)
        lo = torch.maximum(_segment_of(cu_q, q0), _segment_of(cu_k, k0))
        hi = torch.minimum(_segment_of(cu_q, q1 - 1), _segment_of(cu_k, k1 - 1))
        s = lo.clamp(max=self.num_segments - 1)
        r0, r1 = torch.maximum(q0, cu_q[s]), torch.minimum(q1, cu_q[s + 1])
        c0, c1 = torch.maximum(k0, cu_k[s]), torch.minimum(k1, cu_k[s + 1])
        # one segment meets the tile: its rows r0..r1-1 at positions p0..p1, keys j0..j1
        single = (lo == hi) & (r0 < r1) & (c0 < c1)
        p0, p1 = r0 - cu_q[s] + shift[s], r1 - 1 - cu_q[s] + shift[s]
        j0, j1 = c0 - cu_k[s], c1 - 1 - cu_k[s]
        full = (r0 == q0) & (r1 == q1) & (c0 == k0) & (c1 == k1)
        empty = torch.zeros_like(single)
        if self.causal:
            full &= causal_allows(p0, j1)
            empty |= ~causal_allows(p1, j0)
        if self.window is not None:
            left, right = self.window
            full &= (j0 >= p1 - left) & (j1 <= p0 + right)
            empty |= (j1 < p0 - left) | (j0 > p1 + right)
        kind = torch.full(qi.shape, PARTIAL, dtype=torch.int64)
        kind[(lo > hi) | ((lo == hi) & ~single) | (single & empty)] = EMPTY
        kind[single & full & ~empty] = FULL
        return kind

    def kinds(self, q_len, kv_len, block_q, block_k):
        qi, kj, kind = self.block_entries(q_len, kv_len, block_q, block_k)
        grid = torch.full(
            (num_blocks(q_len, block_q), num_blocks(kv_len, block_k)), EMPTY, dtype=torch.int8
        )
        grid[qi, kj] = kind.to(torch.int8)
        return grid

    def diagonal_pieces(self, q_len, kv_len):
        # without a window each sequence is one piece: all its keys, or (causal) those
        # before its first query's position and the square triangle of the rest
        if self.window is not None:
            return None
        self.check_lengths(q_len, kv_len)
        pieces = []
        starts_q, starts_k = self._starts_q, self._starts_k
        for s in range(self.num_segments):
            q0, q1, k0, k1 = starts_q[s], starts_q[s + 1], starts_k[s], starts_k[s + 1]
            if q1 == q0 or k1 == k0:
                continue
            if not self.causal:
                pieces.append((q0, q1, [(k0, k1, "full")]))
                continue
            shift = causal_shift(q1 - q0, k1 - k0)  # first query's position
            if shift >= 0:
                before = [(k0, k0 + shift, "full")] if shift else []
                pieces.append((q0, q1, [*before, (k0 + shift, k1, "lower")]))
            else:  # the first -shift queries see no key
                pieces.append((q0 - shift, q1, [(k0, k1, "lower")]))
        return pieces

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        # inside one segment, keys starting at the first row's position, the right edge
        # at the query (causal or right = 0) and the left edge never cutting in
        if self._right() != 0 or q1 <= q0:
            return False
        s = bisect.bisect_right(self._starts_q, q0) - 1
        starts_q, starts_k = self._starts_q, self._starts_k
        if q1 > starts_q[s + 1] or k0 < starts_k[s] or k1 > starts_k[s + 1]:
            return False
        position = (
            q0
            - starts_q[s]
            + causal_shift(starts_q[s + 1] - starts_q[s], starts_k[s + 1] - starts_k[s])
        )
        left = self.window[0] if self.window is not None else None
        return k0 - starts_k[s] == position and (left is None or q1 - q0 - 1 <= left)

    def __repr__(self) -> str:
        parts = [f"{self.num_segments} segments"]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        return f"Segments({', '.join(parts)})"
