"""Multi-head attention as a module: project, split heads, attend, merge, project."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.attention import attention_and_weights, attention_weights
from ..core.masks import Pattern
from ..core.scores import ScoreFunction
from ..core.validate import check_dropout, check_scale, int_at_least
from .attention_base import AttentionCall, AttentionModule, check_input
from .attention_inputs import rotate_at_positions
from .layout import fuse_linears
from .norm import RMSNorm
from .positional import AttentionPosition


class MultiHeadAttention(AttentionModule):
    """Multi-head attention with separate Q, K, V projections (batch-first).

    Args:
        embed_dim: model width E of the query input and of the output.
        num_heads: query heads H.
        num_kv_heads: key/value heads H_kv (grouped-query when < H); default H.
        head_dim: width D of each head; default E // H. The projections map E to H * D
            and back, so H * D need not equal E (Gemma 2).
        kdim: width of the key input (cross-attention); default E.
        vdim: width of the value input (cross-attention); default E.
        bias: whether the projections have biases.
        out_bias: whether the output projection has one; default `bias` (Qwen2: q, k
            and v do, the output does not).
        qk_norm_eps: when set, an RMSNorm of this eps over each head's q and k, before
            positions are applied (Qwen3, OLMo 2 style "QK-norm"); q_norm and k_norm
            hold their (head_dim,) weights.
        qk_norm_unit_offset: the QK-norms scale by (1 + weight), weight from zeros
            (Qwen3-Next, Gemma 3), instead of by weight.
        output_gate: gate the attention output per channel before the output
            projection, out * sigmoid(gate_proj(query)) (Qwen3-Next's full-attention
            layers); gate_proj maps E to H * D, with `bias`. split_query_gate reads a
            checkpoint whose q_proj holds query and gate together.
        dropout: dropout on attention probabilities while training.
        scale: multiplies q k^T; default 1 / sqrt(D) (Gemma 2 uses its own scalar).
        score: an mhsa.core.scores function applied to the scaled scores inside the engine,
            after the `position`'s own (e.g. Softcap(50.0)); it should hold no tensors
            (those would not follow module.to()); positions bring theirs.
        backend: attention backend name, "auto" by default.

    forward is AttentionModule's: self- or cross-attention, need_weights (and
    average_weights), every cache kind, paged ones included.
    """

    self_attention_only = False
    returns_weights = True

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        qk_norm_unit_offset: bool = False,
        output_gate: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        score: ScoreFunction | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        int_at_least("num_heads", num_heads, 1)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        int_at_least("num_kv_heads", num_kv_heads, 1)
        for name, width in (("embed_dim", embed_dim), ("kdim", kdim), ("vdim", vdim)):
            if width is not None:
                int_at_least(name, width, 1)
        if head_dim is not None:
            int_at_least("head_dim", head_dim, 1)
        elif embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                "or pass head_dim"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        check_dropout(dropout, "dropout")
        check_scale(scale)
        if score is not None and not isinstance(score, ScoreFunction):
            raise TypeError(
                f"score must be an mhsa.core.scores function (e.g. Softcap(50.0)) or "
                f"None, got {type(score).__name__}"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads if head_dim is None else head_dim
        self.dropout = dropout
        self.scale = scale
        self.score = score
        self.backend = backend
        q_width, kv_width = num_heads * self.head_dim, num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, q_width, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim or embed_dim, kv_width, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim or embed_dim, kv_width, bias=bias, **factory)
        out_bias = bias if out_bias is None else out_bias
        self.out_proj = nn.Linear(q_width, embed_dim, bias=out_bias, **factory)
        self.qkv_proj = None  # see fuse_projections
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            norm = {"eps": qk_norm_eps, "unit_offset": qk_norm_unit_offset, **factory}
            self.q_norm = RMSNorm(self.head_dim, **norm)
            self.k_norm = RMSNorm(self.head_dim, **norm)
        elif qk_norm_unit_offset:
            raise ValueError("qk_norm_unit_offset needs qk_norm_eps (the QK-norms' eps)")
        if not isinstance(output_gate, bool):
            raise TypeError(f"output_gate must be True or False, got {output_gate!r}")
        self.gate_proj = (
            nn.Linear(embed_dim, q_width, bias=bias, **factory) if output_gate else None
        )

    def fuse_projections(self) -> bool:
        """For inference: q, k and v of self-attention in one matmul (their weights
        side by side). The module then holds qkv_proj instead of q_proj, k_proj and
        v_proj, and serves self-attention only. Projections of different kinds (a GGUF
        file may keep v at higher precision) stay apart; returns whether they fused."""
        if self.qkv_proj is not None:
            return True
        projections = [self.q_proj, self.k_proj, self.v_proj]
        if len({p.in_features for p in projections}) > 1:
            raise ValueError(
                "fuse_projections is for self-attention; this module's key or "
                "value width (kdim, vdim) differs from embed_dim"
            )
        if len({type(p) for p in projections}) > 1:
            return False
        self.qkv_proj = fuse_linears(projections)
        self.q_proj = self.k_proj = self.v_proj = None
        return True

    def _split(self, x: Tensor, heads: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)  # (B, h, T, hd)

    def _forward(
        self, call: AttentionCall, *, average_weights: bool = True
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Project, attend, merge heads and project back: (B, L, E); with need_weights
        also the probabilities (B, L, S) averaged over heads (average_weights), or
        (B, H, L, S)."""
        q, k, v, mask, bias = self._inputs(call)  # k, v: the pools, for a paged cache
        score, scale = self._score(call.position), self.scale
        if call.need_weights:
            options = {"causal": call.causal, "scale": scale, "dropout_p": call.dropout}
            out, weights = attention_and_weights(q, k, v, mask, bias=bias, score=score, **options)
        else:
            out = self._attend(call, q, k, v, mask, bias, scale=scale, score=score)
        out = self._merge_heads(out)  # (B, L, H * D)
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(call.query))
        out = self.out_proj(out)
        if not call.need_weights:
            return out
        return out, (weights.mean(dim=1) if average_weights else weights)

    @staticmethod
    def _check_input(name: str, t: Tensor, proj: nn.Linear) -> None:
        """A (batch, length, width) input matching its projection's width and dtype."""
        check_input(name, t, proj.in_features)
        # a quantised projection (mhsa.nn.quantized) names the dtype it computes in
        dtype = proj.weight.dtype if isinstance(proj, nn.Linear) else proj.input_dtype
        if t.dtype != dtype:
            raise TypeError(
                f"{name} is {t.dtype} but the module's weights are {dtype}; "
                f"convert one of them (e.g. {name}.to({dtype}) or module.to(...))"
            )

    def _keys_values(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Projected, split (B, H_kv, S, hd) keys (QK-normed when set) and values."""
        k = self._split(self.k_proj(key), self.num_kv_heads)
        k = k if self.k_norm is None else self.k_norm(k)
        return k, self._split(self.v_proj(value), self.num_kv_heads)

    def _fused_inputs(self, query, key, value, cache) -> tuple[Tensor, Tensor, Tensor]:
        """Projected, split q (B, H, L, hd), k (QK-normed when set) and v from qkv_proj."""
        if (
            (key is not None and key is not query)
            or value is not None
            or (cache is not None and cache.cross_attention)
        ):
            raise ValueError(
                "this module's projections are fused (fuse_projections), so it serves "
                "self-attention only: pass no key, value or MemoryCache"
            )
        self._check_input("query", query, self.qkv_proj)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(query).split([q_width, kv_width, kv_width], dim=-1)
        k = self._split(k, self.num_kv_heads)
        k = k if self.k_norm is None else self.k_norm(k)
        return self._split(q, self.num_heads), k, self._split(v, self.num_kv_heads)

    def _inputs(self, call: AttentionCall) -> tuple:
        """Project and split heads, apply positions, update the cache, merge masks:
        (q (B, H, L, hd), k, v (B, H_kv, S, hd), mask, bias) for the attention call
        (k, v: the pools of blocks for a paged cache)."""
        query, key, value, cache = call.query, call.key, call.value, call.cache
        position = call.position
        held = None if cache is None else cache.memory()  # cross-attention keys kept
        if self.qkv_proj is not None:
            q, k, v = self._fused_inputs(query, key, value, cache)
        else:
            if key is None:
                key = query
            value = key if value is None else value
            for name, t, proj in (
                ("query", query, self.q_proj),
                ("key", key, self.k_proj),
                ("value", value, self.v_proj),
            ):
                self._check_input(name, t, proj)
            q = self._split(self.q_proj(query), self.num_heads)
            k, v = held if held is not None else self._keys_values(key, value)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if position is not None:
            q, rotated = rotate_at_positions(position, q, k, cache)
            k = rotated if held is None else k  # (kept memory keys were rotated when kept)
        if cache is not None:
            k, v = cache.update(k, v)
        return (q, k, v, *self._masks(call, k.shape[2]))

    @torch.no_grad()
    def attention_map(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | Pattern | None = None,
        key_padding_mask: Tensor | None = None,
        bias: Tensor | None = None,
        causal: bool = False,
        position: AttentionPosition | None = None,
        heads=None,
        rows=None,
        **_: object,
    ) -> Tensor:
        """The attention probabilities (B, H, L, S) this module computes for these inputs
        (same arguments as forward), recomputed on demand by mhsa.attention_weights."""
        if value is None and key is not None and self.v_proj is not None:
            width = self.v_proj.in_features  # (the map needs no values: zeros of their width)
            value = key.new_zeros(*key.shape[:-1], width) if key.shape[-1] != width else key
        call = AttentionCall(
            query, key, value, mask, key_padding_mask, bias, causal, position, None
        )
        q, k, _, mask, bias = self._inputs(call)
        return attention_weights(
            q,
            k,
            mask,
            bias=bias,
            causal=causal,
            scale=self.scale,
            heads=heads,
            rows=rows,
            score=self._score(position),
        )

    @staticmethod
    def split_query_gate(projection: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
        """A q_proj weight (2 * H * D, E) or bias (2 * H * D,) holding each head's query
        and gate side by side (Qwen3-Next: [q_0, gate_0, q_1, gate_1, ...], D rows each)
        as (q_proj's, gate_proj's), (H * D, ...) each."""
        int_at_least("num_heads", num_heads, 1)
        if projection.shape[0] % (2 * num_heads):
            raise ValueError(
                f"projection's first axis ({projection.shape[0]}) must be 2 * num_heads * "
                f"head_dim, a multiple of 2 * num_heads = {2 * num_heads}"
            )
        heads = projection.reshape(num_heads, 2, -1, *projection.shape[1:])
        query, gate = heads[:, 0], heads[:, 1]  # (H, D, ...)
        return query.reshape(-1, *projection.shape[1:]), gate.reshape(-1, *projection.shape[1:])

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, backend: str = "auto") -> MultiHeadAttention:
        """Build one with the weights of a torch.nn.MultiheadAttention.

        torch's module is batch-first or not; ours is always batch-first. The copy is in
        the source's training mode.
        Its bias_k/bias_v (add_bias_kv) and add_zero_attn have no equivalent here.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be torch.nn.MultiheadAttention, got {type(module)}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        has_bias = module.in_proj_bias is not None
        ref = module.out_proj.weight
        ours = cls(
            module.embed_dim,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=has_bias,
            dropout=module.dropout,
            backend=backend,
            device=ref.device,
            dtype=ref.dtype,
        )
        if module._qkv_same_embed_dim:
            weights = module.in_proj_weight.chunk(3)
        else:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        biases = module.in_proj_bias.chunk(3) if has_bias else (None, None, None)
        with torch.no_grad():
            for proj, weight, b in zip(
                (ours.q_proj, ours.k_proj, ours.v_proj), weights, biases, strict=True
            ):
                proj.weight.copy_(weight)
                if b is not None:
                    proj.bias.copy_(b)
            ours.out_proj.weight.copy_(module.out_proj.weight)
            if has_bias:
                ours.out_proj.bias.copy_(module.out_proj.bias)
        return ours.train(module.training)
