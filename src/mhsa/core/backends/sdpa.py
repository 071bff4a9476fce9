"""The sdpa backend: torch.nn.functional.scaled_dot_product_attention.

Used only where its semantics match ours. Three things differ and are handled here:
- SDPA's is_causal is aligned top-left; ours is bottom-right, so is_causal is passed
  only when L == S, and an explicit mask is built otherwise.
- SDPA takes one attn_mask: a bool mask and a float bias merge into one float mask.
- Rows with no allowed key must give 0 (not NaN on some kernels): such rows are
  opened up for the kernel and their output is zeroed afterwards, which also zeroes
  their gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import combined_mask, tracing
from .registry import PAGED_REASON, AttentionSpec, Backend


def _maybe_any(dead: Tensor) -> bool:
    """Whether some row may have no allowed key: dead.any(), or True while a graph is
    traced (compile, export): the dead rows are then opened and zeroed whether or not
    there are any, the same values without a branch on them."""
    return tracing() or bool(dead.any())


def _merged_attn_mask(
    mask: Tensor | None, bias: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """(attn_mask for SDPA, dead-row mask (..., L, 1) or None)."""
    if bias is None:
        if mask is None:
            return None, None
        dead = ~mask.any(dim=-1, keepdim=True)
        if not _maybe_any(dead):
            return mask, None
        return mask | dead, dead
    attn = bias.to(dtype)
    if mask is not None:
        attn = torch.where(mask, attn, torch.tensor(-torch.inf, dtype=dtype, device=attn.device))
    dead = torch.isneginf(attn).all(dim=-1, keepdim=True)
    if not _maybe_any(dead):
        return attn, None
    return torch.where(dead, torch.zeros((), dtype=dtype, device=attn.device), attn), dead


SMALL_SCORES = 256 * 256  # L * S up to which sdpa is preferred whatever the mask


class SdpaBackend(Backend):
    name = "sdpa"

    def supports(self, spec: AttentionSpec) -> str | None:
        if spec.paged:
            return PAGED_REASON
        if spec.has_score or spec.has_sinks:
            return "no score functions or sinks (flash and reference apply them per tile)"
        if spec.return_lse:
            return "it does not return the logsumexp (flash and reference do)"
        return None

    def preference(self, spec: AttentionSpec) -> float:
        # Fastest when its fused kernels apply: no mask or bias to materialise, causal
        # only where its top-left alignment equals ours, and (on CPU) no dropout and
        # D == D_v; otherwise the tiled engine skips blocks and stays memory-lean.
        # Small score matrices cost nothing to materialise: one call beats a plan.
        if spec.q_len * spec.kv_len <= SMALL_SCORES:
            return 3.0
        bare = not spec.has_mask and not spec.has_bias  # no mask, no bias
        aligned = not spec.causal or spec.q_len == spec.kv_len
        if spec.device.type == "cpu":
            fused = spec.dropout_p == 0.0 and spec.head_dim == spec.value_dim
        else:
            fused = True
        return 3.0 if bare and aligned and fused else 1.0

    def forward(
        self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse, score=None, sinks=None
    ):
        q_len, kv_len = q.shape[2], k.shape[2]
        # branches, not bool(): sizes compared under dynamic=True give a symbolic bool,
        # which sdpa refuses and bool() keeps; a branch guards on it
        is_causal = grouped = False
        if causal and q_len == kv_len and mask is None and bias is None:
            is_causal = True
        if q.shape[1] != k.shape[1]:
            grouped = True
        if not is_causal:  # patterns and bottom-right causal masks are materialised
            mask = combined_mask(mask, causal, q_len, kv_len, q.device)
        attn_mask, dead = _merged_attn_mask(mask, bias, q.dtype)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=grouped,
        )
        if dead is not None:
            out = out.masked_fill(dead, 0.0)
        return out, None
