"""Key/value caches for incremental decoding, all behind one interface (base.py: Cache,
what attention asks of one layer's cache; MultiLayerCache, several layers').

contiguous.py: KVCache, SlidingWindowCache (with attention sinks), StaticKVCache,
MemoryCache, DecoderCache, one buffer per batch. paged.py: PagedKVCache, a pool of
blocks shared by sequences that come and go (blocks.py: its bookkeeping;
paged_layer.py: its part in one layer's forward pass, which hands attention the pages).
"""

from .base import Cache, MultiLayerCache
from .blocks import PoolExhausted
from .contiguous import DecoderCache, KVCache, MemoryCache, SlidingWindowCache, StaticKVCache
from .paged import PagedKVCache
from .paged_layer import PagedLayer

__all__ = [
    "Cache",
    "DecoderCache",
    "KVCache",
    "MemoryCache",
    "MultiLayerCache",
    "PagedKVCache",
    "PagedLayer",
    "PoolExhausted",
    "SlidingWindowCache",
    "StaticKVCache",
]
