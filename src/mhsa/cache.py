"""Key/value caches for incremental decoding."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Preallocated keys and values for one attention layer, appended in place.

    Holds k (B, H_kv, max_len, D) and v (B, H_kv, max_len, D_v); `update` writes the
    new tokens after the ones already stored and returns views of everything so
    far. Attention over the result is causal bottom-right, so a prefill of many
    tokens and a decode step of one token go through the same code.
    """

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
        for name, value in (
            ("batch", batch),
            ("num_kv_heads", num_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        value_dim = head_dim if value_dim is None else value_dim
        self.k = torch.zeros(batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, num_kv_heads, max_len, value_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k (B, H_kv, T, D), v (B, H_kv, T, D_v); return all keys and values."""
        new = k.shape[2]
        expected = (self.k.shape[0], self.k.shape[1], new, self.k.shape[3])
        if tuple(k.shape) != expected or v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"cache holds (batch, num_kv_heads, *, head_dim) = {expected[:2]} + (*, "
                f"{expected[3]}); got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if self.length + new > self.max_len:
            raise ValueError(
                f"KVCache overflow: {self.length} cached + {new} new tokens > max_len "
                f"{self.max_len}; allocate the cache with a larger max_len"
            )
        end = self.length + new
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reset(self) -> None:
        """Forget the cached tokens (the memory is kept)."""
        self.length = 0
