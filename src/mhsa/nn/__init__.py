"""Attention modules and transformer layers built on mhsa.attention."""

from .attention import MultiHeadAttention, from_torch_masks
from .layers import (
    FeedForward,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "FeedForward",
    "MultiHeadAttention",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "from_torch_masks",
]
