"""MoBA as a module: MultiHeadAttention's projections around mhsa.core.moba's attention."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.masks.blocks import num_blocks
from ..core.moba import moba_attention
from ..core.validate import int_at_least
from .attention import MultiHeadAttention
from .attention_base import AttentionCall


class MoBA(MultiHeadAttention):
    """Causal Mixture of Block Attention on (B, L, E) inputs, batch-first.

    Each query block of block_size positions attends its own block causally and the
    top_k earlier key blocks chosen per head (mhsa.core.moba.moba_attention; fewer
    where fewer exist; the MoBA paper's top-k counts the own block too, so its k is
    top_k + 1 here). Projections, grouped-query heads and rotary positions are
    MultiHeadAttention's. With a KV cache the new tokens of a call route as one
    (partial) query block, so cached decoding equals full recomputation only where
    each call fills whole blocks. A paged cache (PagedLayer, from PagedKVCache.batch,
    as `mhsa serve` decodes) gives each sequence the answer a contiguous cache holding
    its keys gives: the same tokens per call route the same way. (`mhsa serve` ends its
    prefill chunks on whole blocks and shares no prefix that ends mid-block, so its
    answers are generate's: GPT.prefill_alignment.)

    Args:
        embed_dim: model width E.
        num_heads: query heads H.
        block_size: positions per block.
        top_k: earlier blocks each query block attends, >= 1.
        num_kv_heads: key/value heads (grouped-query when < H); default H.
        bias: whether the projections have biases.
        backend: the attention backend; "flash" plans the chosen blocks.

    forward is AttentionModule's, causal by default (causal=None), self-attention only.
    """

    causal_default = True
    self_attention_only = True
    returns_weights = False
    # what StaticKVCache-based decoding (compile=True, CUDA graphs) asks of attention
    static_cache_problem = (
        "MoBA routes each query among the cached key blocks, which a static cache pads "
        "with its unwritten slots"
    )

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        block_size: int,
        top_k: int,
        num_kv_heads: int | None = None,
        bias: bool = True,
        backend: str = "flash",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            bias=bias,
            backend=backend,
            device=device,
            dtype=dtype,
        )
        self.block_size = int_at_least("block_size", block_size, 1)
        self.top_k = int_at_least("top_k", top_k, 1)

    def _forward(self, call: AttentionCall) -> Tensor:
        """query (B, L, E) -> (B, L, E), causal. Takes rotary positions and a KV
        cache (contiguous or paged); no mask, key padding, bias or score-function
        positions (ALiBi, T5)."""
        if (
            call.mask is not None
            or call.key_padding_mask is not None
            or call.bias is not None
            or not call.causal
        ):
            raise ValueError(
                "MoBA is causal attention over its own block selection: pass no mask, "
                "key_padding_mask or bias, and causal=True"
            )
        position = call.position
        if position is not None and (
            position.score() is not None or position.attention_bias(1, 1) is not None
        ):
            raise ValueError("MoBA takes rotary positions, not score-function ones (ALiBi, T5)")
        q, k, v, padding, _ = self._inputs(call)
        if padding is not None:
            raise ValueError("MoBA takes no left-padded cache: decode one sequence per cache row")
        if call.paged:  # k, v: the pools
            pages = {"step": call.cache.paged_step}
            top_k = self.top_k  # (capped per sequence)
        else:
            pages, top_k = {}, min(self.top_k, num_blocks(k.shape[2], self.block_size))
        out = moba_attention(
            q, k, v, self.block_size, top_k, scale=self.scale, backend=self.backend, **pages
        )
        return self.out_proj(self._merge_heads(out))

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, top_k={self.top_k}"


__all__ = ["MoBA"]
