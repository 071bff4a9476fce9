"""The decoder interface every decoding loop drives: GPT and Llama implement it, and so
does the decoder side of Whisper and Seq2Seq (bound to an encoder's memory).

    layout = decoder.cache_layout                 sizes a cache pool (layers, heads, dims)
    caches = decoder.make_caches(batch, max_len)  empty caches for `batch` sequences
    logits = decoder.prefill(tokens, caches)      tokens (B, T) -> last logits (B, V)
    logits = decoder.step(tokens, caches)         tokens (B, 1) -> last logits (B, V)

Both calls continue what the caches hold and return the logits of the last position
only. Caches are whatever the model's attention takes: a list of per-layer caches
(KVCache, PagedLayer...) or a DecoderCache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class CacheLayout:
    """What a decoder's KV cache holds per token: num_layers layers of num_kv_heads
    heads of head_dim key channels and value_dim value channels (None: head_dim; 0:
    no values, as latent attention keeps), in dtype on device."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    value_dim: int | None = None


@runtime_checkable
class Decoder(Protocol):
    """An autoregressive decoder over KV caches (see the module docstring)."""

    @property
    def cache_layout(self) -> CacheLayout: ...

    def make_caches(self, batch: int, max_len: int) -> Any: ...

    def prefill(self, tokens: Tensor, caches: Any, *, start: Tensor | None = None) -> Tensor:
        """tokens (B, T) continuing caches -> logits (B, V) of the last position.
        start: (B,) each row's first real token when the prompts are left-padded.
        caches None recomputes the whole sequence (tokens from its first token)."""
        ...

    def step(self, tokens: Tensor, caches: Any) -> Tensor:
        """tokens (B, 1), each sequence's newest token -> logits (B, V)."""
        ...
