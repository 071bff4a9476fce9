"""Which ranks a call visits and which (query piece, key piece) blocks it computes.

Each chunk is cut into pieces (PIECES_PER_SHARD per shard, none shorter than
MIN_PIECE), and a block is one (query piece, key piece) pair; computing piece by piece
keeps the engine's gradient temporaries a fraction of a shard. The mask (causal and/or
an mhsa.core.masks pattern, in global positions) is reduced once to piece resolution: an
EMPTY block is never computed, and ranks that no rank needs are never visited.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.backends.flash_plan import FUSED_BLOCK, plan_for
from ..core.kernels.plan import BlockPlan
from ..core.kernels.scored import Shifted
from ..core.masks import EMPTY, FULL, Pattern
from ..core.masks.blocks import reduce_blocks
from ..core.scores import ScoreFunction
from .layout import rank_chunks, rank_pieces
from .transfer import Ring

PIECES_PER_SHARD = 8  # blocks are computed piece by piece: smaller gradient temporaries
MIN_PIECE = 128  # but never on pieces shorter than this


def split_pieces(chunk: int, layout: str) -> int:
    """Into how many pieces each chunk is cut."""
    for split in range(PIECES_PER_SHARD // len(rank_chunks(0, 1, layout)), 1, -1):
        if chunk % split == 0 and chunk // split >= MIN_PIECE:
            return split
    return 1


def tile_block(piece: int, hint: int | None) -> int:
    """The engine's tile size for pieces of this length: the pattern's hint, else the
    largest divisor of the piece in [32, FUSED_BLOCK] (so tiles align with piece
    offsets), else FUSED_BLOCK."""
    if hint:
        return hint
    if piece <= FUSED_BLOCK:
        return piece
    for block in range(FUSED_BLOCK, 31, -1):
        if piece % block == 0:
            return block
    return FUSED_BLOCK


class BlockMask(Pattern):
    """A global pattern seen from one (query piece, key piece) block, with the key
    piece's padding mask: local query i, key j are global q_start + i, k_start + j."""

    def __init__(self, pattern, q_start, k_start, total, keys, block, global_kinds) -> None:
        self.pattern, self.q_start, self.k_start, self.total = pattern, q_start, k_start, total
        self.keys = keys  # (B, piece) bool or None
        self.block_size = block
        self.global_kinds = global_kinds  # (bq, bk) -> kinds of the pattern on (L, L)
        self.batch_size = keys.shape[0] if keys is not None else None

    def allowed(self, rows, cols, q_len, kv_len):
        mask = None
        if self.pattern is not None:
            mask = self.pattern.allowed(
                rows + self.q_start, cols + self.k_start, self.total, self.total
            )
        if self.keys is not None:
            real = self.keys.to(cols.device)[:, cols.flatten()]
            real = real.view(self.keys.shape[0], 1, 1, -1)
            mask = real if mask is None else mask & real
        return mask

    def kinds(self, q_len, kv_len, block_q, block_k):
        if self.pattern is not None and (self.q_start % block_q or self.k_start % block_k):
            return super().kinds(q_len, kv_len, block_q, block_k)  # unaligned: reduce
        shape = (-(-q_len // block_q), -(-kv_len // block_k))
        kinds = torch.full(shape, FULL, dtype=torch.int8)
        if self.pattern is not None:
            # a local tile lies inside the global tile at the same block index: global
            # FULL or EMPTY hold for it too (the last, shorter tile included)
            qb, kb = self.q_start // block_q, self.k_start // block_k
            kinds = self.global_kinds(block_q, block_k)[qb : qb + shape[0], kb : kb + shape[1]]
        if self.keys is not None:
            real = self.keys.view(self.keys.shape[0], 1, 1, -1).cpu()
            kinds = torch.minimum(kinds, reduce_blocks(real, q_len, kv_len, block_q, block_k))
        return kinds

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        if self.keys is not None or self.pattern is None:
            return False
        qs, ks, total = self.q_start, self.k_start, self.total
        return self.pattern.lower_triangular(q0 + qs, q1 + qs, k0 + ks, k1 + ks, total, total)

    def upper_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        if self.keys is not None or self.pattern is None:
            return False
        qs, ks, total = self.q_start, self.k_start, self.total
        return self.pattern.upper_triangular(q0 + qs, q1 + qs, k0 + ks, k1 + ks, total, total)


def visit_order(world: int, layout: str, piece_kinds: Tensor, split: int) -> list[int]:
    """Source offsets to visit, in order: at step i rank r holds the K/V shard of rank
    (r + offsets[i]) % world. 0 first (its own shard), then the others descending, so
    shards arrive from the previous rank; offsets no rank needs are left out."""
    owner = torch.empty(piece_kinds.shape[0], dtype=torch.long)  # the rank of each piece
    for rank in range(world):
        owner[rank_pieces(rank, world, layout, split)] = rank
    q_piece, k_piece = (piece_kinds != EMPTY).nonzero(as_tuple=True)
    needed = set(((owner[k_piece] - owner[q_piece]) % world).tolist()) - {0}
    return [0] + sorted(needed, reverse=True)


@dataclass
class Setup:
    ring: Ring
    layout: str
    split: int  # pieces per chunk
    piece: int  # positions per piece
    total: int  # L, the whole sequence
    pattern: Pattern | None  # causal and mask, in global positions
    piece_kinds: Tensor  # (num_pieces, num_pieces) EMPTY/PARTIAL/FULL
    schedule: list[int]
    scale: float
    fused: bool
    block: int
    score: ScoreFunction | None = None  # in global positions
    _kinds_cache: dict = field(default_factory=dict)

    def global_kinds(self, block_q: int, block_k: int) -> Tensor:
        key = (block_q, block_k)
        if key not in self._kinds_cache:
            self._kinds_cache[key] = self.pattern.block_layout(
                self.total, self.total, block_q, block_k
            )
        return self._kinds_cache[key]

    def blocks(
        self, src: int, keys: Tensor | None, device: torch.device
    ) -> list[tuple[slice, slice, BlockPlan, ScoreFunction | None]]:
        """(local query rows, local key rows, plan, score function) of every block of
        this rank's queries against src's shard that is not EMPTY; the score function
        sees the block's rows and keys at their global positions."""
        ring, piece = self.ring, self.piece
        out = []
        q_pieces = rank_pieces(ring.rank, ring.world, self.layout, self.split)
        k_pieces = rank_pieces(src, ring.world, self.layout, self.split)
        for i, pq in enumerate(q_pieces):
            for j, pk in enumerate(k_pieces):
                kind = int(self.piece_kinds[pq, pk])
                if kind == EMPTY:
                    continue
                rows, cols = slice(i * piece, (i + 1) * piece), slice(j * piece, (j + 1) * piece)
                key_piece = None if keys is None else keys[:, cols].bool()
                mask = None
                if kind != FULL or key_piece is not None:
                    pattern = None if kind == FULL else self.pattern
                    mask = BlockMask(
                        pattern,
                        pq * piece,
                        pk * piece,
                        self.total,
                        key_piece,
                        self.block,
                        self.global_kinds,
                    )
                scored = self.score is not None
                plan = plan_for(mask, False, piece, piece, device, self.fused, self.score)
                score = Shifted(self.score, pq * piece, pk * piece) if scored else None
                out.append((rows, cols, plan, score))
        return out
