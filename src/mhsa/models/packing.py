"""Packed input for the models: several sequences one after another in one row.

    idx (1, total) tokens of B sequences; cu_seqlens (B+1,) offsets and/or
    position_ids (total,) or (1, total) restarting at 0   (mhsa.data.pack makes both)
      -> PackedRow: the Segments pattern (each sequence attends only itself) and
         each token's position within its sequence (learned tables, rotary)

Relative positions (ALiBi, T5) need nothing more: inside a segment of self-attention
a key minus a query is the same in the packed row as in the sequence alone. Which
one wins when both cu_seqlens and position_ids are given: neither; they must agree
(mhsa.core.varlen.packed_segments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from ..core.masks import Segments
from ..core.varlen import packed_segments
from ..data.packing import IGNORE, next_token_targets

__all__ = [
    "IGNORE",
    "PackedRow",
    "mean_token_loss",
    "next_token_targets",
    "packed_row",
    "refuse_packed_with",
]


@dataclass(frozen=True)
class PackedRow:
    """cu_seqlens (B+1,) int32 and positions (1, total) int64 of one packed row."""

    cu_seqlens: Tensor
    positions: Tensor

    def pattern(self, *, causal: bool, window: tuple[int, int] | None = None) -> Segments:
        """The block-diagonal mask: each sequence attends only itself (causal and the
        window (left, right) aligned within it)."""
        return Segments(self.cu_seqlens, causal=causal, window=window)


def packed_row(
    idx: Tensor,
    cu_seqlens: Tensor | None,
    position_ids: Tensor | None,
    attention_mask: Tensor | None = None,
) -> PackedRow:
    """Check a packed row idx (1, total, ...) against its cu_seqlens and/or position_ids
    (which must agree if both are given) and an optional 2-D attention_mask, which may
    only be all ones (padding inside a pack is refused)."""
    if idx.dim() < 2 or idx.shape[0] != 1:
        raise ValueError(
            f"packed input must be one row (1, total), got shape {tuple(idx.shape)}; "
            "concatenate the sequences (mhsa.data.pack) and pass cu_seqlens"
        )
    cu, positions = packed_segments(cu_seqlens, position_ids, attention_mask)
    if int(cu[-1]) != idx.shape[1]:
        raise ValueError(
            f"cu_seqlens / position_ids describe {int(cu[-1])} tokens but the packed row "
            f"holds {idx.shape[1]}"
        )
    return PackedRow(cu, positions.view(1, -1).to(idx.device))


def refuse_packed_with(what: str) -> None:
    """Raise ValueError: packed input met arguments (`what`) that do not go with it."""
    raise ValueError(f"packed input (cu_seqlens / position_ids) does not go with {what}")


def mean_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of logits (N, V) against targets (N,), averaged over the targets
    that are not IGNORE; 0 (a gradient of 0) when none is, where F.cross_entropy gives
    nan (a BERT batch in which no token was drawn, packed one-token documents)."""
    total = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    return total / (targets != IGNORE).sum().clamp(min=1)
