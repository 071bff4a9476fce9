"""PagedStep: the pages of one decoding step, checked once and handed to every layer's
paged attention call (mhsa.paged_attention), as vLLM hands its attention metadata to
every layer; and the checks of paged calls' tensors.

It is data: a block table and lengths, checked, and the plans the step's calls make
(mhsa.core.paged). Nothing is remembered between steps: a new step is a new object
(PagedKVCache makes one per forward pass, in batch()).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .checks import int_at_least, int_list, is_int_tensor


class PagedStep:
    """One decoding step's paged keys, checked once and handed to every layer's
    mhsa.paged_attention call.

    block_table: (N, max_blocks) integer block ids: sequence n's key j is row
        j % block_size of block block_table[n, j // block_size] (entries past its keys:
        any value).
    seq_lens: (N,) ints, each sequence's keys, this step's new ones included, at most
        max_blocks * block_size.
    num_blocks, block_size: the pools' first two sizes, (num_blocks, block_size, H_kv, D).

    The step keeps its own int64 copy of the table, its entries past each sequence's
    keys clamped to blocks: a table changed afterwards changes nothing here (make a new
    step for it). `plans` holds the plan of each kind of call the step has served (a
    layer's shapes, window, scale, backend, whether gradients flow; see
    mhsa.core.paged): checked and planned at the step's first call of that kind, reused
    by its later ones (the backend chosen and what it prepared: flash's positions, tiles
    and masks, never a block id or a key). A step may be read from several threads: a
    plan is one object, stored whole.
    """

    __slots__ = ("block_table", "seq_lens", "num_blocks", "block_size", "plans")

    def __init__(
        self,
        block_table: Tensor,
        seq_lens: Tensor | Sequence[int],
        *,
        num_blocks: int,
        block_size: int,
    ) -> None:
        self.num_blocks = int_at_least("num_blocks", num_blocks, 1)
        self.block_size = int_at_least("block_size", block_size, 1)
        self.seq_lens, self.block_table = checked_pages(
            block_table, seq_lens, num_blocks, block_size
        )
        self.plans: dict[tuple, object] = {}

    @classmethod
    def for_call(cls, q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table, seq_lens):
        """A one-off step for a call's q (N, H, T, D), pools and pages (mhsa.attention's
        block_table= and seq_lens=), q and the pools checked first."""
        check_pools(q, k_pool, v_pool)
        check_block_table(block_table, q.shape[0], q.device)
        num_blocks, block_size = k_pool.shape[:2]
        return cls(block_table, seq_lens, num_blocks=num_blocks, block_size=block_size)

    def check(self, q: Tensor, k_pool: Tensor, v_pool: Tensor) -> None:
        """Check q (N, H, T, D) and the pools (num_blocks, block_size, H_kv, D) /
        (..., D_v) against each other and against this step."""
        check_pools(q, k_pool, v_pool)
        if tuple(k_pool.shape[:2]) != (self.num_blocks, self.block_size):
            raise ValueError(
                f"the pools are (num_blocks, block_size, ...) = {tuple(k_pool.shape[:2])}, "
                f"but this PagedStep was made for ({self.num_blocks}, {self.block_size}): "
                "make the step for these pools"
            )
        if q.shape[0] != len(self.seq_lens):
            raise ValueError(
                f"q holds {q.shape[0]} sequences (N, H, T, D) but this PagedStep "
                f"{len(self.seq_lens)}: make the step for these sequences"
            )
        if self.block_table.device != q.device:
            raise ValueError(
                f"this PagedStep's block_table is on {self.block_table.device} but q is "
                f"on {q.device}"
            )

    def __repr__(self) -> str:
        return (
            f"PagedStep(seq_lens={self.seq_lens}, max_blocks={self.block_table.shape[1]}, "
            f"num_blocks={self.num_blocks}, block_size={self.block_size})"
        )


def check_pools(q: Tensor, k_pool: Tensor, v_pool: Tensor) -> None:
    """Check q (N, H, T, D) and the pools (num_blocks, block_size, H_kv, D) / (..., D_v)
    of attention over paged keys against each other."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a 4-D float tensor, got {got}; layout with "
                "block_table: q (N, H, T, D), pools (num_blocks, block_size, "
                "H_kv, D)"
            )
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(
            f"q, k_pool and v_pool must share one dtype, got {q.dtype}, "
            f"{k_pool.dtype}, {v_pool.dtype}; cast them with .to(q.dtype)"
        )
    if k_pool.device != q.device or v_pool.device != q.device:
        raise ValueError(
            f"q, k_pool and v_pool must be on one device, got {q.device}, "
            f"{k_pool.device}, {v_pool.device}"
        )
    batch, num_heads, _, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, key_dim = k_pool.shape
    if tuple(v_pool.shape[:3]) != (num_blocks, block_size, num_kv_heads):
        raise ValueError(
            f"v_pool must be (num_blocks, block_size, H_kv, D_v) = ({num_blocks}, "
            f"{block_size}, {num_kv_heads}, *) like k_pool, got "
            f"{tuple(v_pool.shape)}"
        )
    if key_dim != head_dim or min(num_blocks, block_size, num_kv_heads, head_dim) == 0:
        raise ValueError(
            f"k_pool {tuple(k_pool.shape)} must hold keys of q's head_dim "
            f"{head_dim}, with no empty dimension"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q's num_heads ({num_heads}) must be a multiple of the pools' "
            f"num_kv_heads ({num_kv_heads}) for grouped-query attention"
        )


