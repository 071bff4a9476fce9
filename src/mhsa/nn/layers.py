"""Transformer layers: attention and feed-forward sublayers, each with a residual
connection and layer norm (nn/feedforward.py). Inputs are batch-first (B, L, d_model);
masks are bool, True = may attend. The stacks of them are in nn/stacks.py.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..cache import KVCache, MemoryCache
from .attention import MultiHeadAttention
from .convert import copy_norms, layer_from_torch
from .feedforward import FeedForward, Residual
from .positional import AttentionPosition


class TransformerEncoderLayer(nn.Module):
    """Self-attention then feed-forward, each with a residual connection and layer norm."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        num_kv_heads: int | None = None,
        bias: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(
            d_model,
            num_heads,
            num_kv_heads=num_kv_heads,
            bias=bias,
            dropout=dropout,
            backend=backend,
        )
        self.feed_forward = FeedForward(
            d_model, dim_feedforward, dropout=dropout, activation=activation, bias=bias
        )
        self.attn_block = Residual(d_model, dropout, layer_norm_eps, norm_first)
        self.ff_block = Residual(d_model, dropout, layer_norm_eps, norm_first)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        position: AttentionPosition | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model)."""
        x = _self_attention(
            self.self_attn, self.attn_block, x, mask, key_padding_mask, causal, position, cache
        )
        return self.ff_block(x, self.feed_forward)

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
        """Copy a torch.nn.TransformerEncoderLayer (batch-first or not)."""
        ours = layer_from_torch(cls, layer)
        copy_norms((ours.attn_block, ours.ff_block), (layer.norm1, layer.norm2))
        return ours


class TransformerDecoderLayer(nn.Module):
    """Self-attention, cross-attention to the encoder output, then feed-forward."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        num_kv_heads: int | None = None,
        bias: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        attn_options = {
            "num_kv_heads": num_kv_heads,
            "bias": bias,
            "dropout": dropout,
            "backend": backend,
        }
        self.self_attn = MultiHeadAttention(d_model, num_heads, **attn_options)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, **attn_options)
        self.feed_forward = FeedForward(
            d_model, dim_feedforward, dropout=dropout, activation=activation, bias=bias
        )
        self.self_block = Residual(d_model, dropout, layer_norm_eps, norm_first)
        self.cross_block = Residual(d_model, dropout, layer_norm_eps, norm_first)
        self.ff_block = Residual(d_model, dropout, layer_norm_eps, norm_first)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        memory_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        position: AttentionPosition | None = None,
        cache: KVCache | None = None,
        memory_cache: MemoryCache | None = None,
    ) -> Tensor:
        """x (B, L, d_model), memory (B, S, d_model) -> (B, L, d_model).

        cache holds this layer's self-attention keys/values while decoding;
        memory_cache its cross-attention keys/values, projected from memory once."""

        def cross_attend(h: Tensor) -> Tensor:
            return self.cross_attn(
                h,
                memory,
                mask=memory_mask,
                key_padding_mask=memory_key_padding_mask,
                cache=memory_cache,
            )

        x = _self_attention(
            self.self_attn, self.self_block, x, mask, key_padding_mask, causal, position, cache
        )
        x = self.cross_block(x, cross_attend)
        return self.ff_block(x, self.feed_forward)

    @classmethod
    def from_torch(cls, layer: nn.TransformerDecoderLayer) -> TransformerDecoderLayer:
        """Copy a torch.nn.TransformerDecoderLayer (batch-first or not)."""
        ours = layer_from_torch(cls, layer)
        ours.cross_attn = MultiHeadAttention.from_torch(layer.multihead_attn)
        copy_norms(
            (ours.self_block, ours.cross_block, ours.ff_block),
            (layer.norm1, layer.norm2, layer.norm3),
        )
        return ours


def _self_attention(
    attn: MultiHeadAttention,
    block: Residual,
    x: Tensor,
    mask: Tensor | None,
    key_padding_mask: Tensor | None,
    causal: bool,
    position: AttentionPosition | None,
    cache: KVCache | None,
) -> Tensor:
    """The self-attention sublayer of either layer: x (B, L, d_model) through `block`
    (residual and norm) around `attn` with these masks, positions and cache."""

    def attend(h: Tensor) -> Tensor:
        return attn(
            h,
            mask=mask,
            key_padding_mask=key_padding_mask,
            causal=causal,
            position=position,
            cache=cache,
        )

    return block(x, attend)


__all__ = ["TransformerDecoderLayer", "TransformerEncoderLayer"]
