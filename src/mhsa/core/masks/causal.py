"""The causal rule, said once: queries are aligned bottom-right.

With L queries and S keys, query row i sits at global position i + S - L and key j at
position j; a query at position p sees the keys at positions <= p. So the last query
sees every key (what decoding with a KV cache needs), and with L > S the first L - S
queries see no key. Every engine takes its causal masks and offsets from here.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_shift(q_len, kv_len):
    """The global position of query row 0: S - L (ints, or tensors of per-sequence
    lengths alike). Query row i sits at i + causal_shift(L, S)."""
    return kv_len - q_len


def causal_allows(q_pos, k_pos):
    """Whether a query at global position q_pos may see a key at k_pos: k_pos <= q_pos.
    Ints give a bool; tensors broadcast to a bool tensor."""
    return k_pos <= q_pos


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> Tensor:
    """(L, S) bool, True = may attend: query i sees keys j <= i + S - L."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + causal_shift(q_len, kv_len)
    return causal_allows(rows, torch.arange(kv_len, device=device).unsqueeze(0))


def strictly_earlier(n: int, device: torch.device | str | None = None) -> Tensor:
    """(n, n) bool: row i sees columns j < i (blocks before a query's own block, as
    MoBA chooses among)."""
    rows = torch.arange(n, device=device).unsqueeze(1)
    return causal_allows(rows - 1, torch.arange(n, device=device).unsqueeze(0))
