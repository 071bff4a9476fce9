"""Differential attention (Ye et al. 2024, "Differential Transformer"; timm's DiffAttention).

Each of H heads holds two query/key heads of width d (= E / H / 2) and one value head
of width 2d. Its output is

    (softmax(q1 k1^T s) - lambda * softmax(q2 k2^T s)) v,
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init,

then an RMSNorm over the 2d channels (the sub-norm), times (1 - lambda_init). Both maps
come from one engine call over the 2H paired heads, so masks, causality and positions
work as in MultiHeadAttention; the maps are never materialised. Over a paged cache
(PagedKVCache, as `mhsa serve` decodes) each map is one paged engine call instead: its
H query and key heads are every other one, and the value pool read as H heads of 2d
(its two halves side by side) is a view, not a copy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..cache import Cache
from ..core.attention import attention
from ..core.kernels.scored import SelectedHeads
from ..core.masks import Pattern
from ..core.paged import paged_attention
from ..core.scores import ScoreFunction
from ..core.validate import check_dropout, int_at_least, paged_window
from .attention_inputs import PAGED_BIAS, attention_masks, rotate_at_positions
from .norm import RMSNorm
from .positional import AttentionPosition


def depth_lambda_init(depth: int) -> float:
    """The paper's lambda_init for the layer at `depth` (0-based): 0.8 - 0.6 exp(-0.3 depth)."""
    int_at_least("depth", depth, 0)
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


