"""Per-head summaries of attention rows, to spot local, positional and sink heads.

entropy     bits of each row's distribution, averaged over rows
distance    mean |query - key| under the row's probabilities (self-attention)
first       probability on the first key (a "sink" head parks most of it there)
offset      the most common query - argmax(key): 0 attends to itself, 1 to the
            previous token (self-attention); offset_share: how many rows do
shown       probability on the keys the maps show (when some are left out)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class HeadStats:
    """Accumulates one layer's rows, chunk by chunk, for each of its heads."""

    def __init__(
        self, num_heads: int, q_len: int, kv_len: int, self_attention: bool, shown: int
    ) -> None:
        self.self_attention, self.shown, self.kv_len = self_attention, shown, kv_len
        self.rows = torch.zeros(num_heads)  # rows with any probability
        self.sums = {
            name: torch.zeros(num_heads, dtype=torch.float64)
            for name in ("entropy", "distance", "first", "shown")
        }
        self.offsets = torch.zeros(num_heads, q_len + kv_len - 1, dtype=torch.long)

    def update(self, probs: Tensor, rows: Tensor) -> None:
        """probs (H, r, S): the rows `rows` (r,) of every head."""
        live = probs.sum(-1) > 0  # (H, r)
        self.rows += live.sum(-1)
        entropy = torch.special.entr(probs).sum(-1) / math.log(2)
        self.sums["entropy"] += (entropy * live).sum(-1).double()
        self.sums["first"] += probs[..., 0].sum(-1).double()
        self.sums["shown"] += probs[..., : self.shown].sum((-2, -1)).double()
        if self.self_attention:
            keys = torch.arange(probs.shape[-1], dtype=probs.dtype)
            gap = (rows[:, None].to(probs.dtype) - keys[None, :]).abs()  # (r, S)
            self.sums["distance"] += (probs * gap).sum((-2, -1)).double()
            offset = rows[None, :] - probs.argmax(-1) + self.kv_len - 1  # (H, r), >= 0
            offset = torch.where(live, offset, self.offsets.shape[1])  # dead rows: dropped
            for head in range(probs.shape[0]):
                counts = torch.bincount(offset[head], minlength=self.offsets.shape[1] + 1)
                self.offsets[head] += counts[:-1]

    def result(self) -> dict[str, list[float | None]]:
        """Each summary as one value per head (None where it does not apply)."""
        rows = self.rows.clamp_min(1).double()
        out: dict[str, list[float | None]] = {
            name: (self.sums[name] / rows).tolist() for name in ("entropy", "first")
        }
        heads = len(rows)
        out["shown"] = (
            (self.sums["shown"] / rows).tolist() if self.shown < self.kv_len else [None] * heads
        )
        if self.self_attention:
            out["distance"] = (self.sums["distance"] / rows).tolist()
            share, best = self.offsets.max(dim=-1)
            out["offset"] = (best - (self.kv_len - 1)).tolist()
            out["offset_share"] = (share.double() / rows).tolist()
        else:
            out["distance"] = out["offset"] = out["offset_share"] = [None] * heads
        return out
