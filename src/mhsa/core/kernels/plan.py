"""Block plans: which (query block, key block) tiles the tiled engine visits, and how.

A plan is built from what may attend: an mhsa.core.masks pattern (the call's mask and
causality as one, masks.with_causal), or None when everything may. The plan asks the
pattern, whatever its kind:
    block_entries(L, S, block_q, block_k) -> (query block, key block, kind) of the
        blocks that are not EMPTY (never visited): PARTIAL (element mask applied) or
        FULL (no mask applied), conservative over batch and heads (FULL only if full
        for every batch and head); by default read from kinds(L, S, block_q, block_k),
        the (num_q_blocks, num_k_blocks) grid, which packed sequences never build, so
        planning costs what the visited blocks cost.
    tile(q0, q1, cols, L, S) -> bool (True = may attend) for query rows q0..q1-1 and
        the key indices cols (int64, 1-D), broadcastable to (B, H, q1-q0, len(cols))
    lower_triangular(q0, q1, k0, k1, L, S) -> bool: the tile's mask is exactly c <= r
    upper_triangular(q0, q1, k0, k1, L, S) -> bool: the tile is square and its mask is
        exactly c >= r
(r, c: row and key index within the tile), which kernels compute in causal mode.

A BlockPlan turns the block kinds into work: for each range of query rows, a list of
key runs: contiguous key ranges of one kind or, for kernels that pay per call, few
runs per row (triangular tiles, all FULL blocks, all other PARTIAL blocks; gathered
when not adjacent). Query block rows whose runs are all FULL and identical merge,
so dense attention is one run over everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..masks.blocks import FULL, PARTIAL, num_blocks


@dataclass(frozen=True)
class Run:
    """Keys k0..k1-1 for one range of query rows; full runs need no element mask.

    blocks, when set, makes a gathered run: only those key blocks (of the plan's
    block_k), which need not be adjacent; k0..k1 then spans them. triangle marks a
    partial run whose mask is exactly "local key c <= local row r" ("lower") or
    "c >= r" on a square tile ("upper"), which a kernel may compute in its causal
    mode (on flipped rows and keys for "upper") instead of applying the mask.
    """

    k0: int
    k1: int
    full: bool
    triangle: str | None = None
    blocks: tuple[int, ...] | None = None

    def key_index(self, block_k: int, device) -> Tensor | None:
        """The key indices of a gathered run (int64), or None for a contiguous one."""
        if self.blocks is None:
            return None
        starts = torch.tensor(self.blocks, device=device).mul_(block_k).view(-1, 1)
        index = (starts + torch.arange(block_k, device=device)).flatten()
        return index[index < self.k1]

    def num_keys(self, block_k: int) -> int:
        if self.blocks is None:
            return self.k1 - self.k0
        return len(self.blocks) * block_k - max(0, (self.blocks[-1] + 1) * block_k - self.k1)


@dataclass
class RowRange:
    q0: int
    q1: int
    runs: list[Run] = field(default_factory=list)


@dataclass
class BlockPlan:
    """The engine's input: the row ranges to compute and, for each, its key runs."""

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    rows: list[RowRange]
    pattern: object | None  # what may attend (an mhsa.core.masks.Pattern), None for all
    # (left, right) when the whole mask is a sliding window (query at position p
    # attends keys p - left .. p + right): the fused engine then runs the band's
    # interior in one strided call (kernels/band.py) and the plan's rows only at its edges
    band: tuple[int, int] | None = None

    def tile(self, q0: int, q1: int, cols: Tensor) -> Tensor:
        """The element mask of a partial run's rows q0..q1-1 and keys cols."""
        return self.pattern.tile(q0, q1, cols, self.q_len, self.kv_len)

    @property
    def visited_fraction(self) -> float:
        """Fraction of the L x S entries computed (triangular runs count their triangle)."""
        area = 0
        for r in self.rows:
            for run in r.runs:
                rows, keys = r.q1 - r.q0, run.num_keys(self.block_k)
                if run.triangle:  # row i computes min(i + 1, keys) entries (or mirrored)
                    tri = min(rows, keys)
                    area += tri * (tri + 1) // 2 + (rows - tri) * keys
                else:
                    area += rows * keys
        return area / max(1, self.q_len * self.kv_len)


_PIECE_TRIANGLE = {"full": None, "lower": "lower"}  # a diagonal piece's kind as a Run's


