"""Attention kernels written in Triton (needs the triton package; CUDA, or the CPU
interpreter with TRITON_INTERPRET=1). Importing this package imports triton."""

from .function import (
    TritonAttention,
    build_tiles,
    interpreting,
    triton_attention,
    triton_attention_weights,
    triton_keep_mask,
)
from .scores import score_of_heads

__all__ = [
    "TritonAttention",
    "build_tiles",
    "interpreting",
    "score_of_heads",
    "triton_attention",
    "triton_attention_weights",
    "triton_keep_mask",
]
