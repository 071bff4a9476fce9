"""FlexAttention's BlockMask on mhsa's engine: `create_block_mask`, and the pattern a
BlockMask lowers to.

A BlockMask (torch.nn.attention.flex_attention.BlockMask; `create_block_mask` here
builds that same class) says, per (batch, head, query block), which key blocks are
partial (kv_num_blocks, kv_indices: mask_mod decides each entry) and which are full
(full_kv_num_blocks, full_kv_indices: every entry may attend, mask_mod is skipped);
every other block is skipped, whatever mask_mod would say (as FlexAttention's compiled
kernels do). `BlockMaskPattern` is that as an mhsa.core.masks pattern: its block kinds
come from the index tensors, so the flash engine never visits a skipped block and
applies no mask in a full one, and in partial blocks it calls mask_mod on
broadcastable index tensors (no vmap), one tile at a time.

mask_mod(b, h, q_idx, kv_idx) gets int64 index tensors shaped (B, 1, 1, 1),
(1, H, 1, 1), (1, 1, rows, 1) and (1, 1, 1, keys), with q_idx and kv_idx counted
from 0 in the query and in the key (FlexAttention's indices, not mhsa's bottom-right
positions), and returns a bool tensor that broadcasts to (B, H, rows, keys).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.backends.flex_plan import ordered_blocks
from ..core.checks import as_4d, int_at_least
from ..core.masks import EMPTY, FULL, PARTIAL, Band, Pattern, SlidingWindow
from ..core.masks.base import block_ranges
from ..core.masks.blocks import num_blocks

DEFAULT_BLOCK = 128  # FlexAttention's default BLOCK_SIZE
# create_block_mask evaluates mask_mod on chunks of at most this many (b, h, q, kv) entries
CHUNK_ENTRIES = 1 << 22
# the BLOCK_SIZE of the BlockMask FlexAttention makes when given none: one block, no mask
_NOOP_BLOCK = 1 << 30

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def flex_module():
    """torch.nn.attention.flex_attention (torch >= 2.5)."""
    from torch.nn.attention import flex_attention

    return flex_attention


def _default_device() -> torch.device:
    """CUDA where a GPU is usable, else the CPU. torch's default is "cuda" whether or
    not a GPU is there, which fails on a CPU-only machine (a CUDA build of torch
    included); code that names its device behaves as with torch."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _block_sizes(block_size) -> tuple[int, int]:
    """BLOCK_SIZE as (query block, key block)."""
    sizes = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(sizes) != 2:
        raise ValueError(f"BLOCK_SIZE must be an int or a pair of ints, got {block_size!r}")
    for size in sizes:
        int_at_least("BLOCK_SIZE", size, 1)
    return sizes


def evaluate_mask_mod(mask_mod: MaskMod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor):
    """mask_mod on index tensors b (B,1,1,1), h (1,H,1,1), q_idx (1,1,rows,1) and kv_idx
    (1,1,1,keys), as a 4-d bool tensor broadcastable to (B, H, rows, keys); ValueError
    naming mask_mod when it fails or returns something else."""
    if getattr(mask_mod, "__name__", "") == "_sliced_mask_mod_error":
        raise ValueError(
            "block_mask was sliced (block_mask[...]), which resets its mask_mod: set "
            "sliced.mask_mod to the original BlockMask's mask_mod"
        )
    try:
        allowed = mask_mod(b, h, q_idx, kv_idx)
    except Exception as error:
        raise ValueError(
            f"mask_mod failed on index tensors: {type(error).__name__}: {error}. mhsa calls "
            "mask_mod(b, h, q_idx, kv_idx) once per tile with int64 index tensors that "
            "broadcast ((B,1,1,1), (1,H,1,1), (1,1,rows,1), (1,1,1,keys)), not under vmap: "
            "write it with torch ops (&, |, torch.where), not Python `and`, `or` or `if`"
        ) from error
    shape = (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3])  # what they span
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
        raise ValueError(f"mask_mod must return a bool tensor (True = may attend), got {got}")
    if allowed.dim() > 4 or any(
        size not in (1, want)
        for size, want in zip(reversed(allowed.shape), reversed(shape), strict=False)
    ):
        raise ValueError(
            f"mask_mod returned shape {tuple(allowed.shape)}, which does not broadcast to "
            f"its indices' {shape}: it must be elementwise in (b, h, q_idx, kv_idx)"
        )
    return as_4d(allowed)


