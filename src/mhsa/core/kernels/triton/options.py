"""Launch options that every Triton kernel takes: the dot products' precision, the
padded head dim, the score function's constexprs and the launch configuration."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import interpreting


def strides(*tensors: torch.Tensor) -> list[int]:
    """Each tensor's strides, in order: a kernel's stride arguments."""
    return [stride for t in tensors for stride in t.stride()]


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


def kernel_options(q, score, launch: tuple[int, int, int, int], acc: bool = True) -> dict:
    """The constexprs and launch options of an attention kernel on q (B, H, L, D) with
    the kernel score function `score` and launch (BLOCK_M, BLOCK_N, num_warps,
    num_stages); acc=False for kernels that always accumulate in float32 (no ACC)."""
    block_m, block_n, warps, stages = launch
    options = dot_options(q.dtype)
    if not acc:
        del options["ACC"]
    return dict(
        **options,
        **score.constants(q),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_dim(q.shape[3]),
        num_warps=warps,
        num_stages=stages,
    )
