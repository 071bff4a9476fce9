"""Block kinds: how a pattern looks at the resolution of (query block, key block) tiles.

EMPTY tiles are never visited, PARTIAL ones apply the element mask, FULL ones apply
none. Kinds are int8 and ordered, so a union takes the largest and an intersection
the smallest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

EMPTY, PARTIAL, FULL = 0, 1, 2


def num_blocks(length: int, block: int) -> int:
    """How many blocks of `block` cover `length`."""
    return -(-length // block)


def reduce_blocks(mask: Tensor, q_len: int, kv_len: int, block_q: int, block_k: int) -> Tensor:
    """Block kinds of a bool (..., L or 1, S or 1) mask, conservative over leading dims."""
    mask = mask.reshape(-1, *mask.shape[-2:])  # (N, L or 1, S or 1)
    rows, cols = mask.shape[1:]
    # a size-1 dimension is reduced as one block of size 1, then broadcast
    bq, bk = (block_q if rows > 1 else 1), (block_k if cols > 1 else 1)
    pad = (0, num_blocks(cols, bk) * bk - cols, 0, num_blocks(rows, bq) * bq - rows)
    # pad with values that change neither "any allowed" nor "all allowed"
    padded_any, padded_all = F.pad(mask, pad, value=False), F.pad(mask, pad, value=True)
    shape = (mask.shape[0], padded_any.shape[1] // bq, bq, padded_any.shape[2] // bk, bk)
    any_allowed = padded_any.view(shape).any(dim=4).any(dim=2).any(dim=0).cpu()
    all_allowed = padded_all.view(shape).all(dim=4).all(dim=2).all(dim=0).cpu()
    kinds = torch.full(any_allowed.shape, PARTIAL, dtype=torch.int8)
    kinds[~any_allowed] = EMPTY
    kinds[all_allowed] = FULL
    return kinds.expand(num_blocks(q_len, block_q), num_blocks(kv_len, block_k))
