"""Contiguous key/value caches for incremental decoding: one buffer per batch.

Sequences of different lengths decode together left-padded: sequence b's real tokens
start at index `start[b]`; keys before it are padding that no query may attend.
Both caches return the keys and values to attend over (oldest first), and tell which
of them are real (`key_padding`); attention over them is causal bottom-right, so a
prefill of many tokens and a decode step of one go through the same code.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from ..core.checks import int_at_least, is_int_tensor
from .base import Cache, MultiLayerCache


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        int_at_least(name, value, 1)


class KVCache(Cache):
    """Preallocated keys (B, H_kv, max_len, D) and values (B, H_kv, max_len, D_v) for
    one attention layer, appended in place. Appending past max_len raises."""

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        _check_positive(batch=batch, num_kv_heads=num_kv_heads, max_len=max_len, head_dim=head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        self.k = torch.zeros(batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, num_kv_heads, max_len, value_dim, dtype=dtype, device=device)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0  # tokens appended so far, padding included

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def set_padding(self, start: Tensor) -> None:
        """Declare left padding: sequence b's first real token is at index start[b]."""
        if self.length:
            raise ValueError("set_padding must come before the first update")
        if not isinstance(start, Tensor) or start.shape != self.start.shape:
            got = tuple(start.shape) if isinstance(start, Tensor) else type(start).__name__
            raise ValueError(
                f"start must be a tensor of shape {tuple(self.start.shape)}, got {got}"
            )
        if not is_int_tensor(start):
            raise TypeError(f"start must hold integer indices, got {start.dtype}")
        last = self._last_start()
        if start.numel() and (
            int(start.min()) < 0 or (last is not None and int(start.max()) > last)
        ):
            limit = "0 or more" if last is None else f"in 0..{last} (the cache's max_len - 1)"
            raise ValueError(f"start must be {limit}, got {start.tolist()}")
        # a copy: reset() zeroes it in place, and the caller may reuse its tensor
        self.start = start.to(device=self.start.device, dtype=torch.long, copy=True)

    def _last_start(self) -> int | None:
        """The largest allowed padding start (None: no bound)."""
        return self.max_len - 1

    @property
    def positions(self) -> Tensor:
        """(B,) real tokens cached per sequence: the position of its next token."""
        return (self.length - self.start).clamp(min=0)

    def next_positions(self, count: int) -> Tensor:
        """(B, count) positions of the next `count` tokens (0 for padding)."""
        index = torch.arange(self.length, self.length + count, device=self.start.device)
        return (index.view(1, -1) - self.start.view(-1, 1)).clamp(min=0)

    def _check(self, k: Tensor, v: Tensor) -> None:
        want = (self.k.shape[0], self.k.shape[1], k.shape[2], self.k.shape[3])
        if (
            tuple(k.shape) != want
            or tuple(v.shape[:3]) != want[:3]
            or v.shape[3] != self.v.shape[3]
        ):
            raise ValueError(
                f"cache holds (batch, num_kv_heads, *, head_dim) = ({want[0]}, {want[1]}, *, "
                f"{want[3]}); got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if k.dtype != self.k.dtype or v.dtype != self.v.dtype:
            raise TypeError(
                f"cache holds {self.k.dtype}, got k {k.dtype}, v {v.dtype}: storing would "
                "round them silently; allocate the cache with the model's dtype"
            )

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k (B, H_kv, T, D), v (B, H_kv, T, D_v); return all keys and values."""
        self._check(k, v)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KVCache overflow: {self.length} cached + {k.shape[2]} new tokens > max_len "
                f"{self.max_len}; allocate the cache with a larger max_len"
            )
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def key_padding(self) -> Tensor | None:
        """(B, S) bool, True = a real key, for the keys the last update returned."""
        if not self.start.any():
            return None
        index = torch.arange(self.length, device=self.start.device)
        return index.view(1, -1) >= self.start.view(-1, 1)

    def reset(self) -> None:
        """Forget the cached tokens and the padding (the memory is kept)."""
        self.length = 0
        self.start.zero_()

    def truncate(self, length: int) -> None:
        """Keep the first `length` appended tokens (speculative decoding: drop the
        rejected drafts)."""
        self._check_truncation(length)
        self.length = length

    def _check_truncation(self, length: int) -> None:
        if (
            isinstance(length, bool)
            or not isinstance(length, int)
            or not 0 <= length <= self.length
        ):
            raise ValueError(f"length must be an int in 0..{self.length}, got {length!r}")

    def reorder(self, index: Tensor) -> None:
        """Keep sequence index[b] as sequence b (beam search: the surviving beams)."""
        if not isinstance(index, Tensor) or index.dim() != 1 or not is_int_tensor(index):
            got = index.dtype if isinstance(index, Tensor) else type(index).__name__
            raise TypeError(f"reorder index must be a 1-D integer tensor, got {got}")
        batch = self.k.shape[0]
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch):
            raise ValueError(f"reorder index must be in 0..{batch - 1}, got {index.tolist()}")
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
        self.start = self.start.index_select(0, index)


class SlidingWindowCache(KVCache):
    """A ring buffer of the last `window` keys and values, for sliding-window attention:
    memory is bounded by the window however long the sequence grows.

    update returns the kept keys followed by the new ones, oldest first, so a
    SlidingWindow mask aligned bottom-right applies to them as to the full sequence.

    sink_tokens=n also keeps positions 0..n-1 for good (StreamingLLM's attention
    sinks), in n more slots (n + window in all). update then returns the kept sinks
    first, then the kept window and the new keys as above: the window keys keep their
    distances to the queries (bottom-right), the sinks sit at indices 0..n-1 whatever
    their distance. Attend with causal=True and the mask
    `GlobalTokens(range(n), beyond_keys="ignore") | SlidingWindow(window - 1, 0)`:
    every query sees the sinks and its window, as `(key < n) | SlidingWindow(window -
    1, 0)` over the whole sequence. (A score function of distances, ALiBi, would see
    the sinks nearer than they are.) Sinks take no left padding.
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        window: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        sink_tokens: int = 0,
    ) -> None:
        _check_positive(window=window)  # (the base class would call it max_len)
        int_at_least("sink_tokens", sink_tokens, 0)
        super().__init__(
            batch,
            num_kv_heads,
            sink_tokens + window,
            head_dim,
            value_dim,
            dtype=dtype,
            device=device,
        )
        self.sink_tokens = sink_tokens
        self.first = 0  # position of the first window key the last update returned

    @property
    def window(self) -> int:
        return self.k.shape[2] - self.sink_tokens

    def kept_from(self) -> int:
        """The position of the first window key the next update returns (its kept
        sinks, if any, come before it)."""
        return max(self.sink_tokens, self.length - self.window)

    def _last_start(self) -> int | None:
        return None  # starts are absolute positions; the ring buffer wraps past them

    def set_padding(self, start: Tensor) -> None:
        if self.sink_tokens and isinstance(start, Tensor) and start.numel() and start.any():
            raise ValueError(
                "a SlidingWindowCache with sink_tokens keeps the first positions, "
                "which left padding would fill: decode sequences with sinks "
                "unpadded (equal lengths, or one cache each)"
            )
        super().set_padding(start)

    def _slots(self, positions: Tensor) -> Tensor:
        """The slot of each position: its own below sink_tokens, the ring's above."""
        sinks, window = self.sink_tokens, self.window
        return torch.where(positions < sinks, positions, sinks + (positions - sinks) % window)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self._check(k, v)
        sinks, window, length, new = self.sink_tokens, self.window, self.length, k.shape[2]
        device = self.k.device

        def span(begin: int, end: int) -> Tensor:
            return torch.arange(begin, max(begin, end), device=device)

        first = max(sinks, length - window)  # the first window position kept
        order = self._slots(torch.cat([span(0, min(sinks, length)), span(first, length)]))
        k_all = torch.cat([self.k.index_select(2, order), k], dim=2)
        v_all = torch.cat([self.v.index_select(2, order), v], dim=2)
        # new positions to store: the sinks among them, and the newest `window` others
        end = length + new
        stored = torch.cat(
            [span(length, min(sinks, end)), span(max(sinks, end - window, length), end)]
        )
        slots = self._slots(stored)
        self.k.index_copy_(2, slots, k.index_select(2, stored - length))
        self.v.index_copy_(2, slots, v.index_select(2, stored - length))
        self.first = first
        self.length = end
        return k_all, v_all

    def truncate(self, length: int) -> None:
        """Keep the first `length` appended tokens, where the ring still holds the keys
        that they need: each dropped token overwrote the key one window before it, so
        once the ring has wrapped past the kept window nothing can be dropped."""
        self._check_truncation(length)
        lost_from = max(self.sink_tokens, length - self.window)
        lost_to = min(length, self.length - self.window)  # positions overwritten, kept
        if lost_to > lost_from:
            raise ValueError(
                f"cannot truncate this SlidingWindowCache from {self.length} to {length} "
                f"tokens: the dropped ones overwrote the keys at positions {lost_from}.."
                f"{lost_to - 1}, which its window of {self.window} still needs; drop "
                "tokens with a KVCache or a PagedKVCache (speculative decoding uses one)"
            )
        self.length = length

    def key_padding(self) -> Tensor | None:
        if not self.start.any():
            return None
        index = torch.arange(self.first, self.length, device=self.start.device)
        return index.view(1, -1) >= self.start.view(-1, 1)

    def reset(self) -> None:
        super().reset()
        self.first = 0


