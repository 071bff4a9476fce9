"""Attention modules and transformer layers built on mhsa.attention.

attention_base.py AttentionModule: one forward, checks and cache handling for all four below
attention.py     MultiHeadAttention (self/cross, GQA, positions, caches)
latent.py        LatentAttention (MLA: DeepSeek, MiniCPM3), absorbed decoding
moe.py           MoEFeedForward: DeepSeek-V3's routed + shared experts, written plainly
feedforward.py   the feed-forward sublayers (plain, gated) and the residual + norm wrapper
norm.py          RMSNorm
differential.py  DiffAttention (the Differential Transformer's attention)
moba.py          MoBA (Mixture of Block Attention)
layers.py        encoder and decoder layers
stacks.py        encoder and decoder stacks, the encoder-decoder Transformer, encoder_layers
convert.py       copying torch.nn Transformer modules into ours
quantized.py     weight-only int4/int8 linears on torch's CPU kernels
layout.py        the decoding layout: transposed float weights, fused projections
"""

from .attention import MultiHeadAttention
from .attention_inputs import from_torch_masks
from .differential import DiffAttention
from .feedforward import FeedForward, GatedFeedForward
from .latent import LatentAttention
from .layers import TransformerDecoderLayer, TransformerEncoderLayer
from .moba import MoBA
from .moe import MoEFeedForward
from .norm import RMSNorm
from .stacks import Transformer, TransformerDecoder, TransformerEncoder, encoder_layers

__all__ = [
    "DiffAttention",
    "FeedForward",
    "GatedFeedForward",
    "LatentAttention",
    "MoBA",
    "MoEFeedForward",
    "MultiHeadAttention",
    "RMSNorm",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "encoder_layers",
    "from_torch_masks",
]