class DiffAttention(nn.Module):
    """Differential self-attention on (B, L, E) inputs, batch-first.

    Args:
        embed_dim: model width E; a multiple of 2 * num_heads.
        num_heads: heads H (each two query/key heads of E / H / 2 and a value head of E / H).
        depth: the layer's depth, for the default lambda_init.
        lambda_init: overrides depth_lambda_init(depth); must be finite.
        qkv_bias: whether the fused q, k, v projection has a bias (timm: False).
        proj_bias: whether the output projection has one (timm: True).
        dropout: dropout on the attention probabilities while training.
        backend: attention backend name.

    Parameter names follow timm's layer (qkv, proj, lambda_q1, lambda_k1, lambda_q2,
    lambda_k2, sub_norm), so its state dict loads as is.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        depth: int = 0,
        lambda_init: float | None = None,
        qkv_bias: bool = False,
        proj_bias: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        int_at_least("embed_dim", embed_dim, 1)
        int_at_least("num_heads", num_heads, 1)
        if embed_dim % (2 * num_heads):
            raise ValueError(
                f"embed_dim ({embed_dim}) must be a multiple of 2 * num_heads ({2 * num_heads}): "
                "each head splits into two query/key heads"
            )
        init = depth_lambda_init(depth) if lambda_init is None else lambda_init
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not math.isfinite(init):
            raise ValueError(f"lambda_init must be a finite number, got {lambda_init!r}")
        check_dropout(dropout, "dropout")
        options = {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads // 2
        self.lambda_init, self.dropout, self.backend = float(init), dropout, backend
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_bias, **options)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=proj_bias, **options)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            weight = torch.empty(self.head_dim, device=device, dtype=torch.float32)
            self.register_parameter(name, nn.Parameter(nn.init.normal_(weight, 0.0, 0.1)))
        self.sub_norm = RMSNorm(2 * self.head_dim, eps=1e-5, **options)

    def lambda_full(self) -> Tensor:
        """lambda: exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)  # at least float32
        first = torch.exp((self.lambda_q1 * self.lambda_k1).sum().to(dtype))
        second = torch.exp((self.lambda_q2 * self.lambda_k2).sum().to(dtype))
        return first - second + self.lambda_init

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | Pattern | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        position: AttentionPosition | None = None,
        cache: Cache | None = None,
    ) -> Tensor:
        """x (B, L, E) -> (B, L, E). mask: a pattern or bool tensor broadcastable to
        (B, H, L, S), True = may attend; key_padding_mask (B, S) bool, True = a real
        token; causal is bottom-right; position rotates the d-wide q and k heads. With a
        cache (any mhsa.cache Cache made for 2H heads of width d) the new tokens attend
        everything cached: it stores the 2H key heads and each value head as two halves.
        A paged cache (PagedLayer, from PagedKVCache.batch) attends causally per
        sequence, within a SlidingWindow(left, 0) mask at most, with no key padding or
        dropout (as MultiHeadAttention's)."""
        if x.dim() != 3 or x.shape[-1] != self.qkv.in_features:
            raise ValueError(
                f"x must be (batch, length, {self.qkv.in_features}), got {tuple(x.shape)}"
            )
        batch, length, width = x.shape
        heads, d = self.num_heads, self.head_dim
        dropout = self.dropout if self.training else 0.0
        paged = cache is not None and cache.paged_step is not None
        if paged:  # checked before update writes the new keys into the pages
            if dropout or key_padding_mask is not None:
                raise ValueError(
                    "a paged cache takes no key_padding_mask or dropout (each sequence is "
                    "its own): call eval() and pass no key_padding_mask"
                )
            paged_window(mask, causal, length)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # head 2h + 0 / 2h + 1 of q and k is the first / second map of head h; the
        # values of head h are split into two d-wide halves, 2h + 0 and 2h + 1, alike
        q = q.view(batch, length, 2 * heads, d).transpose(1, 2)  # (B, 2H, L, d)
        k = k.view(batch, length, 2 * heads, d).transpose(1, 2)
        v = v.view(batch, length, 2 * heads, d).transpose(1, 2)
        if position is not None:
            q, k = rotate_at_positions(position, q, k, cache)
        if cache is not None:
            k, v = cache.update(k, v)  # (the pools, for a paged cache)
        score = None if position is None else position.score()
        masks = (mask, key_padding_mask, None, position, cache)
        mask, bias = attention_masks(*masks, batch, length, k.shape[2])
        if paged:
            if bias is not None:
                raise ValueError(PAGED_BIAS)
            both = self._paged_maps(q, k, v, mask, causal, score, cache)
        else:
            kv_len = k.shape[2]
            v = v.reshape(batch, heads, 2, kv_len, d).transpose(2, 3)  # (B, H, S, 2, d)
            v = v.reshape(batch, heads, kv_len, 2 * d)
            both = attention(
                q,
                k,
                v.repeat_interleave(2, dim=1),  # (B, 2H, L, 2d): each map's values
                mask,
                bias=bias,
                causal=causal,
                scale=d**-0.5,
                dropout_p=dropout,
                backend=self.backend,
                score=score,
            ).view(batch, heads, 2, length, 2 * d)
        out = both[:, :, 0] - self.lambda_full().to(both.dtype) * both[:, :, 1]
        out = self.sub_norm(out) * (1.0 - self.lambda_init)  # (B, H, L, 2d)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))

    def _paged_maps(
        self,
        q: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        mask: Pattern | None,
        causal: bool,
        score: ScoreFunction | None,
        cache: Cache,
    ) -> Tensor:
        """Both maps of q (N, 2H, T, d) over a paged cache's pools (blocks, block_size,
        2H, d): (N, H, 2, T, 2d). Map m is one paged call over query and key heads
        2h + m; the value pool's halves 2h, 2h + 1 side by side are head h's 2d values
        (a view); a score function sees each head as its global head 2h + m."""
        heads, d = self.num_heads, self.head_dim
        values = v_pool.view(*v_pool.shape[:2], heads, 2 * d)  # (blocks, block_size, H, 2d)
        maps = []
        for which in (0, 1):
            heads_of_map = torch.arange(which, 2 * heads, 2, device=q.device)
            maps.append(
                paged_attention(
                    q[:, which::2],  # (N, H, T, d)
                    k_pool[:, :, which::2],  # (blocks, block_size, H, d)
                    values,
                    cache.paged_step,  # (both maps' calls, and every layer's, share it)
                    mask,
                    causal=causal,
                    scale=d**-0.5,
                    backend=self.backend,
                    score=None if score is None else SelectedHeads(score, heads_of_map, 2 * heads),
                )
            )
        return torch.stack(maps, dim=2)

    @classmethod
    def from_timm(cls, module: nn.Module, backend: str = "auto") -> DiffAttention:
        """A copy of timm.layers.DiffAttention (its default form: no qk_norm, scale_norm
        or dual_lambda), weights and lambda_init included."""
        for name in ("q_norm", "k_norm", "norm"):
            if not isinstance(getattr(module, name, nn.Identity()), nn.Identity):
                raise ValueError(f"timm's DiffAttention with {name} set is not supported")
        if getattr(module, "lambda_q1", None) is None:
            raise ValueError("timm's DiffAttention with dual_lambda=True is not supported")
        ref = module.qkv.weight
        ours = cls(
            module.qkv.in_features,
            module.num_heads,
            lambda_init=module.lambda_init,
            qkv_bias=module.qkv.bias is not None,
            proj_bias=module.proj.bias is not None,
            dropout=getattr(module, "attn_drop_p", 0.0),
            backend=backend,
            device=ref.device,
            dtype=ref.dtype,
        )
        ours.load_state_dict(module.state_dict())
        return ours


__all__ = ["DiffAttention", "depth_lambda_init"]
