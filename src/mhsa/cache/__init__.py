"""Key/value caches for incremental decoding.

contiguous.py      KVCache, SlidingWindowCache (optional attention sinks),
                   StaticKVCache, MemoryCache, DecoderCache: one buffer per batch
"""

from .contiguous import DecoderCache, KVCache, MemoryCache, SlidingWindowCache, StaticKVCache

__all__ = ["DecoderCache", "KVCache", "MemoryCache", "SlidingWindowCache", "StaticKVCache"]
