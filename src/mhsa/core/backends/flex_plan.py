"""FlexAttention BlockMasks built from our block plans, in O(blocks).

torch's create_block_mask evaluates the mask_mod over the whole L x S grid (at L =
131072 that asks for 128 GiB), and a pattern's own elementwise rule does not always
lower under torch.compile (bigbird's random blocks and packed sequences' offsets make
Inductor fail). So a BlockMask is built here from the pattern's block kinds, and its
mask_mod only looks up data: a table (num_q_blocks, num_k_blocks) that names, for
every block, one of the bitmaps (BLOCK, BLOCK) of the partial blocks, or an all-False
or all-True one. Indexing a captured tensor is what every FlexAttention compiler
lowers; the bitmaps cost BLOCK * BLOCK bits per partial block, as many as the
allowed entries they hold at most.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from ..masks import FULL, PARTIAL, Pattern

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def ordered_blocks(marked: Tensor) -> tuple[Tensor, Tensor]:
    """A bool block grid (..., nq, nk) as FlexAttention's (num_blocks (..., nq) int32,
    indices (..., nq, nk) int32): each row's marked blocks first, in order, then the
    others (the order torch.nn.attention.flex_attention gives them)."""
    marked = marked.to(torch.int32)
    indices = torch.argsort(marked, dim=-1, descending=True, stable=True)
    return marked.sum(dim=-1).to(torch.int32), indices.to(torch.int32)


def block_mask_from_kinds(
    kinds: Tensor, mask_mod: MaskMod, q_len: int, kv_len: int, block: int, device
):
    """The BlockMask (batch and heads 1) of block kinds (nq, nk) (EMPTY / PARTIAL /
    FULL), whose partial blocks mask_mod decides element by element."""
    from torch.nn.attention.flex_attention import BlockMask

    grid = kinds.to(device).view(1, 1, *kinds.shape)
    kv_num, kv_indices = ordered_blocks(grid == PARTIAL)
    full_num, full_indices = ordered_blocks(grid == FULL)
    lengths = {"seq_lengths": (q_len, kv_len)} if _takes_seq_lengths() else {}
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        **lengths,
    )


def pattern_block_mask(pattern: Pattern, q_len: int, kv_len: int, block: int, device):
    """The BlockMask of a pattern (the causal rule already folded in, as
    masks.with_causal does): its block kinds, and a mask_mod that reads the bitmap of
    the block a (query, key) pair falls in, per sequence and head where the pattern
    differs by them."""
    kinds = pattern.kinds(q_len, kv_len, block, block)
    table, bitmaps = _bitmaps(pattern, kinds, q_len, kv_len, block, device)
    per_batch, per_head = bitmaps.shape[0] > 1, bitmaps.shape[1] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        which = table[q_idx // block, kv_idx // block]
        b, h = (b if per_batch else 0), (h if per_head else 0)
        return bitmaps[b, h, which, q_idx % block, kv_idx % block]

    return block_mask_from_kinds(kinds, mask_mod, q_len, kv_len, block, device)


def _bitmaps(
    pattern: Pattern, kinds: Tensor, q_len: int, kv_len: int, block: int, device
) -> tuple[Tensor, Tensor]:
    """(table int64 (nq, nk), bitmaps bool (B or 1, H or 1, n + 2, block, block)):
    bitmap i < n is the i-th partial block's (in row-major order), n is all False (empty
    blocks, and rows or keys past L or S), n + 1 all True (full blocks). The leading
    sizes are those the pattern's tiles vary over (a per-sequence or per-head mask)."""
    rows, cols = (kinds == PARTIAL).nonzero(as_tuple=True)
    count = len(rows)
    table = torch.full(kinds.shape, count, dtype=torch.int64)
    table[kinds == FULL] = count + 1
    table[rows, cols] = torch.arange(count)
    offsets = torch.arange(block)
    tiles, first = [], 0  # each row's (q0, q1, first, n, tile (B?, H?, q1 - q0, n * block))
    q_blocks, per_row = rows.unique_consecutive(return_counts=True)
    for row, n in zip(q_blocks.tolist(), per_row.tolist(), strict=True):  # a call a row
        k_blocks = cols[first : first + n]
        q0, q1 = row * block, min(row * block + block, q_len)
        keys = (k_blocks.view(-1, 1) * block + offsets).view(-1)  # (n * block,)
        tile = pattern.tile(q0, q1, keys.clamp(max=kv_len - 1).to(device), q_len, kv_len)
        tiles.append((q0, q1, first, n, tile.to("cpu") & (keys < kv_len)))
        first += n
    lead = torch.broadcast_shapes((1, 1), *(tuple(t.shape[:-2]) for *_, t in tiles))
    bitmaps = torch.zeros(*lead, count + 2, block, block, dtype=torch.bool)
    bitmaps[:, :, count + 1] = True
    for q0, q1, first, n, tile in tiles:
        tile = tile.expand(*lead, q1 - q0, n * block).unflatten(-1, (n, block))
        bitmaps[:, :, first : first + n, : q1 - q0] = tile.transpose(-3, -2)
    return table.to(device), bitmaps.to(device)


def _takes_seq_lengths() -> bool:
    """Whether this torch's BlockMask.from_kv_blocks takes seq_lengths (torch >= 2.6);
    without it, the lengths are read from the block counts."""
    from torch.nn.attention.flex_attention import BlockMask

    return "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters
