"""Transformer layers: attention and feed-forward sublayers, each with a residual
connection and layer norm (nn/feedforward.py). Inputs are batch-first (B, L, d_model);
masks are bool, True = may attend; biases are added to the scores (torch's float masks:
from_torch_masks turns one into a bias). The stacks of them are in nn/stacks.py.
"""

from __future__ import annotations

from typing import TypedDict

from torch import Tensor, nn
from typing_extensions import Self

from ..cache import KVCache, MemoryCache
from .attention import MultiHeadAttention
from .convert import copy_norms, layer_from_torch
from .feedforward import FeedForward, Residual
from .positional import AttentionPosition


class SelfAttentionMasks(TypedDict, total=False):
    """The self-attention keywords of a layer's forward; a stack gives them to every layer."""

    mask: Tensor | None
    key_padding_mask: Tensor | None
    bias: Tensor | None
    causal: bool
    position: AttentionPosition | None


class DecoderMasks(SelfAttentionMasks, total=False):
    """SelfAttentionMasks and the decoder layer's cross-attention keywords."""

    memory_mask: Tensor | None
    memory_key_padding_mask: Tensor | None
    memory_bias: Tensor | None


# torch.nn.Transformer's layer norm epsilon, the layers' default and the stacks'
LAYER_NORM_EPS = 1e-5


class LayerOptions(TypedDict, total=False):
    """A layer's keywords after (d_model, num_heads), as TransformerEncoderLayer takes
    them (its signature holds the defaults); Transformer gives them to every layer."""

    dim_feedforward: int
    dropout: float
    activation: str
    norm_first: bool
    layer_norm_eps: float
    num_kv_heads: int | None
    bias: bool
    backend: str


class _TransformerLayer(nn.Module):
    """What both layers share: the constructor, with torch.nn.Transformer*Layer's options,
    and from_torch. A layer holds self_attn, cross_attn (decoder only) and feed_forward,
    and one Residual (norm and dropout) per sublayer, named in `blocks`."""

    blocks: tuple[str, ...]  # the Residual of each sublayer, in order
    has_cross_attention: bool
    torch_type: type[nn.Module]  # the torch layer from_torch copies

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = LAYER_NORM_EPS,
        num_kv_heads: int | None = None,
        bias: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()

        def attention() -> MultiHeadAttention:
            return MultiHeadAttention(
                d_model,
                num_heads,
                num_kv_heads=num_kv_heads,
                bias=bias,
                dropout=dropout,
                backend=backend,
            )

        self.self_attn = attention()
        if self.has_cross_attention:
            self.cross_attn = attention()
        self.feed_forward = FeedForward(
            d_model, dim_feedforward, dropout=dropout, activation=activation, bias=bias
        )
        for name in self.blocks:
            self.add_module(name, Residual(d_model, dropout, layer_norm_eps, norm_first, bias))

    @classmethod
    def from_torch(cls, layer: nn.Module) -> Self:
        """Copy a torch.nn.TransformerEncoderLayer or TransformerDecoderLayer (to the
        matching class; batch-first or not), in its training mode."""
        if not isinstance(layer, cls.torch_type):
            raise TypeError(
                f"{cls.__name__}.from_torch copies a torch.nn.{cls.torch_type.__name__}, "
                f"got {type(layer).__name__}"
            )
        ours = layer_from_torch(cls, layer)
        if cls.has_cross_attention:
            ours.cross_attn = MultiHeadAttention.from_torch(layer.multihead_attn)
        norms = [getattr(layer, f"norm{i}") for i in range(1, len(cls.blocks) + 1)]
        copy_norms(tuple(getattr(ours, name) for name in cls.blocks), tuple(norms))
        return ours.train(layer.training)

    def _self_attention(
        self,
        x: Tensor,
        mask: Tensor | None,
        key_padding_mask: Tensor | None,
        bias: Tensor | None,
        causal: bool,
        position: AttentionPosition | None,
        cache: KVCache | None,
    ) -> Tensor:
        """The self-attention sublayer: x (B, L, d_model) through its Residual (the first
        block) around self_attn with these masks, positions and cache."""

        def attend(h: Tensor) -> Tensor:
            return self.self_attn(
                h,
                mask=mask,
                key_padding_mask=key_padding_mask,
                bias=bias,
                causal=causal,
                position=position,
                cache=cache,
            )

        return getattr(self, self.blocks[0])(x, attend)


class TransformerEncoderLayer(_TransformerLayer):
    """Self-attention then feed-forward, each with a residual connection and layer norm."""

    blocks = ("attn_block", "ff_block")
    has_cross_attention = False
    torch_type = nn.TransformerEncoderLayer

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        bias: Tensor | None = None,
        causal: bool = False,
        position: AttentionPosition | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model); bias broadcastable to (B, H, L, L)."""
        x = self._self_attention(x, mask, key_padding_mask, bias, causal, position, cache)
        return self.ff_block(x, self.feed_forward)


class TransformerDecoderLayer(_TransformerLayer):
    """Self-attention, cross-attention to the encoder output, then feed-forward."""

    blocks = ("self_block", "cross_block", "ff_block")
    has_cross_attention = True
    torch_type = nn.TransformerDecoderLayer

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        bias: Tensor | None = None,
        causal: bool = False,
        memory_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        memory_bias: Tensor | None = None,
        position: AttentionPosition | None = None,
        cache: KVCache | None = None,
        memory_cache: MemoryCache | None = None,
    ) -> Tensor:
        """x (B, L, d_model), memory (B, S, d_model) -> (B, L, d_model); bias and
        memory_bias broadcastable to (B, H, L, L) and (B, H, L, S).

        cache holds this layer's self-attention keys/values while decoding;
        memory_cache its cross-attention keys/values, projected from memory once."""

        def cross_attend(h: Tensor) -> Tensor:
            return self.cross_attn(
                h,
                memory,
                mask=memory_mask,
                key_padding_mask=memory_key_padding_mask,
                bias=memory_bias,
                cache=memory_cache,
            )

        x = self._self_attention(x, mask, key_padding_mask, bias, causal, position, cache)
        x = self.cross_block(x, cross_attend)
        return self.ff_block(x, self.feed_forward)


__all__ = [
    "DecoderMasks",
    "SelfAttentionMasks",
    "TransformerDecoderLayer",
    "TransformerEncoderLayer",
]
