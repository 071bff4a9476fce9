"""Attention modules and transformer layers built on mhsa.attention.

attention.py     MultiHeadAttention (self/cross, GQA, positions, caches)
feedforward.py   the feed-forward sublayer and the residual + norm wrapper
layers.py        encoder and decoder layers
stacks.py        encoder and decoder stacks, the encoder-decoder Transformer
convert.py       copying torch.nn Transformer modules into ours
"""

from .attention import MultiHeadAttention, from_torch_masks
from .feedforward import FeedForward
from .layers import TransformerDecoderLayer, TransformerEncoderLayer
from .stacks import Transformer, TransformerDecoder, TransformerEncoder

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