class StaticKVCache(KVCache):
    """The decoding steps after a KVCache's prefill, with every shape fixed and no
    Python number changing between steps, so that one compiled step serves them all
    (generate(..., compile=True)). It shares the prefilled cache's storage: each update
    takes one token per sequence, written at the slot held in the tensor `filled`, and
    returns all max_len slots, those not yet written masked as padding (key_padding).
    `length` is the number of slots returned (max_len), constant; the written count is
    `filled`, and positions come from next_positions. Writing past max_len is the
    caller's to avoid (a compiled step cannot test a tensor's value): generate sizes
    the prefilled cache for every new token.
    """

    slots_after_query = True

    def __init__(self, prefilled: KVCache) -> None:  # (no super().__init__: shares storage)
        problem = self.cannot_continue(prefilled)
        if problem is not None:
            raise TypeError(problem)
        self.k, self.v, self.start = prefilled.k, prefilled.v, prefilled.start
        self.length = prefilled.max_len
        self.filled = torch.tensor(prefilled.length, device=self.k.device)

    @staticmethod
    def cannot_continue(cache: object) -> str | None:
        """Why a StaticKVCache cannot continue `cache`, or None: it continues a plain
        KVCache, whose slots are fixed."""
        if type(cache) is KVCache:
            return None
        return (
            f"StaticKVCache continues a KVCache, got {type(cache).__name__}"
            " (a sliding window keeps no fixed slots)"
        )

    def next_positions(self, count: int) -> Tensor:
        if count != 1:
            raise ValueError(
                f"a StaticKVCache takes one token per step, got {count}; prefill with a KVCache"
            )
        return (self.filled - self.start).clamp(min=0).view(-1, 1)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k (B, H_kv, 1, D), v at slot `filled`; return every slot."""
        self._check(k, v)
        if k.shape[2] != 1:
            raise ValueError(f"a StaticKVCache takes one token per step, got {k.shape[2]}")
        slot = self.filled.view(1)
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        self.filled.add_(1)
        return self.k, self.v

    def key_padding(self) -> Tensor:
        """(B, max_len): True for written keys after each sequence's padding."""
        index = torch.arange(self.max_len, device=self.k.device).view(1, -1)
        return (index < self.filled) & (index >= self.start.view(-1, 1))

    def reorder(self, index: Tensor) -> None:
        raise ValueError(
            "a StaticKVCache does not reorder; reorder the prefilled KVCache and wrap it again"
        )

    def truncate(self, length: int) -> None:
        raise ValueError(
            "a StaticKVCache does not truncate (its length is max_len); truncate the "
            "prefilled KVCache and wrap it again"
        )