def _block_counts(
    mask_mod: MaskMod,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    blocks: tuple[int, int],
    device,
) -> Tensor:
    """Allowed entries of each block, int64 (batch or 1, heads or 1, num_q_blocks,
    num_k_blocks), from mask_mod evaluated on chunks of whole blocks (at most about
    CHUNK_ENTRIES entries each, never the whole L x S); entries past the lengths count
    as not allowed, as in FlexAttention."""
    block_q, block_k = blocks
    nq, nk = num_blocks(q_len, block_q), num_blocks(kv_len, block_k)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    per_row_block = batch * heads * block_q * block_k  # entries of one block, all heads
    k_step = max(1, min(nk, CHUNK_ENTRIES // per_row_block))  # key blocks per chunk
    q_step = max(1, min(nq, CHUNK_ENTRIES // (per_row_block * k_step)))  # query blocks
    counts = None
    for qi in range(0, nq, q_step):
        q0, q1 = qi * block_q, min(q_len, (qi + q_step) * block_q)
        q_idx = torch.arange(q0, q1, device=device).view(1, 1, -1, 1)
        for ki in range(0, nk, k_step):
            k0, k1 = ki * block_k, min(kv_len, (ki + k_step) * block_k)
            kv_idx = torch.arange(k0, k1, device=device).view(1, 1, 1, -1)
            allowed = evaluate_mask_mod(mask_mod, b, h, q_idx, kv_idx)
            allowed = allowed.expand(*allowed.shape[:2], q1 - q0, k1 - k0)
            rows, cols = num_blocks(q1 - q0, block_q), num_blocks(k1 - k0, block_k)
            pad = (0, cols * block_k - (k1 - k0), 0, rows * block_q - (q1 - q0))
            padded = F.pad(allowed, pad, value=False)
            chunk = padded.reshape(*padded.shape[:2], rows, block_q, cols, block_k)
            chunk = chunk.sum(dim=(3, 5))
            lead = chunk.shape[:2] if counts is None else counts.shape[:2]
            lead = torch.broadcast_shapes(chunk.shape[:2], lead)
            if counts is None or counts.shape[:2] != lead:  # mask_mod varies over b or h
                grown = torch.zeros(*lead, nq, nk, dtype=torch.int64, device=device)
                counts = grown if counts is None else grown.add_(counts)
            counts[:, :, qi : qi + rows, ki : ki + cols] += chunk
    return counts


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK,
    _compile: bool = False,
    separate_full_blocks: bool = True,
):
    """FlexAttention's `create_block_mask`, without vmap and without an L x S mask.

    Args:
        mask_mod: mask_mod(b, h, q_idx, kv_idx) -> bool, True = may attend; q_idx and
            kv_idx count from 0 in the query and the key. Called with broadcastable
            int64 index tensors ((B,1,1,1), (1,H,1,1), (1,1,rows,1), (1,1,1,keys)) on
            chunks of whole blocks, so it must be written with torch ops.
        B, H: batch size and query heads the mask varies over; None for a mask the
            same for every sequence (head): mask_mod then sees b = 0 (h = 0).
        Q_LEN, KV_LEN: query and key lengths L and S.
        device: where the BlockMask's tensors live (default: "cuda" where a GPU is
            usable, else "cpu"; torch's default, "cuda", fails without a GPU).
        BLOCK_SIZE: block size, or (query block, key block); 128 by default.
        _compile: torch's (it compiles its mask builder); taken and unused: nothing
            here is compiled or needs to be.
        separate_full_blocks: list fully allowed blocks as full (mask_mod skipped on
            them); False lists every non-empty block as partial.

    Returns:
        a torch.nn.attention.flex_attention.BlockMask equal, field by field, to the one
        torch's create_block_mask builds; usable by mhsa.flex.flex_attention and by
        torch's flex_attention alike.
    """
    if not callable(mask_mod):
        raise TypeError(
            f"mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx), got "
            f"{type(mask_mod).__name__}"
        )
    batch = 1 if B is None else int_at_least("B", B, 1, " or None")
    heads = 1 if H is None else int_at_least("H", H, 1, " or None")
    int_at_least("Q_LEN", Q_LEN, 1)
    int_at_least("KV_LEN", KV_LEN, 1)
    blocks = _block_sizes(BLOCK_SIZE)
    device = _default_device() if device is None else torch.device(device)
    counts = _block_counts(mask_mod, batch, heads, Q_LEN, KV_LEN, blocks, device)
    counts = counts.expand(batch, heads, *counts.shape[2:])
    if separate_full_blocks:
        full = counts == blocks[0] * blocks[1]
        partial = (counts > 0) & ~full
        full_num, full_indices = ordered_blocks(full)
    else:
        partial, full_num, full_indices = counts > 0, None, None
    kv_num, kv_indices = ordered_blocks(partial)
    return flex_module().BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=blocks,
        mask_mod=mask_mod,
        seq_lengths=(Q_LEN, KV_LEN),
    )


def is_noop(block_mask) -> bool:
    """Whether block_mask is FlexAttention's "no mask" (one block of 2**30)."""
    return tuple(block_mask.BLOCK_SIZE) == (_NOOP_BLOCK, _NOOP_BLOCK)


def _listed(block_mask, name: str) -> tuple[Tensor, Tensor]:
    """(num_blocks (Bm, Hm, rows), indices (Bm, Hm, rows, slots)) of the `name` ("kv" or
    "full_kv") lists, as int64 on the CPU."""
    counts, indices = (
        getattr(block_mask, f"{name}_num_blocks"),
        getattr(block_mask, f"{name}_indices"),
    )
    if indices.dim() < 2 or indices.dim() > 4 or tuple(counts.shape) != tuple(indices.shape[:-1]):
        raise ValueError(
            f"block_mask.{name}_indices must be ([B, [H,]] rows, slots) with {name}_num_blocks "
            f"of its shape less the last, got {tuple(indices.shape)} and {tuple(counts.shape)}"
        )
    lead = (1,) * (4 - indices.dim())
    return counts.view(*lead, *counts.shape).cpu().long(), indices.view(
        *lead, *indices.shape
    ).cpu().long()


def block_kinds(block_mask, num_q: int, num_k: int) -> Tensor:
    """The kind of every block, int8 (B or 1, H or 1, num_q, num_k): PARTIAL where
    kv_indices lists it, FULL where full_kv_indices does, else EMPTY."""
    names = ["kv"] + (["full_kv"] if block_mask.full_kv_num_blocks is not None else [])
    listed = {name: _listed(block_mask, name) for name in names}
    lead = torch.broadcast_shapes(*(indices.shape[:2] for _, indices in listed.values()))
    kinds = torch.full((*lead, num_q, num_k + 1), EMPTY, dtype=torch.int8)
    for name, (counts, indices) in listed.items():
        if indices.shape[-2] < num_q:
            raise ValueError(
                f"block_mask.{name}_indices has {indices.shape[-2]} query block rows but the "
                f"call needs {num_q}: build the BlockMask for these lengths"
            )
        indices, counts = indices[..., :num_q, :], counts[..., :num_q]
        valid = torch.arange(indices.shape[-1]) < counts.unsqueeze(-1)
        if bool(((indices < 0) | (indices >= num_k))[valid].any()):
            raise ValueError(
                f"block_mask.{name}_indices lists a key block outside 0..{num_k - 1}: it "
                "was built for other lengths or block sizes"
            )
        # unlisted slots write to the spare last column, dropped below
        target = torch.where(valid, indices, num_k).expand(*lead, *indices.shape[-2:])
        kinds.scatter_(-1, target.contiguous(), FULL if name == "full_kv" else PARTIAL)
    return kinds[..., :num_k].contiguous()


class BlockMaskPattern(Pattern):
    """A FlexAttention BlockMask for a call of (batch, heads, L, S), as a pattern of the
    flash engine. Unlike mhsa's own patterns it may differ per head, and its indices
    count from 0 in the query (FlexAttention's), not from the bottom right."""

    plain_values = False  # holds tensors and a function

    def __init__(self, block_mask, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        self.block_q, self.block_k = (int(size) for size in block_mask.BLOCK_SIZE)
        self.mask_mod = getattr(block_mask, "mask_mod", None) or flex_module().noop_mask
        self.batch, self.heads = batch, heads
        self.q_len, self.kv_len = q_len, kv_len
        nq, nk = num_blocks(q_len, self.block_q), num_blocks(kv_len, self.block_k)
        self.kinds_grid = block_kinds(block_mask, nq, nk)
        lead = tuple(self.kinds_grid.shape[:2])
        if lead[0] not in (1, batch) or lead[1] not in (1, heads):
            raise ValueError(
                f"block_mask is for (B, H) = {lead} but the call has batch {batch} and "
                f"{heads} query heads: build it with B in (None, {batch}) and H in "
                f"(None, {heads})"
            )
        # the engine tiles by this block when both sides agree: tiles then align with
        # the BlockMask's, so a full block needs no mask
        self.block_size = self.block_q if self.block_q == self.block_k else None
        self._triangles: dict = {}  # lower_triangular's answers, by tile (or "whole")
        self._band: list[Band | None] = []  # band()'s answer, once found

    def check_lengths(self, q_len, kv_len):
        if (q_len, kv_len) != (self.q_len, self.kv_len):
            raise ValueError(
                f"this block mask is for L={self.q_len}, S={self.kv_len}, got L={q_len}, S={kv_len}"
            )

    def kinds(self, q_len, kv_len, block_q, block_k):
        # conservative over batch and heads: FULL only if full for all, EMPTY only if
        # empty for all
        full = (self.kinds_grid == FULL).flatten(0, 1).all(dim=0)
        empty = (self.kinds_grid == EMPTY).flatten(0, 1).all(dim=0)
        if (block_q, block_k) != (self.block_q, self.block_k):
            # a tile of other size is as strong as every BlockMask block it overlaps
            rows = [index // self.block_q for index in block_ranges(q_len, block_q)]
            cols = [index // self.block_k for index in block_ranges(kv_len, block_k)]
            full = _count_in_boxes(~full, rows, cols) == 0
            empty = _count_in_boxes(~empty, rows, cols) == 0
        kinds = torch.full(full.shape, PARTIAL, dtype=torch.int8)
        kinds[empty] = EMPTY
        kinds[full] = FULL
        return kinds

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        """Whether the tile's mask is exactly local key c <= local row r (the fused
        kernel then runs it in its causal mode, without a mask tile). Checked by
        evaluating tiles of the main diagonal no larger than one block; the whole
        (L, S) call is one such triangle (Flex's causal mask) when the blocks below
        the diagonal are full, those above empty and the diagonal ones triangles."""
        if (q0, q1, k0, k1) == (0, q_len, 0, kv_len) and (
            q1 - q0 > self.block_q or k1 - k0 > self.block_k
        ):
            if "whole" not in self._triangles:
                self._triangles["whole"] = self._causal_call()
            return self._triangles["whole"]
        if k0 != q0 or q1 - q0 > self.block_q or k1 - k0 > self.block_k:
            return False
        known = self._triangles
        if (q0, q1, k0, k1) not in known:
            rows, cols = torch.arange(q0, q1).view(-1, 1), torch.arange(k0, k1).view(1, -1)
            allowed = self.allowed(rows, cols, q_len, kv_len)
            known[q0, q1, k0, k1] = bool((allowed == (cols - k0 <= rows - q0)).all())
        return known[q0, q1, k0, k1]

    def _causal_call(self) -> bool:
        """Whether the whole mask is c <= r (see lower_triangular). Blocks past the
        lengths' last multiple of the block are partial in a BlockMask (FlexAttention
        counts the padding as masked): below the diagonal those are evaluated."""
        if self.block_q != self.block_k:
            return False
        block, q_len, kv_len = self.block_q, self.q_len, self.kv_len
        kinds = self.kinds(q_len, kv_len, block, block)
        i = torch.arange(kinds.shape[0]).view(-1, 1)
        j = torch.arange(kinds.shape[1]).view(1, -1)
        below = (j < i) & (kinds != FULL)  # must be all allowed: tail blocks may be
        tail = (i == kinds.shape[0] - 1) & (q_len % block != 0)
        tail = tail | ((j == kinds.shape[1] - 1) & (kv_len % block != 0))
        if bool(((j > i) & (kinds != EMPTY)).any() | (below & (~tail | (kinds == EMPTY))).any()):
            return False
        for qi, kj in below.nonzero().tolist():
            rows = torch.arange(qi * block, min(q_len, (qi + 1) * block)).view(-1, 1)
            cols = torch.arange(kj * block, min(kv_len, (kj + 1) * block)).view(1, -1)
            if not bool(self.allowed(rows, cols, q_len, kv_len).all()):
                return False
        for d in range(min(kinds.shape)):
            q0, q1, k1 = d * block, min(q_len, (d + 1) * block), min(kv_len, (d + 1) * block)
            if not self.lower_triangular(q0, q1, q0, k1, q_len, kv_len):
                return False
        return True

    def band(self) -> Band | None:
        """The sliding window this BlockMask is exactly, for every batch and head, or
        None; L = S only (where Flex's indices are mhsa's positions). The engine then
        runs it as SlidingWindow(left, right), with its band fast path."""
        if not self._band:
            self._band.append(self._find_band())
        return self._band[0]

    def _find_band(self) -> Band | None:
        """A window guessed from the middle query's allowed keys, then checked: every
        block's kind against the window's, and every partial block entry by entry
        (at most a few blocks per block row for a window: the check stops at the first
        difference)."""
        if self.q_len != self.kv_len or self.block_q != self.block_k:
            return None
        middle, block = self.q_len // 2, self.block_q
        # the middle query's keys in batch 0, head 0, evaluating partial blocks only
        blocks = self.kinds_grid[0, 0, middle // block].repeat_interleave(block)[: self.kv_len]
        row = blocks == FULL
        cols = (blocks == PARTIAL).nonzero().flatten()
        if len(cols):
            tile = self.allowed(torch.tensor([[middle]]), cols.view(1, -1), self.q_len, self.kv_len)
            row[cols] = tile[0, 0, 0]
        keys = row.nonzero().flatten()
        if len(keys) == 0 or len(keys) != keys[-1] - keys[0] + 1:
            return None  # nothing allowed, or not one contiguous range
        left, right = middle - int(keys[0]), int(keys[-1]) - middle
        if left < 0 or right < 0:
            return None
        window, length = SlidingWindow(left, right), self.q_len
        expected = window.kinds(length, length, block, block).view(1, 1, *self.kinds_grid.shape[2:])
        grid = self.kinds_grid
        if bool(((grid != PARTIAL) & (grid != expected)).any()):
            return None
        for qi, kj in (grid == PARTIAL).any(dim=1).any(dim=0).nonzero().tolist():
            rows = torch.arange(qi * block, min(length, (qi + 1) * block)).view(-1, 1)
            cols = torch.arange(kj * block, min(length, (kj + 1) * block)).view(1, -1)
            mine = self.allowed(rows, cols, length, length)
            if not bool((mine == window.allowed(rows, cols, length, length)).all()):
                return None
        return window.band()

    def allowed(self, rows, cols, q_len, kv_len):
        """(B or 1, H or 1, R, C): FULL blocks allowed, PARTIAL ones by mask_mod."""
        rows, cols = rows.flatten(), cols.flatten()
        grid = self.kinds_grid.to(rows.device)
        kinds = grid[:, :, rows // self.block_q][..., cols // self.block_k]
        full, partial = kinds == FULL, kinds == PARTIAL
        if not bool(partial.any()):
            return full
        device = rows.device
        allowed = evaluate_mask_mod(
            self.mask_mod,
            torch.arange(self.batch, device=device).view(-1, 1, 1, 1),
            torch.arange(self.heads, device=device).view(1, -1, 1, 1),
            rows.view(1, 1, -1, 1),
            cols.view(1, 1, 1, -1),
        )
        return full | (partial & allowed)

    def __repr__(self) -> str:
        name = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        return (
            f"BlockMaskPattern({name}, L={self.q_len}, S={self.kv_len}, "
            f"BLOCK_SIZE=({self.block_q}, {self.block_k}))"
        )


def _count_in_boxes(grid: Tensor, rows: list[Tensor], cols: list[Tensor]) -> Tensor:
    """How many True entries of the bool grid (n, m) lie in each box of rows
    first[i]..last[i] and columns first[j]..last[j] (inclusive): (len(rows), len(cols))."""
    total = torch.zeros(grid.shape[0] + 1, grid.shape[1] + 1, dtype=torch.int64)
    total[1:, 1:] = grid.long().cumsum(0).cumsum(1)
    (r0, r1), (c0, c1) = rows, cols
    r0, r1, c0, c1 = r0.view(-1, 1), (r1 + 1).view(-1, 1), c0.view(1, -1), (c1 + 1).view(1, -1)
    return total[r1, c1] - total[r0, c1] - total[r1, c0] + total[r0, c0]
