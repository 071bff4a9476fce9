"""Block plans: which (query block, key block) tiles the tiled engine visits, and how.

A mask source describes what may be attended, at two resolutions:
    block_kinds(q_len, kv_len, block_q, block_k) -> (num_q_blocks, num_k_blocks) int8
        EMPTY (never visited), PARTIAL (element mask applied), FULL (no mask applied),
        conservative over batch and heads (FULL only if full for every batch and head).
    tile(q0, q1, cols) -> bool (True = may attend) for query rows q0..q1-1 and the key
        indices cols (int64, 1-D), broadcastable to (B, H, q1-q0, len(cols))
and optionally
    lower_triangular(q0, q1, k0, k1) -> bool: the tile's mask is exactly c <= r
    upper_triangular(q0, q1, k0, k1) -> bool: the tile is square and its mask is c >= r
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
import torch.nn.functional as F
from torch import Tensor

from .causal import causal_allows, causal_shift

EMPTY, PARTIAL, FULL = 0, 1, 2


def _num_blocks(length: int, block: int) -> int:
    return -(-length // block)


def reduce_blocks(mask: Tensor, q_len: int, kv_len: int, block_q: int, block_k: int) -> Tensor:
    """Block kinds of a bool (..., L or 1, S or 1) mask, conservative over leading dims."""
    mask = mask.reshape(-1, *mask.shape[-2:])  # (N, L or 1, S or 1)
    rows, cols = mask.shape[1:]
    # a size-1 dimension is reduced as one block of size 1, then broadcast
    bq, bk = (block_q if rows > 1 else 1), (block_k if cols > 1 else 1)
    pad = (0, _num_blocks(cols, bk) * bk - cols, 0, _num_blocks(rows, bq) * bq - rows)
    # pad with values that change neither "any allowed" nor "all allowed"
    padded_any, padded_all = F.pad(mask, pad, value=False), F.pad(mask, pad, value=True)
    shape = (mask.shape[0], padded_any.shape[1] // bq, bq, padded_any.shape[2] // bk, bk)
    any_allowed = padded_any.view(shape).any(dim=4).any(dim=2).any(dim=0).cpu()
    all_allowed = padded_all.view(shape).all(dim=4).all(dim=2).all(dim=0).cpu()
    kinds = torch.full(any_allowed.shape, PARTIAL, dtype=torch.int8)
    kinds[~any_allowed] = EMPTY
    kinds[all_allowed] = FULL
    return kinds.expand(_num_blocks(q_len, block_q), _num_blocks(kv_len, block_k))


class DenseMask:
    """A bool tensor (..., L, S), True = may attend."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask

    def block_kinds(self, q_len: int, kv_len: int, block_q: int, block_k: int) -> Tensor:
        return reduce_blocks(self.mask, q_len, kv_len, block_q, block_k)

    def tile(self, q0: int, q1: int, cols: Tensor) -> Tensor:
        rows = self.mask if self.mask.shape[-2] == 1 else self.mask[..., q0:q1, :]
        return rows if rows.shape[-1] == 1 else rows.index_select(-1, cols)


class CausalMask:
    """Causal attention aligned bottom-right: query i sees keys j <= i + S - L."""

    def __init__(self, q_len: int, kv_len: int, device: torch.device) -> None:
        self.shift = causal_shift(q_len, kv_len)
        self.device = device

    def block_kinds(self, q_len: int, kv_len: int, block_q: int, block_k: int) -> Tensor:
        q_first = torch.arange(0, q_len, block_q).clamp(max=q_len - 1)
        q_last = (q_first + block_q - 1).clamp(max=q_len - 1)
        k_first = torch.arange(0, kv_len, block_k)
        k_last = (k_first + block_k - 1).clamp(max=kv_len - 1)
        # a tile is full if its first row sees its last key, empty if its last row
        # sees none of its keys
        full = causal_allows(q_first.view(-1, 1) + self.shift, k_last.view(1, -1))
        empty = ~causal_allows(q_last.view(-1, 1) + self.shift, k_first.view(1, -1))
        kinds = torch.full(full.shape, PARTIAL, dtype=torch.int8)
        kinds[full] = FULL
        kinds[empty] = EMPTY
        return kinds

    def lower_triangular(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether the tile's mask is exactly local key c <= local row r."""
        return k0 == q0 + self.shift

    def tile(self, q0: int, q1: int, cols: Tensor) -> Tensor:
        rows = torch.arange(q0, q1, device=cols.device).view(-1, 1)
        return causal_allows(rows + self.shift, cols.view(1, -1))


class AllOf:
    """The intersection of mask sources (a key is allowed if every source allows it)."""

    def __init__(self, *sources) -> None:
        self.sources = sources

    def block_kinds(self, q_len: int, kv_len: int, block_q: int, block_k: int) -> Tensor:
        kinds = [s.block_kinds(q_len, kv_len, block_q, block_k) for s in self.sources]
        return torch.stack(kinds).amin(dim=0)  # EMPTY < PARTIAL < FULL

    def tile(self, q0: int, q1: int, cols: Tensor) -> Tensor:
        tiles = [s.tile(q0, q1, cols) for s in self.sources]
        result = tiles[0]
        for t in tiles[1:]:
            result = result & t
        return result


def mask_source(mask, causal: bool, q_len: int, kv_len: int, device):
    """The mask source for a call's mask (a bool tensor, or a pattern that binds itself
    with .source) and causal flag; None when everything is allowed."""
    sources = []
    if isinstance(mask, Tensor):
        sources.append(DenseMask(mask))
    elif mask is not None:
        sources.append(mask.source(q_len, kv_len, device))
    if causal:
        sources.append(CausalMask(q_len, kv_len, device))
    if not sources:
        return None
    return sources[0] if len(sources) == 1 else AllOf(*sources)


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
    source: object | None  # the mask source that gives element masks of partial runs
    # (left, right) when the whole mask is a sliding window (query at position p
    # attends keys p - left .. p + right): the fused engine then runs the band's
    # interior in one strided call (kernels/band.py) and the plan's rows only at its edges
    band: tuple[int, int] | None = None

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


def build_plan(
    source,
    q_len: int,
    kv_len: int,
    *,
    block_q: int,
    block_k: int,
    max_run_keys: int | None = None,
    merge_rows: bool = True,
    gather: bool = False,
) -> BlockPlan:
    """Turn a mask source (or None for full attention) into a BlockPlan.

    max_run_keys caps a run's length (bounds the scores a plain tile materialises);
    merge_rows joins adjacent query blocks whose runs are identical and all full, and
    makes a wholly lower-triangular mask a single causal run; gather puts all of a
    row's blocks into one run. The last two suit kernels that tile internally and pay
    per call.
    """
    num_q = _num_blocks(q_len, block_q)
    num_k = _num_blocks(kv_len, block_k)
    if merge_rows and _triangle(source, 0, q_len, 0, kv_len) == "lower":
        # the whole matrix is one lower-triangular tile: one call in causal mode
        whole = [RowRange(0, q_len, [Run(0, kv_len, False, "lower")])]
        return BlockPlan(q_len, kv_len, block_q, block_k, whole, source)
    if source is None:  # plain lists: torch.compile traces them without reading a tensor
        kinds = [[FULL] * num_k for _ in range(num_q)]
    else:
        kinds = source.block_kinds(q_len, kv_len, block_q, block_k).tolist()
    cap_blocks = max(1, max_run_keys // block_k) if max_run_keys else num_k
    rows: list[RowRange] = []
    for qi, row in enumerate(kinds):
        q0, q1 = qi * block_q, min(q_len, (qi + 1) * block_q)
        if gather:
            runs = _gathered_runs(source, q0, q1, row, block_k, kv_len)
        else:
            runs = [
                _with_triangle(source, q0, q1, run)
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
    return BlockPlan(q_len, kv_len, block_q, block_k, rows, source)


def _runs(row: list[int], block_k: int, kv_len: int, cap_blocks: int) -> list[Run]:
    """Contiguous key blocks of one kind (EMPTY skipped), at most cap_blocks long."""
    runs: list[Run] = []
    start = None
    for kj, kind in enumerate(row + [EMPTY]):
        if start is not None and (kind != row[start] or kj - start == cap_blocks):
            runs.append(Run(start * block_k, min(kv_len, kj * block_k), row[start] == FULL))
            start = None
        if start is None and kind != EMPTY and kj < len(row):
            start = kj
    return runs


def _triangle(source, q0: int, q1: int, k0: int, k1: int) -> str | None:
    """ "lower" or "upper" if the source says the tile's mask is that triangle."""
    lower = getattr(source, "lower_triangular", None)
    if lower is not None and lower(q0, q1, k0, k1):
        return "lower"
    upper = getattr(source, "upper_triangular", None)
    if upper is not None and upper(q0, q1, k0, k1):
        return "upper"
    return None


def _with_triangle(source, q0: int, q1: int, run: Run) -> Run:
    if run.full or run.blocks is not None:
        return run
    triangle = _triangle(source, q0, q1, run.k0, run.k1)
    return Run(run.k0, run.k1, False, triangle) if triangle else run


def _gathered_runs(source, q0: int, q1: int, row: list[int], block_k: int, kv_len: int):
    """Few runs for the row: its triangular PARTIAL blocks one each (unmasked in causal
    mode), then all its FULL blocks as one run and all other PARTIAL blocks as one
    masked run, gathered when they are not adjacent."""
    runs, full, partial = [], [], []
    for kj, kind in enumerate(row):
        if kind == FULL:
            full.append(kj)
        elif kind == PARTIAL:
            k0, k1 = kj * block_k, min(kv_len, (kj + 1) * block_k)
            triangle = _triangle(source, q0, q1, k0, k1)
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
