"""Launch options that every Triton kernel takes: the dot products' precision and the
padded head dim."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import interpreting


def dot_options(dtype: torch.dtype) -> dict:
    """IEEE float32 products unless torch allows TF32; bfloat16 dots are upcast under
    the interpreter, whose dot cannot take them; ACC is the statistics dtype."""
    prec = None
    if dtype == torch.float32:
        prec = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    return {"PREC": prec, "UPCAST": interpreting() and dtype == torch.bfloat16, "ACC": acc}


def block_dim(dim: int) -> int:
    """The power of two >= dim (and >= 16) that a kernel's tiles take for a head dim."""
    return max(16, triton.next_power_of_2(dim))