class MemoryCache(Cache):
    """Cross-attention keys and values of a fixed memory (an encoder output): the
    first call projects them (update keeps them), every later decoding step reuses
    them (memory)."""

    cross_attention = True

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep the memory's keys (B, H_kv, S, D) and values on the first call; return
        the kept ones."""
        if self.k is None:
            self.k, self.v = k, v
        return self.k, self.v

    def memory(self) -> tuple[Tensor, Tensor] | None:
        return None if self.k is None else (self.k, self.v)

    def next_positions(self, count: int) -> None:
        """None: the memory's keys do not continue the queries' sequence."""
        return None

    def reorder(self, index: Tensor) -> None:
        """Keep sequence index[b] as sequence b."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class DecoderCache(MultiLayerCache):
    """What an encoder-decoder's decoder keeps between steps, one entry per layer:
    a KVCache for causal self-attention and a MemoryCache for cross-attention.
    layer(i) and update(k, v, i) are layer i's self-attention cache."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cache_memory: bool = True,
    ) -> None:
        """cache_memory=False keeps no cross-attention keys/values: each step
        projects the memory again (for checking the MemoryCache)."""
        _check_positive(num_layers=num_layers)
        options = {"dtype": dtype, "device": device}
        self.self_attn = [
            KVCache(batch, num_kv_heads, max_len, head_dim, **options) for _ in range(num_layers)
        ]
        self.cross_attn = [MemoryCache() if cache_memory else None for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Decoder tokens cached so far."""
        return self.self_attn[0].length

    def layer(self, index: int) -> KVCache:
        return self.self_attn[index]

    def next_positions(self, count: int) -> Tensor:
        """(B, count) positions of the next decoder tokens (see KVCache.next_positions)."""
        return self.self_attn[0].next_positions(count)

    def to_static(self, self_attn: list[StaticKVCache]) -> DecoderCache:
        """This cache's decoding steps over `self_attn` (StaticKVCaches continuing its
        own), the cross-attention memory shared."""
        static = copy.copy(self)
        static.self_attn = self_attn
        return static

    def reorder(self, index: Tensor) -> None:
        """Keep sequence index[b] as sequence b, in every layer."""
        for cache in (*self.self_attn, *self.cross_attn):
            if cache is not None:
                cache.reorder(index)
