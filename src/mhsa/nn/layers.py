"""Transformer layers and stacks: attention + feed-forward, residuals and layer norm.

Post-norm (the original paper, the default): x = norm(x + sublayer(x)).
Pre-norm (norm_first=True): x = x + sublayer(norm(x)).
Inputs are batch-first (B, L, d_model). Masks are bool, True = may attend.
"""

from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import DecoderCache, KVCache, MemoryCache
from ..positional import AttentionPosition
from .attention import MultiHeadAttention

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
}


class FeedForward(nn.Module):
    """Position-wise feed-forward: linear2(dropout(activation(linear1(x))))."""

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int,
        *,
        dropout: float = 0.0,
        activation: str = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d_model) -> (..., d_model)."""
        return self.linear2(self.dropout(ACTIVATIONS[self.activation](self.linear1(x))))


class _Residual(nn.Module):
    """One sublayer wrapped in dropout, a residual connection and a layer norm."""

    def __init__(self, d_model: int, dropout: float, eps: float, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


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
        self.attn_block = _Residual(d_model, dropout, layer_norm_eps, norm_first)
        self.ff_block = _Residual(d_model, dropout, layer_norm_eps, norm_first)

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

        def attend(h: Tensor) -> Tensor:
            return self.self_attn(
                h,
                mask=mask,
                key_padding_mask=key_padding_mask,
                causal=causal,
                position=position,
                cache=cache,
            )

        x = self.attn_block(x, attend)
        return self.ff_block(x, self.feed_forward)

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
        """Copy a torch.nn.TransformerEncoderLayer (batch-first or not)."""
        ours = cls(
            layer.self_attn.embed_dim,
            layer.self_attn.num_heads,
            **_torch_layer_options(layer),
        )
        ours.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
        _copy_feed_forward(ours.feed_forward, layer)
        _copy_norms((ours.attn_block, ours.ff_block), (layer.norm1, layer.norm2))
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
        self.self_block = _Residual(d_model, dropout, layer_norm_eps, norm_first)
        self.cross_block = _Residual(d_model, dropout, layer_norm_eps, norm_first)
        self.ff_block = _Residual(d_model, dropout, layer_norm_eps, norm_first)

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

        def self_attend(h: Tensor) -> Tensor:
            return self.self_attn(
                h,
                mask=mask,
                key_padding_mask=key_padding_mask,
                causal=causal,
                position=position,
                cache=cache,
            )

        def cross_attend(h: Tensor) -> Tensor:
            return self.cross_attn(
                h,
                memory,
                mask=memory_mask,
                key_padding_mask=memory_key_padding_mask,
                cache=memory_cache,
            )

        x = self.self_block(x, self_attend)
        x = self.cross_block(x, cross_attend)
        return self.ff_block(x, self.feed_forward)

    @classmethod
    def from_torch(cls, layer: nn.TransformerDecoderLayer) -> TransformerDecoderLayer:
        """Copy a torch.nn.TransformerDecoderLayer (batch-first or not)."""
        ours = cls(
            layer.self_attn.embed_dim,
            layer.self_attn.num_heads,
            **_torch_layer_options(layer),
        )
        ours.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
        ours.cross_attn = MultiHeadAttention.from_torch(layer.multihead_attn)
        _copy_feed_forward(ours.feed_forward, layer)
        _copy_norms(
            (ours.self_block, ours.cross_block, ours.ff_block),
            (layer.norm1, layer.norm2, layer.norm3),
        )
        return ours


class TransformerEncoder(nn.Module):
    """`num_layers` copies of an encoder layer, then an optional final norm."""

    def __init__(
        self, layer: TransformerEncoderLayer, num_layers: int, norm: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.norm = norm

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        position: AttentionPosition | None = None,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model)."""
        for layer in self.layers:
            x = layer(
                x, mask=mask, key_padding_mask=key_padding_mask, causal=causal, position=position
            )
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, encoder: nn.TransformerEncoder) -> TransformerEncoder:
        layers = [TransformerEncoderLayer.from_torch(layer) for layer in encoder.layers]
        return _stack_from(cls, layers, encoder.norm)


