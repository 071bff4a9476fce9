"""Input checks for the attention entry points.

Every check raises ValueError (bad value or shape) or TypeError (bad type or dtype)
with a message that names the argument, says what it got, and how to fix it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .checks import int_at_least as int_at_least  # re-exported for the layers above
from .checks import tensors_of_rank
from .masks.base import Pattern
from .masks.patterns import SlidingWindow

LAYOUT = "(batch, num_heads, seq_len, head_dim)"


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Check q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v) against each other."""
    tensors_of_rank(4, LAYOUT, "; for a single head add one with .unsqueeze(1)", q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating point tensor, got dtype {t.dtype}; "
                "convert it with .float()"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            "cast them with .to(q.dtype)"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}; "
            "move them with .to(q.device)"
        )
    batch, num_heads, _, head_dim = q.shape
    if head_dim == 0 or num_heads == 0:
        raise ValueError(
            f"q has {num_heads} heads of head_dim {head_dim}: both must be >= 1 {LAYOUT}"
        )
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(
            f"batch size differs: q has {batch}, k has {k.shape[0]}, v has {v.shape[0]}"
        )
    if k.shape[3] != head_dim:
        raise ValueError(
            f"head_dim differs: q has {head_dim}, k has {k.shape[3]}; "
            "q and k must have the same last dimension"
        )
    if v.shape[1] != k.shape[1]:
        raise ValueError(
            f"k and v must have the same number of heads, got k {k.shape[1]}, v {v.shape[1]}"
        )
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"k and v must have the same length, got k {k.shape[2]}, v {v.shape[2]}")
    num_kv_heads = k.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q's num_heads ({num_heads}) must be a multiple of k/v's num_kv_heads "
            f"({num_kv_heads}) for grouped-query attention"
        )


def _check_broadcast(name: str, t: Tensor, target: tuple[int, ...]) -> None:
    ok = t.dim() <= len(target) and all(
        got in (1, want) for got, want in zip(reversed(t.shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} does not broadcast to (batch, num_heads, "
            f"q_len, kv_len) = {target}; give it shape {target} or size-1 dimensions "
            "where it is shared, e.g. (batch, 1, 1, kv_len) for key padding"
        )


def check_mask(mask, target: tuple[int, ...], device: torch.device, sharded: bool = False) -> None:
    """A mask is a pattern from mhsa.core.masks, or a bool tensor (True = may attend)
    broadcastable to (B, H, L, S). sharded: q and k are one rank's shards, so a
    pattern's lengths are global (the ring backend checks them)."""
    if mask is None:
        return
    if isinstance(mask, Pattern):
        if not sharded:
            mask.check_lengths(target[2], target[3])
        mask.check_batch(target[0])
        return
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"mask must be a bool torch.Tensor, an mhsa.core.masks pattern or None, "
            f"got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(
            f"mask must have dtype torch.bool (True = may attend), got {mask.dtype}; "
            "if nonzero means 'attend' use mask.bool(), and pass additive float "
            "values as bias= instead"
        )
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but q is on {device}; move it with .to()")
    _check_broadcast("mask", mask, target)


def check_bias(bias: Tensor | None, target: tuple[int, ...], device: torch.device) -> None:
    """A bias is a float tensor added to the scores, broadcastable to (B, H, L, S)."""
    if bias is None:
        return
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a float torch.Tensor or None, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(
            f"bias must be a floating point tensor added to the scores, got {bias.dtype}; "
            "boolean masks go in mask= (True = may attend)"
        )
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but q is on {device}; move it with .to()")
    _check_broadcast("bias", bias, target)


def check_sinks(sinks: Tensor | None, num_heads: int, device: torch.device) -> None:
    """Sinks are (H,) float logits, one per query head."""
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a float tensor of shape (H,), got {got}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"sinks must have shape (H,) = ({num_heads},), one logit per query "
            f"head, got {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {device}; move them with .to()")


def check_scale(scale: float | None) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"scale must be finite and > 0, got {scale}; leave it None for 1/sqrt(head_dim)"
        )


def check_dropout(dropout_p: float, name: str = "dropout_p") -> None:
    """A dropout probability in [0, 1), named `name` in the error."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p}")


def check_causal(causal: bool) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {type(causal).__name__}")


def resolved_scale(q: Tensor, scale: float | None) -> float:
    """The scale of q k^T: `scale`, or 1 / sqrt(D) by default."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def paged_window(mask, causal: bool, q_len: int) -> int | None:
    """The window of attention over paged keys (block_table=), which is causal per
    sequence: `left` of a SlidingWindow(left, 0) mask, or None for plain causal (a
    single query sees every key either way, so causal may be False for it)."""
    if isinstance(mask, SlidingWindow) and mask.right == 0:
        return mask.left
    if mask is None and (causal or q_len == 1):
        return None
    raise ValueError(
        f"attention over paged keys (block_table=) attends causally "
        f"(causal=True), optionally within SlidingWindow(left, 0); got mask "
        f"{mask!r}, causal={causal}"
    )
