"""The flash backend's block plans: which tiles of a call the engine computes, and
how (tile sizes per segment kernel, the band of a sliding window)."""

from __future__ import annotations

from ..kernels.flash import FlashCall, fused_available
from ..kernels.plan import build_plan
from ..masks import Band, Pattern, with_causal

# Tile sizes: the fused kernel tiles internally, so its runs can be long; the unfused
# kernel materialises (rows x run) scores, so its runs are capped.
FUSED_BLOCK = 256
UNFUSED_BLOCK_Q = 128
UNFUSED_BLOCK_K = 128
UNFUSED_MAX_RUN = 1024
# the fused kernel reads a score function's values as a float tile: runs are capped so
# that a tile stays small (8 heads x 256 x 2048 floats: 16 MiB)
FUSED_SCORED_MAX_RUN = 2048
# a causal call with a separable score function (ALiBi) reads one row of values per
# run left of the diagonal and a float tile only on the diagonal: its rows go in
# blocks of 1024, large enough for the kernel's 256-row splits (it uses 64-row ones
# below 768 rows, which read the keys four times as often)
SEPARABLE_BLOCK = 1024


def plan_for(mask, causal: bool, q_len: int, kv_len: int, device, fused: bool, score=None):
    """The block plan the flash backend uses for a call with an mhsa.core.scores function or
    None."""
    pattern = with_causal(mask, causal)
    if fused and score is not None and score.separable and causal and mask is None:
        return build_plan(
            pattern,
            q_len,
            kv_len,
            block_q=SEPARABLE_BLOCK,
            block_k=SEPARABLE_BLOCK,
            merge_rows=False,
        )
    if fused and score is not None:
        return build_plan(
            pattern,
            q_len,
            kv_len,
            block_q=FUSED_BLOCK,
            block_k=FUSED_BLOCK,
            max_run_keys=FUSED_SCORED_MAX_RUN,
            merge_rows=False,
        )
    if fused:
        block = getattr(mask, "block_size", None) or FUSED_BLOCK
        plan = build_plan(pattern, q_len, kv_len, block_q=block, block_k=block, gather=True)
        band = band_of(mask)
        if band is not None and band.dilation == 1:
            # causal caps the window's right side at the query's own position
            plan.band = (band.left, 0 if causal else band.right)
        return plan
    return build_plan(
        pattern,
        q_len,
        kv_len,
        block_q=UNFUSED_BLOCK_Q,
        block_k=UNFUSED_BLOCK_K,
        max_run_keys=UNFUSED_MAX_RUN,
        merge_rows=False,
    )


def engine_call(
    q, k, v, mask, bias, causal: bool, scale: float, dropout, score, sinks
) -> FlashCall:
    """The flash engine's call for a backend's arguments (dropout (p, seed) or None): the
    fused kernel where it applies (it adds a float mask per tile: additive score
    functions only), and its block plan."""
    fused = fused_available(q, v, dropout[0] if dropout else 0.0)
    fused = fused and (score is None or score.additive)
    plan = plan_for(mask, causal, q.shape[2], k.shape[2], q.device, fused, score)
    return FlashCall(q, k, v, bias, plan, scale, dropout, fused, score, sinks)


def band_of(mask) -> Band | None:
    """The band a mask says it is exactly (Pattern.band), or None."""
    return mask.band() if isinstance(mask, Pattern) else None
