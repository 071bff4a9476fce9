"""Attention patterns: what may attend, as composable data (`a | b`, `a & b`).

Pass one as `mask=` to mhsa.attention: the reference and sdpa backends materialise
`pattern.dense(L, S)`; the flash backend plans with `pattern.block_layout(...)` and
never visits an empty block.
"""

from .base import EMPTY, FULL, PARTIAL, Band, Intersection, Pattern, Union
from .block_sparse import BlockSparse, RandomBlocks
from .chunked import Chunked
from .patterns import (
    BoolMask,
    Causal,
    Dilated,
    Document,
    Full,
    GlobalTokens,
    KeyPadding,
    PrefixLM,
    SlidingWindow,
    with_causal,
)
from .presets import BlockBand, bigbird, longformer
from .segments import Segments
from .selected import SelectedBlocks

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Band",
    "BlockBand",
    "BlockSparse",
    "BoolMask",
    "Causal",
    "Chunked",
    "Dilated",
    "Document",
    "Full",
    "GlobalTokens",
    "Intersection",
    "KeyPadding",
    "Pattern",
    "PrefixLM",
    "RandomBlocks",
    "Segments",
    "SelectedBlocks",
    "SlidingWindow",
    "Union",
    "bigbird",
    "longformer",
    "with_causal",
]
