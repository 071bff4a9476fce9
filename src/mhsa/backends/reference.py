"""The reference backend: attention written as the formula, the golden answer.

    out = dropout(softmax(q k^T * scale + bias, masked)) v

Scores, softmax and the product with v are computed in float32 (float64 for float64
inputs) whatever the input dtype; the output is cast back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import combined_mask, stats_dtype
from .registry import AttentionSpec, Backend


def masked_softmax(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that is 0 (not NaN) on rows where every score is -inf.

    scores (..., S) -> probs (..., S), lse (...). Gradients on such rows are 0.
    """
    if scores.shape[-1] == 0:
        return scores, scores.new_full(scores.shape[:-1], -torch.inf)
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    alive = total > 0
    safe_total = torch.where(alive, total, torch.ones_like(total))
    probs = exp / safe_total
    lse = torch.where(alive, row_max + torch.log(safe_total), torch.full_like(total, -torch.inf))
    return probs, lse.squeeze(-1)


def attention_probs(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Probabilities (B, H, L, S) and lse (B, H, L), both in the statistics dtype.

    Grouped-query heads are handled by viewing the H_kv * G query heads as
    (B, H_kv, G * L, D), so k is never repeated.
    """
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    dtype = stats_dtype(q.dtype)
    grouped_q = q.to(dtype).reshape(batch, num_kv_heads, -1, head_dim)  # (B, H_kv, G*L, D)
    scores = grouped_q @ k.to(dtype).transpose(-1, -2) * scale  # (B, H_kv, G*L, S)
    scores = scores.view(batch, num_heads, q_len, kv_len)
    if bias is not None:
        scores = scores + bias.to(dtype)
    allowed = combined_mask(mask, causal, q_len, kv_len, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    return masked_softmax(scores)


def probs_times_v(probs: Tensor, v: Tensor) -> Tensor:
    """(B, H, L, S) @ (B, H_kv, S, D_v) -> (B, H, L, D_v), GQA without repeating v."""
    batch, num_heads, q_len, kv_len = probs.shape
    grouped = probs.reshape(batch, v.shape[1], -1, kv_len)  # (B, H_kv, G*L, S)
    out = grouped @ v.to(probs.dtype)
    return out.view(batch, num_heads, q_len, v.shape[-1])


class ReferenceBackend(Backend):
    name = "reference"

    def forward(self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse):
        probs, lse = attention_probs(q, k, mask=mask, bias=bias, causal=causal, scale=scale)
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p, training=True)
        out = probs_times_v(probs, v).to(q.dtype)
        return out, (lse if return_lse else None)

    def supports(self, spec: AttentionSpec) -> str | None:
        return None
