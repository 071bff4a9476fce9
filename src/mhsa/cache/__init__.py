"""Key/value caches for incremental decoding.

contiguous.py: KVCache, SlidingWindowCache (with attention sinks), StaticKVCache,
MemoryCache, DecoderCache, one buffer per batch. paged.py: PagedKVCache, a pool of
blocks shared by sequences that come and go (blocks.py: its bookkeeping), with
paged_attention over its pages.
"""

from .contiguous import DecoderCache, KVCache, MemoryCache, SlidingWindowCache, StaticKVCache
from .paged_attention import paged_attention

__all__ = [
    "DecoderCache",
    "KVCache",
    "MemoryCache",
    "SlidingWindowCache",
    "StaticKVCache",
    "paged_attention",
]
