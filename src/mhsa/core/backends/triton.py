"""The triton backend: our own Triton kernels (mhsa.core.kernels.triton): band kernels
for dense, causal and sliding windows, a paged kernel for keys in pages (inference),
and tile-list kernels over the flash engine's block plan for the rest: empty tiles
skipped, full tiles unmasked, patterns, bool masks, differentiable bias,
counter-based dropout with any mask, GQA, D and D_v up to 256,
score functions ALiBi, RelativeBias and Softcap (composed, each at most once) and
sinks, evaluated inside the kernels, their tensors differentiable.

It runs on CUDA, or on CPU in Triton's interpreter when TRITON_INTERPRET=1 is set
before triton is imported (slow: for tests; `auto` never picks it there). triton
itself is imported only when a call is served, so mhsa imports without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ..kernels.dropout import draw_seed
from .common import tracing
from .preference import triton_band_leads, triton_leads
from .registry import AttentionSpec, Backend

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
KERNEL_SCORES = ("ALiBi", "RelativeBias", "Softcap")  # mhsa.core.kernels.triton.scores


@functools.cache
def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def score_reason(kinds: tuple[str, ...]) -> str | None:
    """Why the kernels cannot evaluate a score function made of kinds (class names in
    order, mhsa.core.scores.kinds), or None: they take ALiBi, RelativeBias and Softcap, each
    at most once, in any order."""
    if not kinds:
        return "the call's score function is not named in its spec (score_kinds)"
    for kind in kinds:
        if kind == "AtPositions":  # attention_varlen's wrapper: positions restart per sequence
            return (
                "its kernels evaluate score functions at the call's own positions, not at "
                "per-sequence ones (packed cross-attention, or a score that is not relative): "
                "flash and reference take them"
            )
        if kind not in KERNEL_SCORES:
            return (
                f"its kernels evaluate ALiBi, RelativeBias and Softcap, not {kind} "
                "(flash and reference take any score function)"
            )
        if kinds.count(kind) > 1:
            return (
                f"a composition may hold each of {', '.join(KERNEL_SCORES)} once, got {kind} twice"
            )
    return None


class TritonBackend(Backend):
    name = "triton"

    def available(self) -> str | None:
        if not _triton_installed():
            return "the triton package is not installed (pip install triton)"
        if not torch.cuda.is_available() and not _interpreting():
            return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to test on CPU)"
        return None

    def supports(self, spec: AttentionSpec) -> str | None:
        if spec.device.type == "cpu" and not _interpreting():
            return "CPU tensors need TRITON_INTERPRET=1 (the slow interpreter); use flash on CPU"
        if spec.device.type not in ("cuda", "cpu"):
            return f"it runs on CUDA devices, got {spec.device.type}"
        if spec.has_score:
            reason = score_reason(spec.score_kinds)
            if reason is not None:
                return reason
        if spec.dtype not in DTYPES:
            return f"it takes float32, float16 or bfloat16, got {spec.dtype}"
        if max(spec.head_dim, spec.value_dim) > MAX_HEAD_DIM:
            return f"head dims up to {MAX_HEAD_DIM}, got D={spec.head_dim}, D_v={spec.value_dim}"
        if spec.paged and spec.needs_grad:
            return (
                "paged keys with gradients: its paged kernel is for inference; reference "
                "is differentiable, or run under torch.no_grad()"
            )
        if spec.paged and tracing():
            return "paged keys under torch.compile: the paged kernel is no custom op yet"
        return None

    def preference(self, spec: AttentionSpec) -> float:
        # On CPU the interpreter is for tests only: usable when named, never chosen.
        if spec.device.type != "cuda":
            return -100.0
        if spec.paged:  # the GPU kernel, ahead of the CPU-shaped flash tile engine
            return 4.0
        # Where the fused kernels of sdpa/flex have no exact path: dropout together with
        # a mask or causal, or a bias (whose gradient is atomic-free here). The spec does
        # not say whether bias needs a gradient, so any bias counts.
        if spec.has_bias or (spec.dropout_p > 0 and (spec.has_mask or spec.causal)):
            return 4.0
        if triton_leads(spec) or triton_band_leads(spec):  # measured (preference.py)
            return 2.9  # above flex's 2.5 for patterns, below sdpa's 3.0 for tiny calls
        return 0.8  # below sdpa (1.0 / 3.0), above the unfused flash engine (0.5)

    def prepare_paged(self, call):
        """The paged kernel's launch (lengths on the device, grid) for a decoding step."""
        from ..kernels.triton.paged import prepare_paged_launch  # imports triton

        return prepare_paged_launch(call)

    def forward_paged(self, call, prepared=None):
        from ..kernels.triton.paged import triton_paged_attention  # imports triton

        return triton_paged_attention(call, prepared)

    def forward(
        self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse, score=None, sinks=None
    ):
        if tracing():  # one custom op in the graph
            from .triton_op import traced_triton_attention  # imports triton

            out, lse = traced_triton_attention(
                q, k, v, mask, bias, causal, scale, dropout_p, score, sinks
            )
            return out, (lse if return_lse else None)
        from ..kernels.triton import triton_attention  # imports triton

        seed = draw_seed() if dropout_p > 0 else None
        out, lse = triton_attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            seed=seed,
            score=score,
            sinks=sinks,
        )
        return out, (lse if return_lse else None)
