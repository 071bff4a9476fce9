"""SelectedBlocks: a query sees its own block causally plus chosen earlier blocks (MoBA).

Positions are cut into blocks of `block_size` (block b holds positions b * size ..
(b + 1) * size - 1, for queries and keys alike; queries sit bottom-right, at
i + S - L). A query at position p in block b attends the keys j <= p of block b and
every key of a block c < b where selected[..., b, c]. `selected` is data (MoBA
computes it from the queries and keys), so the block plan follows it: selected blocks
are FULL tiles, the own block a causal triangle, everything else is never visited.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import as_4d, int_at_least
from .base import Pattern
from .blocks import EMPTY, FULL, PARTIAL, num_blocks
from .causal import causal_shift, strictly_earlier


class SelectedBlocks(Pattern):
    """Own block causal plus the selected strictly earlier key blocks.

    selected: bool (n, n), (B, n, n) or (B, H, n, n) with n = ceil(S / block_size):
    selected[..., b, c] lets query block b attend key block c (only c < b counts).
    dense() is then (1 or B, 1 or H, L, S).
    """

    plain_values = False  # holds a tensor

    def __init__(self, selected: Tensor, block_size: int) -> None:
        if not isinstance(selected, Tensor) or selected.dtype != torch.bool:
            raise TypeError(f"selected must be a bool tensor (..., n, n), got {selected!r:.60}")
        if selected.dim() not in (2, 3, 4) or selected.shape[-1] != selected.shape[-2]:
            raise ValueError(
                f"selected must be (n, n), (B, n, n) or (B, H, n, n) bool, "
                f"got {tuple(selected.shape)}"
            )
        self.block_size = int_at_least("block_size", block_size, 1)
        lower = strictly_earlier(selected.shape[-1])
        selected = selected.cpu() & lower  # only strictly earlier blocks count
        self.batch_size = selected.shape[0] if selected.dim() > 2 else None
        if selected.dim() == 3:  # (B, n, n): one selection for every head of a sequence
            selected = selected.unsqueeze(1)
        self.selected = as_4d(selected)

    def of_heads(self, heads: Tensor) -> SelectedBlocks:
        if self.selected.shape[1] == 1:
            return self
        return SelectedBlocks(self.selected.index_select(1, heads.cpu()), self.block_size)

    def check_lengths(self, q_len: int, kv_len: int) -> None:
        n = num_blocks(kv_len, self.block_size)
        if self.selected.shape[-1] != n or q_len > kv_len:
            raise ValueError(
                f"selected covers {self.selected.shape[-1]} blocks of {self.block_size}, "
                f"but S = {kv_len} needs {n} (and L <= S; got L = {q_len})"
            )

    def allowed(self, rows: Tensor, cols: Tensor, q_len: int, kv_len: int) -> Tensor:
        pos = rows + causal_shift(q_len, kv_len)
        q_block, k_block = pos // self.block_size, cols // self.block_size
        own = (q_block == k_block) & (cols <= pos)
        chosen = self.selected.to(rows.device)[:, :, q_block, k_block]  # (B, H, R, C)
        return own | chosen

    def kinds(self, q_len: int, kv_len: int, block_q: int, block_k: int) -> Tensor:
        """Tile kinds from "atoms" of g = gcd(block_size, block_q, block_k, S - L)
        positions, each of one kind; conservative over batch and heads."""
        shift, size = causal_shift(q_len, kv_len), self.block_size
        atom = math.gcd(size, block_q, block_k, shift)
        n_atoms = num_blocks(kv_len, atom)
        start = torch.arange(n_atoms) * atom
        block = start // size  # the block of each atom (atoms never straddle one)
        diagonal = start.view(-1, 1) == start.view(1, -1)
        own = (block.view(-1, 1) == block.view(1, -1)) & (start.view(-1, 1) >= start.view(1, -1))
        own_kind = torch.where(diagonal, PARTIAL if atom > 1 else FULL, FULL)
        chosen = self.selected[:, :, block][:, :, :, block].flatten(0, 1)  # (N, atoms, atoms)
        kinds = torch.where(own, own_kind, torch.where(chosen, FULL, EMPTY)).to(torch.int8)
        kinds = kinds[:, shift // atom :]  # the query rows' atoms
        lo = _reduce(kinds, block_q // atom, block_k // atom, torch.amin, FULL).amin(0)
        hi = _reduce(kinds, block_q // atom, block_k // atom, torch.amax, EMPTY).amax(0)
        out = torch.full(lo.shape, PARTIAL, dtype=torch.int8)
        out[hi == EMPTY] = EMPTY
        out[lo == FULL] = FULL
        return out

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len) -> bool:
        # a square tile on the diagonal is exactly c <= r when every earlier block that
        # it spans is selected by every later one it spans
        if k0 != q0 + causal_shift(q_len, kv_len) or k1 - k0 != q1 - q0:
            return False
        first, last = k0 // self.block_size, (k1 - 1) // self.block_size
        span = self.selected[:, :, first : last + 1, first : last + 1]
        lower = strictly_earlier(span.shape[-1])
        return bool((span | ~lower).all())

    def __repr__(self) -> str:
        return f"SelectedBlocks(<{tuple(self.selected.shape)}>, {self.block_size})"


def _reduce(kinds: Tensor, rows: int, cols: int, op, pad: int) -> Tensor:
    """(N, R, C) atom kinds reduced by op over tiles of rows x cols atoms (padded with a
    value op ignores) -> (N, ceil(R / rows), ceil(C / cols))."""
    n, r, c = kinds.shape
    padded = F.pad(kinds, (0, num_blocks(c, cols) * cols - c, 0, num_blocks(r, rows) * rows - r))
    if pad != 0:  # F.pad fills zeros; redo the padding with the neutral value
        padded[:, r:, :] = pad
        padded[:, :, c:] = pad
    view = padded.view(n, padded.shape[1] // rows, rows, padded.shape[2] // cols, cols)
    return op(op(view, dim=4), dim=2)
