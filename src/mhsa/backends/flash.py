"""The flash backend: exact tiled attention, memory linear in sequence length.

The call's mask and causal flag become a block plan (empty tiles skipped, full tiles
unmasked); the engine in mhsa.kernels.flash computes it with PyTorch's fused CPU
kernel per run, or plain torch (any device, dropout).
"""

from __future__ import annotations

from ..kernels.dropout import draw_seed
from ..kernels.flash import flash_attention, fused_available
from ..kernels.plan import build_plan, mask_source
from ..masks import SlidingWindow
from .registry import AttentionSpec, Backend

# Tile sizes: the fused kernel tiles internally, so its runs can be long; plain torch
# materialises (rows x run) scores, so its runs are capped.
FUSED_BLOCK = 256
PLAIN_BLOCK_Q = 128
PLAIN_BLOCK_K = 128
PLAIN_MAX_RUN = 1024


def plan_for(mask, causal: bool, q_len: int, kv_len: int, device, fused: bool):
    """The block plan the flash backend uses for a call."""
    source = mask_source(mask, causal, q_len, kv_len, device)
    if fused:
        block = getattr(mask, "block_size", None) or FUSED_BLOCK
        plan = build_plan(source, q_len, kv_len, block_q=block, block_k=block, gather=True)
        # a window exactly (not a subclass or a composition); causal caps it at key p
        if type(mask) is SlidingWindow:
            plan.band = (mask.left, 0 if causal else mask.right)
        return plan
    return build_plan(
        source,
        q_len,
        kv_len,
        block_q=PLAIN_BLOCK_Q,
        block_k=PLAIN_BLOCK_K,
        max_run_keys=PLAIN_MAX_RUN,
        merge_rows=False,
    )


class FlashBackend(Backend):
    name = "flash"

    def preference(self, spec: AttentionSpec) -> float:
        return 2.0 if spec.device.type == "cpu" else 0.5

    def forward(self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse):
        fused = fused_available(q, v, dropout_p)
        plan = plan_for(mask, causal, q.shape[2], k.shape[2], q.device, fused)
        dropout = (dropout_p, draw_seed()) if dropout_p > 0 else None
        out, lse = flash_attention(
            q, k, v, plan, bias=bias, scale=scale, dropout=dropout, fused=fused
        )
        return out, (lse if return_lse else None)
