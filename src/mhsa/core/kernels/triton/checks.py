"""Input checks for the Triton kernels: what they cannot take raises ValueError or
TypeError saying what to do."""

from __future__ import annotations

import os

import torch
from torch import Tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_inputs(q: Tensor, k: Tensor, v: Tensor | None, mask, bias: Tensor | None) -> None:
    """Raise ValueError/TypeError for what the kernels cannot take, saying what to do."""
    v = k if v is None else v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, length, dim), got {got}")
    dtypes = DTYPES + ((torch.float64,) if interpreting() else ())
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"the triton kernels take float32, float16 or bfloat16 q, k, v of one dtype "
            f"(float64 only under the interpreter), got {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them, or use backend='flash' for float64"
        )
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"q is on {q.device}: the triton kernels need a CUDA device (or TRITON_INTERPRET=1 "
            "set before importing triton, slow, for tests); move q, k, v with .cuda()"
        )
    batch, num_heads, _, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must be (batch, H_kv, S, D) for q {tuple(q.shape)}")
    if v.shape[1:3] != k.shape[1:3] or num_heads % k.shape[1] != 0:
        raise ValueError(
            f"v {tuple(v.shape)} must share k's heads and length, and q's {num_heads} heads "
            f"must be a multiple of k's {k.shape[1]}"
        )
    if max(head_dim, v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(
            f"head dims up to {MAX_HEAD_DIM} are supported, got D={head_dim}, D_v={v.shape[3]}; "
            "use backend='flash' for larger heads"
        )
    shape = (batch, num_heads, q.shape[2], k.shape[2])
    for name, t in (("mask", mask), ("bias", bias)):
        if isinstance(t, Tensor) and (
            t.dim() > 4
            or any(a not in (1, b) for a, b in zip(t.shape[::-1], shape[::-1], strict=False))
        ):
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} does not broadcast to (B, H, L, S) = "
                f"{shape}; give it size-1 dimensions where it is shared"
            )
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool (True = may attend), got {mask.dtype}; use bias=")
    if bias is not None and not bias.is_floating_point():
        raise TypeError(f"bias must be a float tensor, got {bias.dtype}")


def check_score(score, sinks: Tensor | None, q: Tensor) -> None:
    """The score function's own check (one value per query head, on q's device) and
    sinks (H,) float on q's device."""
    num_heads = q.shape[1]
    if score is not None:
        score.check(num_heads, q.device, torch.float32)
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a float tensor of shape (H,), got {got}")
    if tuple(sinks.shape) != (num_heads,) or sinks.device.type != q.device.type:
        raise ValueError(
            f"sinks must be one logit per query head, shape ({num_heads},) on "
            f"{q.device}, got {tuple(sinks.shape)} on {sinks.device}"
        )
