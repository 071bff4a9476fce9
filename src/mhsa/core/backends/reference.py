"""The reference backend: attention written as the formula, the golden answer.

    out = dropout(softmax(q k^T * scale + bias, masked)) v

Scores, softmax and the product with v are computed in float32 (float64 for float64
inputs) whatever the input dtype; the output is cast back to the input dtype. Paged
keys: each sequence's pages gathered, then the same dense math (mhsa.core.kernels.paged).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.dense import apply_dropout, grouped_scores, probs_times_v, stats_dtype
from ..kernels.dropout import draw_seed
from ..kernels.paged import paged_reference
from ..kernels.scored import softmax_with_sinks
from ..masks.causal import causal_shift
from ..scores import ScoreFunction, apply_score
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
    score: ScoreFunction | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Probabilities (B, H, L, S) and lse (B, H, L), both in the statistics dtype.

    score is applied to the scaled scores (query row i at global position i + S - L),
    then the bias is added and the mask applied; sinks (H,) join each row's
    denominator."""
    dtype = stats_dtype(q.dtype)
    scores = grouped_scores(q, k, scale, dtype)
    if score is not None:
        q_len, kv_len = q.shape[2], k.shape[2]
        q_pos = torch.arange(causal_shift(q_len, kv_len), kv_len, device=q.device)
        scores = apply_score(score, scores, q_pos, torch.arange(kv_len, device=q.device))
    if bias is not None:
        scores = scores + bias.to(dtype)
    allowed = combined_mask(mask, causal, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    return softmax_with_sinks(scores, sinks)


class ReferenceBackend(Backend):
    name = "reference"

    def forward(
        self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse, score=None, sinks=None
    ):
        probs, lse = attention_probs(
            q, k, mask=mask, bias=bias, causal=causal, scale=scale, score=score, sinks=sinks
        )
        if dropout_p > 0:
            probs = apply_dropout(probs, dropout_p, draw_seed())
        out = probs_times_v(probs, v).to(q.dtype)
        return out, (lse if return_lse else None)

    def forward_paged(self, call, prepared=None):
        """Every sequence's pages gathered, then dense attention (differentiable)."""
        return paged_reference(call)

    def supports(self, spec: AttentionSpec) -> str | None:
        return None