def check_block_table(block_table, batch: int | None = None, device=None) -> None:
    """Check block_table as a (N, max_blocks) tensor of integer block ids, of `batch` rows
    and on `device` where they are given."""
    if (
        not isinstance(block_table, Tensor)
        or block_table.dim() != 2
        or (batch is not None and block_table.shape[0] != batch)
    ):
        got = tuple(block_table.shape) if isinstance(block_table, Tensor) else block_table
        rows = "N" if batch is None else batch
        raise ValueError(
            f"block_table must be a (N, max_blocks) = ({rows}, *) tensor of block ids, got {got}"
        )
    if not is_int_tensor(block_table):
        raise TypeError(f"block_table must hold integer block ids, got {block_table.dtype}")
    if device is not None and block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")


def checked_pages(
    block_table, seq_lens, num_blocks: int, block_size: int
) -> tuple[list[int], Tensor]:
    """Check block_table (N, max_blocks) and seq_lens (N,) for pools of num_blocks blocks
    of block_size keys; return seq_lens as a list of ints and a copy of the table as
    int64, its entries past each sequence's keys clamped into 0..num_blocks-1 (they are
    read, never used). Raises ValueError where an entry that holds keys is not a block."""
    check_block_table(block_table)
    seq_lens = _seq_lens(seq_lens, block_table.shape[0], block_table.shape[1] * block_size)
    ids = block_table
    low, high = [int(x) for x in torch.aminmax(ids)] if ids.numel() else (0, 0)
    in_range = low >= 0 and high < num_blocks
    if not in_range:  # only the entries that hold keys must be blocks
        used = torch.arange(block_table.shape[1], device=block_table.device) * block_size
        ids = block_table[used.view(1, -1) < torch.tensor(seq_lens, device=ids.device).view(-1, 1)]
        low, high = [int(x) for x in torch.aminmax(ids)] if ids.numel() else (0, 0)
    if low < 0 or high >= num_blocks:
        raise ValueError(
            f"block_table's blocks holding keys must be in 0..{num_blocks - 1} "
            f"(the pools' num_blocks), got {low}..{high}"
        )
    if in_range:
        return seq_lens, block_table.to(torch.long, copy=True)
    return seq_lens, block_table.long().clamp(0, num_blocks - 1)


def _seq_lens(seq_lens, batch: int, capacity: int) -> list[int]:
    if seq_lens is None:
        raise ValueError("block_table needs seq_lens: the keys of each sequence (N,)")
    seq_lens = int_list("seq_lens", seq_lens, " (N,)")
    if len(seq_lens) != batch or set(map(type, seq_lens)) - {int}:  # (bool is no int here)
        raise ValueError(f"seq_lens must hold {batch} ints (one per sequence), got {seq_lens}")
    if seq_lens and (min(seq_lens) < 0 or max(seq_lens) > capacity):
        raise ValueError(
            f"seq_lens must be in 0..{capacity} (block_table's max_blocks * "
            f"block_size), got {seq_lens}"
        )
    return seq_lens