class TransformerDecoder(nn.Module):
    """`num_layers` copies of a decoder layer, then an optional final norm."""

    def __init__(
        self, layer: TransformerDecoderLayer, num_layers: int, norm: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.norm = norm

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
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """x (B, L, d_model), memory (B, S, d_model) -> (B, L, d_model).

        With a cache, x holds only the new tokens (causal is aligned bottom-right)."""
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                memory,
                mask=mask,
                key_padding_mask=key_padding_mask,
                causal=causal,
                memory_mask=memory_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                position=position,
                cache=None if cache is None else cache.self_attn[i],
                memory_cache=None if cache is None else cache.cross_attn[i],
            )
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, decoder: nn.TransformerDecoder) -> TransformerDecoder:
        layers = [TransformerDecoderLayer.from_torch(layer) for layer in decoder.layers]
        return _stack_from(cls, layers, decoder.norm)


class Transformer(nn.Module):
    """The encoder-decoder Transformer of "Attention Is All You Need" (no embeddings).

    Both stacks end in a layer norm, as in torch.nn.Transformer.
    """

    def __init__(
        self,
        d_model: int = 512,
        num_heads: int = 8,
        *,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
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
        options = {
            "dim_feedforward": dim_feedforward,
            "dropout": dropout,
            "activation": activation,
            "norm_first": norm_first,
            "layer_norm_eps": layer_norm_eps,
            "num_kv_heads": num_kv_heads,
            "bias": bias,
            "backend": backend,
        }
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(d_model, num_heads, **options),
            num_encoder_layers,
            nn.LayerNorm(d_model, eps=layer_norm_eps),
        )
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(d_model, num_heads, **options),
            num_decoder_layers,
            nn.LayerNorm(d_model, eps=layer_norm_eps),
        )

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_causal: bool = False,
    ) -> Tensor:
        """src (B, S, d_model), tgt (B, L, d_model) -> (B, L, d_model)."""
        memory = self.encoder(src, mask=src_mask, key_padding_mask=src_key_padding_mask)
        return self.decoder(
            tgt,
            memory,
            mask=tgt_mask,
            key_padding_mask=tgt_key_padding_mask,
            causal=tgt_causal,
            memory_mask=memory_mask,
            memory_key_padding_mask=memory_key_padding_mask,
        )

    @classmethod
    def from_torch(cls, model: nn.Transformer) -> Transformer:
        """Copy a torch.nn.Transformer (batch-first or not)."""
        ours = cls(model.d_model, model.nhead, num_encoder_layers=0, num_decoder_layers=0)
        ours.encoder = TransformerEncoder.from_torch(model.encoder)
        ours.decoder = TransformerDecoder.from_torch(model.decoder)
        return ours


def _torch_layer_options(layer: nn.Module) -> dict:
    """Constructor options that reproduce a torch Transformer*Layer."""
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        activation = "relu"
    elif act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        activation = "gelu"
    else:
        raise ValueError(f"only relu and gelu activations can be copied, got {act}")
    return {
        "dim_feedforward": layer.linear1.out_features,
        "dropout": layer.dropout.p,
        "activation": activation,
        "norm_first": layer.norm_first,
        "layer_norm_eps": layer.norm1.eps,
        "bias": layer.linear1.bias is not None,
    }


def _copy_feed_forward(ff: FeedForward, layer: nn.Module) -> None:
    ff.linear1.load_state_dict(layer.linear1.state_dict())
    ff.linear2.load_state_dict(layer.linear2.state_dict())


def _copy_norms(blocks: tuple[_Residual, ...], norms: tuple[nn.LayerNorm, ...]) -> None:
    for block, norm in zip(blocks, norms, strict=True):
        block.norm.load_state_dict(norm.state_dict())


def _stack_from(cls, layers: list[nn.Module], norm: nn.Module | None):
    stack = cls(layers[0], 0, copy.deepcopy(norm))
    stack.layers = nn.ModuleList(layers)
    return stack


__all__ = [
    "FeedForward",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
