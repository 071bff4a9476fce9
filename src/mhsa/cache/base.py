"""The cache interface: what attention modules and models ask of every cache.

One layer's cache (a `Cache`: KVCache, SlidingWindowCache, StaticKVCache, MemoryCache,
PagedLayer) is the `cache` of one MultiHeadAttention call. It answers, whatever its kind:

    update(k, v)       store the new keys (B, H_kv, T, D) and values (B, H_kv, T, D_v);
                       return the keys and values to attend over
    next_positions(T)  (B, T) positions of the T new tokens, or None (cross-attention):
                       rotary angles and learned positions of cached decoding come from here
    kept_from()        the position of the first key the next update returns (0 but for a
                       ring buffer, which drops the oldest)
    key_padding()      (B, S) bool, True = a real key, for what update returned; or None
    memory()           keys and values kept for good (cross-attention after its first call):
                       attention reuses them and projects no new ones; else None
    paged_step         None, or paged keys: update returned the pools of blocks, and
                       attention reads them through this mhsa.PagedStep (the block
                       table and lengths of the forward pass, the same in every layer:
                       mhsa.paged_attention(q, k_pool, v_pool, paged_step))
    cross_attention    whether it holds keys of another sequence (an encoder's memory)
    slots_after_query  whether update returns free slots after the written keys (masked
                       as padding; StaticKVCache): a query then sits after all of them,
                       not at its position

A cache of many layers (a `MultiLayerCache`: DecoderCache, PagedKVCache) hands out one
`Cache` per layer and answers update(k, v, layer) through it, as transformers' caches do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from ..core.paged_step import PagedStep


class Cache:
    """One attention layer's keys and values between calls (see the module docstring)."""

    paged_step: PagedStep | None = None  # paged keys: the pass's table and lengths
    cross_attention: bool = False
    slots_after_query: bool = False

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k (B, H_kv, T, D), v (B, H_kv, T, D_v); return the keys and values to
        attend over (the pools of blocks, for paged keys)."""
        raise NotImplementedError

    def next_positions(self, count: int) -> Tensor | None:
        """(B, count) int64 positions of the next `count` tokens, or None where the cache
        gives the queries no positions (cross-attention)."""
        raise NotImplementedError

    def kept_from(self) -> int:
        """The position of the first key the next update returns: 0, as every key is
        kept, but for a ring buffer (SlidingWindowCache)."""
        return 0

    def key_padding(self) -> Tensor | None:
        """(B, S) bool, True = a real key, for the keys the last update returned; None:
        all are real."""
        return None

    def memory(self) -> tuple[Tensor, Tensor] | None:
        """Keys and values to reuse instead of projecting new ones, or None."""
        return None

    def reorder(self, index: Tensor) -> None:
        """Keep sequence index[b] as sequence b (beam search: the surviving beams)."""
        raise ValueError(f"a {type(self).__name__} does not reorder its sequences")


class MultiLayerCache:
    """The caches of several layers: layer(i) is layer i's Cache."""

    def layer(self, index: int) -> Cache:
        raise NotImplementedError

    def update(self, k: Tensor, v: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Store layer `layer`'s new keys and values; return what it attends over."""
        return self.layer(layer).update(k, v)
