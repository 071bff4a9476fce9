"""mhsa: multi-head self-attention and its whole family, on PyTorch."""

from . import distributed, masks, nn, positional, scores  # distributed registers ring
from .backends import names as backends
from .backends import use_backend
from .cache import DecoderCache, KVCache, MemoryCache, PagedKVCache
from .cluster import cluster_attention
from .functional import attention, attention_weights
from .version import __version__

__all__ = [
    "__version__",
    "DecoderCache",
    "KVCache",
    "MemoryCache",
    "PagedKVCache",
    "attention",
    "attention_weights",
    "cluster_attention",
    "backends",
    "distributed",
    "masks",
    "nn",
    "positional",
    "scores",
    "use_backend",
]
