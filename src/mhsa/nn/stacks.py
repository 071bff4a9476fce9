"""Stacks of transformer layers and the encoder-decoder Transformer of "Attention Is
All You Need" (without embeddings). Inputs are batch-first (B, L, d_model).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ..cache import DecoderCache
from ..core.checks import int_at_least
from .layers import (
    LAYER_NORM_EPS,
    DecoderMasks,
    LayerOptions,
    SelfAttentionMasks,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _LayerStack(nn.Module):
    """`num_layers` copies of a layer, then an optional final norm."""

    layer_type: type[nn.Module]  # what from_torch builds each layer as
    torch_type: type[nn.Module]  # the torch stack from_torch copies

    def __init__(self, layer: nn.Module, num_layers: int, norm: nn.Module | None = None) -> None:
        super().__init__()
        int_at_least("num_layers", num_layers, 0)  # (-3 built a stack of none)
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.norm = norm

    def _final_norm(self, x: Tensor) -> Tensor:
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, stack: nn.Module) -> _LayerStack:
        """Copy a torch.nn.TransformerEncoder or TransformerDecoder (batch-first or not),
        in its training mode."""
        if not isinstance(stack, cls.torch_type):
            raise TypeError(
                f"{cls.__name__}.from_torch copies a torch.nn.{cls.torch_type.__name__}, "
                f"got {type(stack).__name__}"
            )
        layers = [cls.layer_type.from_torch(layer) for layer in stack.layers]
        ours = cls(layers[0], 0, copy.deepcopy(stack.norm))
        ours.layers = nn.ModuleList(layers)
        return ours.train(stack.training)


def encoder_layers(num_layers: int, d_model: int, num_heads: int, **options: Any) -> nn.ModuleList:
    """`num_layers` TransformerEncoderLayer(d_model, num_heads, **options), each one
    initialised on its own (a TransformerEncoder deep-copies one layer instead)."""
    int_at_least("num_layers", num_layers, 0)
    return nn.ModuleList(
        TransformerEncoderLayer(d_model, num_heads, **options) for _ in range(num_layers)
    )


class TransformerEncoder(_LayerStack):
    """`num_layers` copies of an encoder layer, then an optional final norm."""

    layer_type = TransformerEncoderLayer
    torch_type = nn.TransformerEncoder

    def forward(self, x: Tensor, **masks: Unpack[SelfAttentionMasks]) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model). masks: TransformerEncoderLayer.forward's
        mask, key_padding_mask, bias, causal and position, given to every layer."""
        for layer in self.layers:
            x = layer(x, **masks)
        return self._final_norm(x)


class TransformerDecoder(_LayerStack):
    """`num_layers` copies of a decoder layer, then an optional final norm."""

    layer_type = TransformerDecoderLayer
    torch_type = nn.TransformerDecoder

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        cache: DecoderCache | None = None,
        **masks: Unpack[DecoderMasks],
    ) -> Tensor:
        """x (B, L, d_model), memory (B, S, d_model) -> (B, L, d_model). masks:
        TransformerDecoderLayer.forward's mask keywords, given to every layer.

        With a cache, x holds only the new tokens (causal is aligned bottom-right)."""
        for i, layer in enumerate(self.layers):
            self_cache = None if cache is None else cache.self_attn[i]
            memory_cache = None if cache is None else cache.cross_attn[i]
            x = layer(x, memory, cache=self_cache, memory_cache=memory_cache, **masks)
        return self._final_norm(x)


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
        **layer_options: Unpack[LayerOptions],
    ) -> None:
        """layer_options: the layers' keywords (LayerOptions: dim_feedforward, dropout,
        activation, norm_first, layer_norm_eps, num_kv_heads, bias, backend), with
        torch.nn.Transformer's defaults; the stacks' final norms take layer_norm_eps and
        bias."""
        super().__init__()
        eps = layer_options.get("layer_norm_eps", LAYER_NORM_EPS)
        bias = layer_options.get("bias", True)
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(d_model, num_heads, **layer_options),
            num_encoder_layers,
            nn.LayerNorm(d_model, eps=eps, bias=bias),
        )
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(d_model, num_heads, **layer_options),
            num_decoder_layers,
            nn.LayerNorm(d_model, eps=eps, bias=bias),
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
        src_bias: Tensor | None = None,
        tgt_bias: Tensor | None = None,
        memory_bias: Tensor | None = None,
    ) -> Tensor:
        """src (B, S, d_model), tgt (B, L, d_model) -> (B, L, d_model). The biases are
        added to the scores of the encoder's, the decoder's and the cross-attention
        (torch's float masks: from_torch_masks turns each into one)."""
        memory = self.encoder(
            src, mask=src_mask, key_padding_mask=src_key_padding_mask, bias=src_bias
        )
        return self.decoder(
            tgt,
            memory,
            mask=tgt_mask,
            key_padding_mask=tgt_key_padding_mask,
            bias=tgt_bias,
            causal=tgt_causal,
            memory_mask=memory_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            memory_bias=memory_bias,
        )

    @classmethod
    def from_torch(cls, model: nn.Transformer) -> Transformer:
        """Copy a torch.nn.Transformer (batch-first or not), in its training mode."""
        if not isinstance(model, nn.Transformer):
            raise TypeError(f"model must be a torch.nn.Transformer, got {type(model).__name__}")
        ours = cls(model.d_model, model.nhead, num_encoder_layers=0, num_decoder_layers=0)
        ours.encoder = TransformerEncoder.from_torch(model.encoder)
        ours.decoder = TransformerDecoder.from_torch(model.decoder)
        return ours.train(model.training)


__all__ = ["Transformer", "TransformerDecoder", "TransformerEncoder", "encoder_layers"]
