"""What `auto` prefers on CUDA where the fixed preferences are wrong: measured, not guessed.

From one run of `python -m mhsa.benchmarks.gpu --quick` on an NVIDIA H200, 2026-12-04
(torch 2.11, triton 3.6, bf16, B=4, H=16, D=128, L=8192; the rows are
docs/gpu-2026-12-04-quick.json). There, `auto` (sdpa for dense and causal, flex for
patterns) was within 3% of the best backend in every row but bigbird(64), where our
triton kernel took 0.40x flex's time forward and 0.77x forward+backward. So triton
leads for block-structured patterns made of the parts measured, without causal or a
score function (neither was measured with them). Add a row only with the run that
measured it.

From `python -m mhsa.benchmarks.gpu_band` on the H200, 2026-12-04 (same torch and
triton; bf16, B=4, H=16, D=128): the band kernels (mhsa.core.kernels.triton.band)
took 0.55x flex's time forward on SlidingWindow(1024, 0) at L=8192 (1.19 ms against
2.15) and 0.54x at L=16384 (2.14 against 3.97). So triton leads for sliding windows.

From `python -m mhsa.benchmarks.gpu --quick` on the H200 later that day
(docs/gpu-runs/2026-12-04-gpu.json): SlidingWindow(1024, 0) at L=8192 took triton 0.56x
flex's time forward and 0.89x forward+backward; causal at L=4096 with ALiBi took it 0.95x
flex's forward (1.15 ms against 1.21) and with Softcap(30) 0.96x (1.85 against 1.92),
but 1.15x and 1.03x forward+backward. So for dense or causal calls with a score
function (or sinks, unmeasured, alike), which sdpa cannot serve, triton leads where no
gradient is needed and flex keeps the rest.
"""

from __future__ import annotations

from .registry import AttentionSpec

# the parts of bigbird(block) (BlockBand | GlobalTokens | RandomBlocks) and BlockSparse,
# the block-sparse pattern RandomBlocks is made from
BLOCK_PATTERN_PARTS = frozenset({"BlockBand", "BlockSparse", "GlobalTokens", "RandomBlocks"})


def triton_leads(spec: AttentionSpec) -> bool:
    """Whether the measured table puts triton ahead of flex and sdpa for this call."""
    return (
        spec.device.type == "cuda"
        and bool(spec.mask_kinds)
        and set(spec.mask_kinds) <= BLOCK_PATTERN_PARTS
        and not spec.causal
        and not spec.has_score
        and not spec.has_sinks
    )


def triton_band_leads(spec: AttentionSpec) -> bool:
    """Whether the measured table puts triton's band kernels ahead for this call: a
    sliding window, or dense/causal with a score function or sinks and no gradient."""
    band_call = (
        spec.device.type == "cuda"
        and not spec.has_bias
        and spec.dropout_p == 0
        and spec.head_dim == spec.value_dim
    )
    if not band_call:
        return False
    if spec.has_mask:
        return spec.mask_kinds == ("SlidingWindow",)
    return (spec.has_score or spec.has_sinks) and not spec.needs_grad
