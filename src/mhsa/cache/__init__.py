"""Key/value caches for incremental decoding.

contiguous.py: KVCache, SlidingWindowCache (with attention sinks), StaticKVCache,
MemoryCache, DecoderCache, one buffer per batch. paged.py: PagedKVCache, a pool of
blocks shared by sequences that come and go (blocks.py: its bookkeeping;
paged_layer.py: its part in one layer's forward pass), and paged_attention over its
pages.
"""

from .blocks import PoolExhausted
from .contiguous import DecoderCache, KVCache, MemoryCache, SlidingWindowCache, StaticKVCache
from .paged import PagedKVCache
from .paged_attention import paged_attention
from .paged_layer import PagedLayer

__all__ = [
    "DecoderCache",
    "KVCache",
    "MemoryCache",
    "PagedKVCache",
    "PagedLayer",
    "PoolExhausted",
    "SlidingWindowCache",
    "StaticKVCache",
    "paged_attention",
]
