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

from ..core.kernels.scored import SelectedHeads
from ..core.masks import Pattern
from ..core.scores import ScoreFunction
from ..core.validate import check_dropout, int_at_least
from .attention_base import AttentionCall, AttentionModule
from .attention_inputs import rotate_at_positions
from .norm import RMSNorm


def depth_lambda_init(depth: int) -> float:
    """The paper's lambda_init for the layer at `depth` (0-based): 0.8 - 0.6 exp(-0.3 depth)."""
    int_at_least("depth", depth, 0)
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


class DiffAttention(AttentionModule):
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
    lambda_k2, sub_norm), so its state dict loads as is. forward is AttentionModule's
    (self-attention only; errors name the input x).
    """

    input_name = "x"

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
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads // 2
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

    def _forward(self, call: AttentionCall) -> Tensor:
        """x (B, L, E) -> (B, L, E) (forward: AttentionModule's, self-attention only). mask
        and bias broadcast to (B, 2H, L, S), the 2H paired query/key heads; position
        rotates the d-wide q and k heads. With a cache (any mhsa.cache Cache made for 2H
        heads of width d) the new tokens attend everything cached: it stores the 2H key
        heads and each value head as two halves. A paged cache (PagedLayer, from
        PagedKVCache.batch) attends causally per sequence, within a SlidingWindow(left,
        0) mask at most, with no key padding or dropout (as MultiHeadAttention's)."""
        x = call.query
        batch, length, width = x.shape
        heads, d = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # head 2h + 0 / 2h + 1 of q and k is the first / second map of head h; the
        # values of head h are split into two d-wide halves, 2h + 0 and 2h + 1, alike
        q = q.view(batch, length, 2 * heads, d).transpose(1, 2)  # (B, 2H, L, d)
        k = k.view(batch, length, 2 * heads, d).transpose(1, 2)
        v = v.view(batch, length, 2 * heads, d).transpose(1, 2)
        if call.position is not None:
            q, k = rotate_at_positions(call.position, q, k, call.cache)
        if call.cache is not None:
            k, v = call.cache.update(k, v)  # (the pools, for a paged cache)
        mask, bias = self._masks(call, k.shape[2])
        score = self._score(call.position)
        if call.paged:
            both = self._paged_maps(call, q, k, v, mask, score)
        else:
            kv_len = k.shape[2]
            v = v.reshape(batch, heads, 2, kv_len, d).transpose(2, 3)  # (B, H, S, 2, d)
            v = v.reshape(batch, heads, kv_len, 2 * d)
            v = v.repeat_interleave(2, dim=1)  # (B, 2H, L, 2d): each map's values
            both = self._attend(call, q, k, v, mask, bias, scale=d**-0.5, score=score)
            both = both.view(batch, heads, 2, length, 2 * d)
        out = both[:, :, 0] - self.lambda_full().to(both.dtype) * both[:, :, 1]
        out = self.sub_norm(out) * (1.0 - self.lambda_init)  # (B, H, L, 2d)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))

    def _paged_maps(
        self,
        call: AttentionCall,
        q: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        mask: Pattern | None,
        score: ScoreFunction | None,
    ) -> Tensor:
        """Both maps of q (N, 2H, T, d) over a paged cache's pools (blocks, block_size,
        2H, d): (N, H, 2, T, 2d). Map m is one paged call over query and key heads
        2h + m; the value pool's halves 2h, 2h + 1 side by side are head h's 2d values
        (a view); a score function sees each head as its global head 2h + m. (Both maps'
        calls, and every layer's, share the cache's step.)"""
        heads, d = self.num_heads, self.head_dim
        values = v_pool.view(*v_pool.shape[:2], heads, 2 * d)  # (blocks, block_size, H, 2d)
        maps = []
        for which in (0, 1):
            heads_of_map = torch.arange(which, 2 * heads, 2, device=q.device)
            selected = None if score is None else SelectedHeads(score, heads_of_map, 2 * heads)
            q_map, k_map = q[:, which::2], k_pool[:, :, which::2]  # (N, H, T, d), its pool
            maps.append(
                self._attend(call, q_map, k_map, values, mask, None, scale=d**-0.5, score=selected)
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
        proj_drop = getattr(getattr(module, "proj_drop", None), "p", 0.0)
        if proj_drop > 0:  # (it was dropped: fine-tuning would train without it)
            raise ValueError(
                f"timm's DiffAttention with proj_drop={proj_drop} is not supported (this "
                "module drops attention weights only): build timm's with proj_drop=0"
            )
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
        return ours.train(module.training)  # (a fresh module is in training mode)


__all__ = ["DiffAttention", "depth_lambda_init"]
