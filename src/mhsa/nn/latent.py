"""Multi-head latent attention (MLA: DeepSeek-V2/V3, MiniCPM3) over mhsa.attention.

Keys and values come from one low-rank latent per token, plus one rotary key shared
by every head:

    x (B, L, E) -> q = q_b(norm(q_a(x))) or q_proj(x)       (B, H, L, dn + dr)
                -> [latent | k_rope] = kv_a(x), latent normed (B, 1, L, r + dr)
    expanded    k = [kv_b_k(latent) | k_rope], v = kv_b_v(latent) per head, then
                attention(q, k, v): (B, H, L, dv)
    absorbed    kv_b's key half folded into the query and its value half into the
                output: attention([q_nope W_UK | q_rope], [latent | k_rope], latent)
                is multi-query attention (one key head of width r + dr) in latent space

Both forms give the same output (q_nope . W_UK latent = (q_nope W_UK) . latent). A
cache holds [latent | k_rope] per token as a single key head (r + dr values) and no
values: the absorbed form reads its values as the first r channels of the keys, so
contiguous, static and paged caches all serve it unchanged. Prefill attends in the
expanded form (dn + dr wide, per head), decoding in the absorbed one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..cache import Cache
from ..core.checks import int_at_least
from ..core.validate import check_dropout, check_scale
from .attention_base import AttentionCall, AttentionModule
from .attention_inputs import rotate_at_positions
from .norm import RMSNorm
from .positional import AttentionPosition
from .quantized import dense_weight


def _halves(x: Tensor) -> Tensor:
    """Interleaved rotary pairs (x0, x1), (x2, x3)... -> the rotate-half layout
    (x0, x2, ..., x1, x3, ...): DeepSeek-V3's rope_interleave, as a channel order."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(AttentionModule):
    """Multi-head latent attention, self-attention only (batch-first).

    Args:
        embed_dim: model width E of the input and the output.
        num_heads: query heads H.
        kv_lora_rank: width r of the compressed key/value latent (DeepSeek: 512).
        qk_rope_head_dim: width dr of the rotary part of q and k; the rotary key is
            one head shared by all (DeepSeek: 64). Even.
        qk_nope_head_dim: width dn of the part of each q and k head without positions
            (DeepSeek: 128).
        v_head_dim: width dv of each value head (DeepSeek: 128).
        q_lora_rank: None, q projected directly; else q goes through a latent of this
            width with an RMSNorm (DeepSeek-V3: 1536).
        bias: biases on the down projections (q_a / q, kv_a) and the output.
        norm_eps: eps of the two latent RMSNorms (transformers: 1e-6).
        rope_interleave: the rotary channels of q and k come in interleaved pairs
            (DeepSeek-V3's checkpoints); they are reordered to rotate-half before
            the rotation, which then uses the position as it is.
        dropout: dropout on attention probabilities while training.
        scale: multiplies q k^T; default (dn + dr) ** -0.5 (YaRN models scale it).
        backend: attention backend name, "auto" by default.

    Positions: pass a RotaryEmbedding(qk_rope_head_dim) (or its .at(positions)) as
    `position`; it rotates q_rope and k_rope only. forward is AttentionModule's
    (self-attention only), with one option of its own, absorbed (see _forward).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        norm_eps: float = 1e-6,
        rope_interleave: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("embed_dim", embed_dim),
            ("num_heads", num_heads),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_rope_head_dim", qk_rope_head_dim),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            int_at_least(name, value, 1)
        if q_lora_rank is not None:
            int_at_least("q_lora_rank", q_lora_rank, 1, " or None")
        if qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even (rotary pairs), got {qk_rope_head_dim}"
            )
        check_dropout(dropout, "dropout")
        check_scale(scale)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.rope_dim, self.nope_dim, self.v_dim = qk_rope_head_dim, qk_nope_head_dim, v_head_dim
        self.rope_interleave, self.dropout = rope_interleave, dropout
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 if scale is None else scale
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        self.q_proj = self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        if q_lora_rank is None:
            self.q_proj = nn.Linear(embed_dim, q_width, bias=False, **factory)
        else:
            self.q_a_proj = nn.Linear(embed_dim, q_lora_rank, bias=bias, **factory)
            self.q_a_norm = RMSNorm(q_lora_rank, eps=norm_eps, **factory)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False, **factory)
        self.kv_a_proj = nn.Linear(embed_dim, kv_lora_rank + qk_rope_head_dim, bias=bias, **factory)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=norm_eps, **factory)
        kv_width = num_heads * (qk_nope_head_dim + v_head_dim)
        self.kv_b_proj = nn.Linear(kv_lora_rank, kv_width, bias=False, **factory)
        # the absorbed decoding step reads its weight whole: quantize_linears keeps it
        # float (dequantising it each step cost ~30x its matmul)
        self.kv_b_proj.read_whole = True
        self.out_proj = nn.Linear(num_heads * v_head_dim, embed_dim, bias=bias, **factory)

    @property
    def cache_width(self) -> int:
        """Values a cache keeps per token: the latent and the rotary key (r + dr)."""
        return self.kv_lora_rank + self.rope_dim

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes this layer's cache holds per token: (r + dr) values of `dtype` (default:
        the weights'), against H * (dn + dr + dv) for the same heads' keys and values."""
        layer = self.kv_a_proj
        weights = getattr(layer, "input_dtype", None) or layer.weight.dtype  # (quantised or not)
        dtype = weights if dtype is None else dtype
        return self.cache_width * torch.empty((), dtype=dtype).element_size()

    def fuse_projections(self) -> bool:
        """Fuses nothing (q_a and kv_a could share one matmul; not done): False.
        (Present so that models calling it on every attention module may hold this one.)"""
        return False

    def _forward(self, call: AttentionCall, *, absorbed: bool | None = None) -> Tensor:
        """Self-attention of query (B, L, E) -> (B, L, E) (forward: AttentionModule's).

        With a cache (any mhsa.cache Cache built with num_kv_heads 1, head_dim
        cache_width and value_dim 0: see mhsa.models.deepseek), the new [latent |
        k_rope] go through cache.update and attention runs over what it returns, the
        new tokens at the cache's next_positions. absorbed: None picks the absorbed
        form for one new token per sequence and for paged caches, the expanded one
        otherwise; True or False forces one (paged caches need the absorbed form).
        """
        query = call.query
        if absorbed is None:
            absorbed = call.paged or query.shape[1] == 1
        if call.paged and not absorbed:
            raise ValueError("a paged cache holds latents that only the absorbed form reads")
        q_nope, q_rope, keys = self._project(query, call.position, call.cache)
        if call.cache is not None:  # [latent | k_rope] as one key head, no values
            keys, _ = call.cache.update(keys, keys[..., :0])
        mask, bias = self._masks(call, keys.shape[-2])  # (keys: the pool, when paged)
        score = self._score(call.position)
        attend = self._absorbed if absorbed else self._expanded
        out = attend(call, q_nope, q_rope, keys, mask, bias, score)  # (B, H, L, dv)
        return self.out_proj(self._merge_heads(out))

    def _project(
        self, x: Tensor, position: AttentionPosition | None, cache: Cache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q_nope (B, H, L, dn), rotated q_rope (B, H, L, dr) and the new keys
        [latent | rotated k_rope] (B, 1, L, r + dr)."""
        batch, length, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(batch, length, self.num_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_norm(latent).unsqueeze(1), k_rope.unsqueeze(1)  # (B, 1, L, *)
        if self.rope_interleave:
            q_rope, k_rope = _halves(q_rope), _halves(k_rope)
        if position is not None:
            q_rope, k_rope = rotate_at_positions(position, q_rope, k_rope, cache)
        return q_nope, q_rope, torch.cat((latent, k_rope), dim=-1)

    def _up_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's weight split per head: W_UK (H, dn, r) and W_UV (H, dv, r)."""
        weight = dense_weight(self.kv_b_proj).unflatten(0, (self.num_heads, -1))  # (H, dn + dv, r)
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def _expanded(self, call, q_nope, q_rope, keys, mask, bias, score) -> Tensor:
        """Attention per head over keys and values expanded from the latents
        keys (B, 1, S, r + dr) -> (B, H, L, dv)."""
        batch, _, kv_len, _ = keys.shape
        latent, k_rope = keys[:, 0].split([self.kv_lora_rank, self.rope_dim], dim=-1)
        width = self.nope_dim + self.v_dim  # (explicit: -1 cannot size an empty batch)
        kv = self.kv_b_proj(latent).view(batch, kv_len, self.num_heads, width).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, H, S, dn), (B, H, S, dv)
        k_rope = k_rope.unsqueeze(1).expand(batch, self.num_heads, kv_len, self.rope_dim)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        return self._attend(call, q, k, v, mask, bias, scale=self.scale, score=score)

    def _absorbed(self, call, q_nope, q_rope, keys, mask, bias, score) -> Tensor:
        """Multi-query attention in latent space: q [q_nope W_UK | q_rope] (B, H, L,
        r + dr) over keys (B, 1, S, r + dr) (or their pool) with values their first r
        channels, then W_UV per head -> (B, H, L, dv)."""
        w_uk, w_uv = self._up_weights()
        q = torch.cat((torch.einsum("bhld,hdr->bhlr", q_nope, w_uk), q_rope), dim=-1)
        values = keys[..., : self.kv_lora_rank]  # a view: the cache holds no values
        options = {"scale": self.scale, "score": score}
        if _heads_as_rows(q, mask, bias, score, call.paged):
            # one query per head sees every key: the same call with the heads as H query
            # rows of the one key head (no K/V repeat)
            out = self._attend(
                call, q.transpose(1, 2), keys, values, mask, bias, causal=False, **options
            )
            out = out.transpose(1, 2)
        else:
            out = self._attend(call, q, keys, values, mask, bias, **options)  # (B, H, L, r)
        return torch.einsum("bhlr,hvr->bhlv", out, w_uv)


def _heads_as_rows(q: Tensor, mask, bias: Tensor | None, score, paged: bool) -> bool:
    """Whether a multi-query call may take its H heads as H rows of one head: one new
    token (each row then sees every key whatever causal says), no paging, and nothing
    that depends on the query's row (a pattern, a bias, a score function) beyond key
    padding, a (B, 1, 1, S) mask."""
    if q.shape[2] != 1 or paged or bias is not None or score is not None:
        return False
    padding = isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
    return mask is None or padding
