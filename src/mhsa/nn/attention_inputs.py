"""What every attention module does to its inputs before it attends: torch's masks turned
into ours, masks merged with key padding (the caller's and the cache's), a position's
bias added, and q and k rotated at each sequence's positions."""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import Cache
from ..core.checks import int_at_least
from ..core.masks import KeyPadding, Pattern
from .positional import AttentionPosition, RotaryEmbedding


def from_torch_masks(
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    num_heads: int | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Convert torch.nn.MultiheadAttention's masks to ours: (mask, key_padding_mask, bias).

    torch's bool masks mean "masked" where True; ours mean "may attend". torch's float
    masks are additive and become our bias. This is the one place polarity flips.
    attn_mask is (L, S), or (B * num_heads, L, S) with num_heads given: it becomes
    (B, num_heads, L, S).
    """
    mask = bias = padding = None
    for name, given in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if given is None:
            continue
        if not isinstance(given, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(given).__name__}")
        if given.dtype != torch.bool and not given.is_floating_point():
            raise TypeError(  # (an int mask once read as a bias of +0/+1: the masked favoured)
                f"{name} must be bool (True: masked, as torch's) or float (added), got "
                f"{given.dtype}; convert a 0/1 mask with .bool()"
            )
    if attn_mask is not None and attn_mask.dim() == 3:
        if num_heads is not None:
            int_at_least("num_heads", num_heads, 1)
        if num_heads is None or attn_mask.shape[0] % num_heads:
            raise ValueError(
                f"a 3-D attn_mask {tuple(attn_mask.shape)} is torch's (batch * num_heads, "
                f"L, S): pass num_heads= (got {num_heads}), a divisor of its first dim"
            )
        attn_mask = attn_mask.view(-1, num_heads, *attn_mask.shape[1:])
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = ~attn_mask
        else:
            bias = attn_mask
    if key_padding_mask is not None:
        if key_padding_mask.dtype == torch.bool:
            padding = ~key_padding_mask
        else:  # additive float padding mask: -inf where masked
            extra = key_padding_mask[:, None, None, :]
            bias = extra if bias is None else bias + extra
    return mask, padding, bias


def rotate_at_positions(
    position: AttentionPosition, q: Tensor, k: Tensor, cache: Cache | None
) -> tuple[Tensor, Tensor]:
    """q (B, H, L, D), k (B, H_kv, L, D) rotated by `position` at the new tokens'
    positions: 0..L-1 without a cache (or with a cross-attention memory), the cache's
    next_positions with one (each sequence's own: left padding, pages)."""
    fixed = isinstance(getattr(position, "positions", None), Tensor)  # rotary.at(positions)
    if fixed or type(position).rotate is AttentionPosition.rotate:  # (scores only: ALiBi, T5)
        return position.rotate(q, k, 0)
    positions = None if cache is None else cache.next_positions(q.shape[2])
    if positions is None:
        return position.rotate(q, k, 0)
    if not isinstance(position, RotaryEmbedding):
        raise TypeError(
            f"with a cache, positions come from the cache per sequence: it "
            f"takes rotary positions (rotated at them) and score functions (ALiBi, "
            f"T5), not {type(position).__name__}, which rotates from one "
            "offset"
        )
    return position.at(positions).rotate(q, k, 0)


# a position's dense bias (attention_bias) over a paged cache
PAGED_BIAS = (
    "a paged cache takes no bias; this position gives a dense one (attention_bias): "
    "give it a score function (score()) instead"
)


def attention_masks(
    mask, key_padding_mask, bias, position, cache, batch: int, q_len: int, kv_len: int
) -> tuple:
    """The mask and bias of attention over kv_len keys (the cache's, once updated): the
    caller's mask merged with its key padding and the cache's (which cached keys are left
    padding), and the caller's bias plus the position's (ALiBi, T5 as a tensor)."""
    cached_padding = None if cache is None else cache.key_padding()
    if cached_padding is not None:
        both = key_padding_mask is not None
        key_padding_mask = key_padding_mask & cached_padding if both else cached_padding
    extra = None if position is None else position.attention_bias(q_len, kv_len)
    if extra is not None:
        bias = extra if bias is None else bias + extra
    return merge_masks(mask, key_padding_mask, batch, kv_len), bias


def merge_masks(
    mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, kv_len: int
) -> Tensor | None:
    """mask and key_padding_mask (B, S), True = a real token, as one mask: a pattern stays a
    pattern (the flash engine plans it), a tensor becomes (B, 1, 1, S) and is and-ed."""
    if key_padding_mask is None:
        return mask
    if (
        not isinstance(key_padding_mask, Tensor)
        or key_padding_mask.dtype != torch.bool
        or tuple(key_padding_mask.shape) != (batch, kv_len)
    ):
        got = (
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            if isinstance(key_padding_mask, Tensor)
            else type(key_padding_mask).__name__
        )
        raise ValueError(
            f"key_padding_mask must be bool of shape (batch, kv_len) = {(batch, kv_len)}, "
            f"True = a real token; got {got}"
        )
    if isinstance(mask, Pattern):  # stays a pattern, so the flash engine can plan it
        return mask & KeyPadding(key_padding_mask)
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        raise TypeError(
            f"mask must have dtype torch.bool (True = may attend), got {mask.dtype}; "
            "if nonzero means 'attend' use mask.bool(), and pass additive float "
            "values as bias= instead"
        )
    padding = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
    if mask is None:
        return padding
    try:  # (the and below raised torch's broadcast error, naming no argument)
        torch.broadcast_shapes(mask.shape, padding.shape)
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast with key_padding_mask "
            f"{tuple(key_padding_mask.shape)}: it must broadcast to (batch, heads, L, S) "
            f"with S = {kv_len}"
        ) from None
    return mask & padding