def build_plan(
    pattern,
    q_len: int,
    kv_len: int,
    *,
    block_q: int,
    block_k: int,
    max_run_keys: int | None = None,
    merge_rows: bool = True,
    gather: bool = False,
) -> BlockPlan:
    """Turn a pattern (or None for full attention) into a BlockPlan.

    max_run_keys caps a run's length (bounds the scores an unfused tile materialises);
    merge_rows joins adjacent query blocks whose runs are identical and all full, makes
    a wholly lower-triangular mask a single causal run and a pattern's diagonal pieces
    (packed sequences) one run each; gather puts all of a
    row's blocks into one run. The last two suit kernels that tile internally and pay
    per call.
    """
    if pattern is not None:
        pattern.check_lengths(q_len, kv_len)
    num_k = num_blocks(kv_len, block_k)
    if merge_rows and _triangle(pattern, q_len, kv_len, 0, q_len, 0, kv_len) == "lower":
        # the whole matrix is one lower-triangular tile: one call in causal mode
        whole = [RowRange(0, q_len, [Run(0, kv_len, False, "lower")])]
        return BlockPlan(q_len, kv_len, block_q, block_k, whole, pattern)
    pieces = pattern.diagonal_pieces(q_len, kv_len) if merge_rows and pattern else None
    if pieces is not None:  # one call per piece, none with an element mask
        rows = [
            RowRange(
                q0,
                q1,
                [Run(k0, k1, kind == "full", _PIECE_TRIANGLE[kind]) for k0, k1, kind in runs],
            )
            for q0, q1, runs in pieces
        ]
        return BlockPlan(q_len, kv_len, block_q, block_k, rows, pattern)
    cap_blocks = max(1, max_run_keys // block_k) if max_run_keys else num_k
    rows: list[RowRange] = []
    for qi, row in enumerate(_row_entries(pattern, q_len, kv_len, block_q, block_k)):
        q0, q1 = qi * block_q, min(q_len, (qi + 1) * block_q)
        if gather:
            runs = _gathered_runs(pattern, q_len, q0, q1, row, block_k, kv_len)
        else:
            runs = [
                _with_triangle(pattern, q_len, kv_len, q0, q1, run)
                for run in _runs(row, block_k, kv_len, cap_blocks)
            ]
        previous = rows[-1] if rows else None
        if (
            merge_rows
            and previous is not None
            and previous.runs == runs
            and all(run.full for run in runs)
        ):
            previous.q1 = q1
        else:
            rows.append(RowRange(q0, q1, runs))
    return BlockPlan(q_len, kv_len, block_q, block_k, rows, pattern)


def _row_entries(pattern, q_len: int, kv_len: int, block_q: int, block_k: int):
    """Per query block, its blocks that are not EMPTY as a list of (key block, kind), in
    key order; built from the pattern's block_entries, so that the work follows the
    visited blocks, not the (query blocks x key blocks) grid."""
    num_q, num_k = num_blocks(q_len, block_q), num_blocks(kv_len, block_k)
    if pattern is None:  # plain lists: torch.compile traces them without reading a tensor
        return [[(kj, FULL) for kj in range(num_k)] for _ in range(num_q)]
    qi, kj, kind = pattern.block_entries(q_len, kv_len, block_q, block_k)
    counts = torch.bincount(qi, minlength=num_q).tolist() if qi.numel() else [0] * num_q
    pairs = list(zip(kj.tolist(), kind.tolist(), strict=True))
    rows, start = [], 0
    for count in counts:
        rows.append(pairs[start : start + count])
        start += count
    return rows


def _runs(row: list[tuple[int, int]], block_k: int, kv_len: int, cap_blocks: int) -> list[Run]:
    """Runs of adjacent key blocks of one kind, at most cap_blocks long, from a row's
    (key block, kind) entries (EMPTY blocks are absent)."""
    runs: list[Run] = []
    start = last = kind0 = None
    for kj, kind in row:
        if start is not None and (kj != last + 1 or kind != kind0 or kj - start == cap_blocks):
            runs.append(Run(start * block_k, min(kv_len, (last + 1) * block_k), kind0 == FULL))
            start = None
        if start is None:
            start, kind0 = kj, kind
        last = kj
    if start is not None:
        runs.append(Run(start * block_k, min(kv_len, (last + 1) * block_k), kind0 == FULL))
    return runs


def _triangle(pattern, q_len: int, kv_len: int, q0: int, q1: int, k0: int, k1: int):
    """ "lower" or "upper" if the pattern says the tile's mask is that triangle."""
    if pattern is None:
        return None
    if pattern.lower_triangular(q0, q1, k0, k1, q_len, kv_len):
        return "lower"
    if pattern.upper_triangular(q0, q1, k0, k1, q_len, kv_len):
        return "upper"
    return None


def _with_triangle(pattern, q_len: int, kv_len: int, q0: int, q1: int, run: Run) -> Run:
    if run.full or run.blocks is not None:
        return run
    triangle = _triangle(pattern, q_len, kv_len, q0, q1, run.k0, run.k1)
    return Run(run.k0, run.k1, False, triangle) if triangle else run


def _gathered_runs(
    pattern, q_len: int, q0: int, q1: int, row: list[tuple[int, int]], block_k: int, kv_len: int
):
    """Few runs for the row: its triangular PARTIAL blocks one each (unmasked in causal
    mode), then all its FULL blocks as one run and all other PARTIAL blocks as one
    masked run, gathered when they are not adjacent."""
    runs, full, partial = [], [], []
    for kj, kind in row:
        if kind == FULL:
            full.append(kj)
        elif kind == PARTIAL:
            k0, k1 = kj * block_k, min(kv_len, (kj + 1) * block_k)
            triangle = _triangle(pattern, q_len, kv_len, q0, q1, k0, k1)
            if triangle:
                runs.append(Run(k0, k1, False, triangle))
            else:
                partial.append(kj)
    for blocks, is_full in ((full, True), (partial, False)):
        if blocks:
            k0, k1 = blocks[0] * block_k, min(kv_len, (blocks[-1] + 1) * block_k)
            adjacent = blocks[-1] - blocks[0] + 1 == len(blocks)
            runs.append(Run(k0, k1, is_full, blocks=None if adjacent else tuple(blocks)))
    return runs
