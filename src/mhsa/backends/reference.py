"""The reference backend: attention written as the formula, the golden answer.

    out = dropout(softmax(q k^T * scale + bias, masked)) v

Scores, softmax and the product with v are computed in float32 (float64 for float64
inputs) whatever the input dtype; the output is cast back to the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.dense import (
    apply_dropout,
    grouped_scores,
    masked_softmax,
    probs_times_v,
    stats_dtype,
)
from ..kernels.dropout import draw_seed
from .common import combined_mask
from .registry import AttentionSpec, Backend


def attention_probs(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Probabilities (B, H, L, S) and lse (B, H, L), both in the statistics dtype."""
    dtype = stats_dtype(q.dtype)
    scores = grouped_scores(q, k, scale, dtype)
    if bias is not None:
        scores = scores + bias.to(dtype)
    allowed = combined_mask(mask, causal, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    return masked_softmax(scores)


class ReferenceBackend(Backend):
    name = "reference"

    def forward(self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse):
        probs, lse = attention_probs(q, k, mask=mask, bias=bias, causal=causal, scale=scale)
        if dropout_p > 0:
            probs = apply_dropout(probs, dropout_p, draw_seed())
        out = probs_times_v(probs, v).to(q.dtype)
        return out, (lse if return_lse else None)

    def supports(self, spec: AttentionSpec) -> str | None:
        return None
