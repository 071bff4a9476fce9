"""The base of mhsa.nn's attention modules (MultiHeadAttention, LatentAttention,
DiffAttention, MoBA): one forward signature, the checks of a call (self-attention only,
what a paged cache takes, or the refusal of one), the masks merged with the cache's key
padding, and the engine call over a contiguous or a paged cache.

A module defines `_forward(call, **options)`: it projects `call.query`, rotates and
caches its keys (`rotate_at_positions`, `call.cache.update`), then asks `_masks` for
the mask and bias over the keys it got and `_attend` for the engine's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from ..cache import Cache
from ..core.attention import attention
from ..core.masks import Causal, Full, Pattern
from ..core.paged import paged_attention
from ..core.scores import ScoreFunction, composed, sees_query_position
from ..core.validate import paged_window
from .attention_inputs import PAGED_BIAS, attention_masks
from .positional import AttentionPosition


@dataclass(slots=True)
class AttentionCall:
    """One forward call of an attention module, checked by AttentionModule.forward.

    query (B, L, E); key and value (B, S, *) or None (self-attention); mask,
    key_padding_mask, bias, position and cache as forward takes them; causal resolved
    (the module's default for None); dropout the probability this call drops
    attention probabilities with (0 outside training); need_weights as asked; paged:
    whether the cache is a PagedLayer (its update returns the pools of blocks, read
    through cache.paged_step).
    """

    query: Tensor
    key: Tensor | None
    value: Tensor | None
    mask: Tensor | Pattern | None
    key_padding_mask: Tensor | None
    bias: Tensor | None
    causal: bool
    position: AttentionPosition | None
    cache: Cache | None
    dropout: float = 0.0
    need_weights: bool = False
    paged: bool = False  # the cache is paged (a PagedLayer): update returns its pools


def check_input(name: str, t: Tensor, width: int) -> None:
    """A (batch, length, width) tensor, or a ValueError naming `name` and what it got."""
    if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != width:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be (batch, length, {width}), got {got}")


class AttentionModule(nn.Module):
    """The base of every attention module: forward checks a call once and hands it to
    the module's `_forward`; `_masks`, `_score` and `_attend` do what every module does
    with it.

    A module says (class attributes):
        causal_default: what causal=None means (MoBA: True; else False).
        self_attention_only: key and value must be None or the query itself.
        returns_weights: need_weights=True is served (MultiHeadAttention).
        paged_alternative: None where a paged cache (PagedLayer) is served; else the
            alternative its refusal names (a ValueError before anything is written).
        input_name: the query's name in errors (DiffAttention: "x").
    and holds embed_dim (E), dropout, backend and score (a ScoreFunction or None,
    applied after the position's).
    """

    causal_default: ClassVar[bool] = False
    self_attention_only: ClassVar[bool] = True
    returns_weights: ClassVar[bool] = False
    paged_alternative: ClassVar[str | None] = None
    input_name: ClassVar[str] = "query"
    embed_dim: int
    dropout: float = 0.0
    backend: str = "auto"
    score: ScoreFunction | None = None

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | Pattern | None = None,
        key_padding_mask: Tensor | None = None,
        bias: Tensor | None = None,
        causal: bool | None = None,
        need_weights: bool = False,
        position: AttentionPosition | None = None,
        cache: Cache | None = None,
        **options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from query (B, L, E) to key (B, S, kdim) / value (B, S, vdim).

        key=None means self-attention (key = value = query; the only kind a module with
        self_attention_only takes). mask is an mhsa.core.masks pattern or a bool tensor
        broadcastable to (B, H, L, S), True = may attend; key_padding_mask is (B, S)
        bool, True = a real token; bias is a float added to the scores, broadcastable
        to (B, H, L, S) (H: the heads of the engine call). causal is aligned
        bottom-right; None is the module's default (causal_default). position rotates
        q and k or scores them (rotary, ALiBi, T5). With a cache (mhsa.cache: any
        Cache), the new keys/values go through cache.update and attention runs over
        what it returns, the new tokens at the cache's next_positions: everything
        cached (KVCache), a cross-attention memory projected on the first call only
        (MemoryCache), or each sequence's pages (PagedLayer, from PagedKVCache.batch),
        which take no need_weights, dropout, key_padding_mask or bias, and a causal
        call within a SlidingWindow(left, 0) at most. options are the module's own
        (MultiHeadAttention: average_weights; LatentAttention: absorbed).

        Returns (B, L, E); with need_weights (where returns_weights) also the
        probabilities (B, L, S) averaged over heads, or (B, H, L, S): before dropout
        (torch's module returns them after it, in training).
        """
        call = AttentionCall(
            query,
            key,
            value,
            mask,
            key_padding_mask,
            bias,
            self.causal_default if causal is None else causal,
            position,
            cache,
            self.dropout if self.training else 0.0,
            need_weights,
            cache is not None and cache.paged_step is not None,
        )
        self._check_call(call)
        return self._forward(call, **options)

    def _forward(self, call: AttentionCall, **options: Any) -> Tensor | tuple[Tensor, Tensor]:
        """The module's attention for a checked call: (B, L, E)."""
        raise NotImplementedError

    def _check_call(self, call: AttentionCall) -> None:
        """What any module refuses, before a cache is written: a query of another width,
        weights it cannot return, another sequence's keys where it attends itself only,
        and over a paged cache what pages cannot hold (or the paged cache itself)."""
        name, query = type(self).__name__, call.query
        check_input(self.input_name, query, self.embed_dim)
        if call.need_weights and not self.returns_weights:
            raise ValueError(
                f"{name} returns no attention weights (need_weights=True): "
                "mhsa.attention_weights recomputes them from q and k"
            )
        key, value = call.key, call.value
        other = (key is not None and key is not query) or (value is not None and value is not query)
        if other and self.self_attention_only:
            raise ValueError(f"{name} is self-attention: pass no key or value")
        if not call.paged:
            return
        if self.paged_alternative is not None:
            raise ValueError(
                f"{name} does not attend over a paged cache (PagedLayer, from "
                f"PagedKVCache.batch): {self.paged_alternative}"
            )
        taken = [
            what
            for what, given in (
                ("need_weights", call.need_weights),
                ("dropout", call.dropout),
                ("key_padding_mask", call.key_padding_mask is not None),
                ("bias", call.bias is not None),
            )
            if given
        ]
        if taken:
            raise ValueError(
                f"{name} over a paged cache takes no {', '.join(taken)} (each sequence is "
                "its own): pass none of them, and call eval() for no dropout"
            )
        if other:
            raise ValueError("a paged cache caches self-attention: pass no key or value")
        paged_window(call.mask, call.causal, query.shape[1])

    def _masks(
        self, call: AttentionCall, kv_len: int
    ) -> tuple[Tensor | Pattern | None, Tensor | None]:
        """The call's mask merged with its key padding and the cache's, and its bias plus
        the position's, for kv_len keys (what cache.update returned); a paged cache
        refuses a dense bias."""
        query = call.query
        if call.cache is not None and call.cache.slots_after_query:
            self._check_static(call)
        masks = (call.mask, call.key_padding_mask, call.bias, call.position, call.cache)
        mask, bias = attention_masks(*masks, query.shape[0], query.shape[1], kv_len)
        if bias is not None and call.paged:
            raise ValueError(PAGED_BIAS)
        return mask, bias

    def _check_static(self, call: AttentionCall) -> None:
        """A StaticKVCache's query sits after all its slots (bottom-right), not at its
        position: causal, padding, separable scores (ALiBi) and scores reading no
        position (Softcap) do not see it, a pattern (but a window over every slot) or a
        score such as T5's buckets would (core.scores.sees_query_position)."""
        score, mask = self._score(call.position), call.mask
        band = mask.band() if isinstance(mask, Pattern) else None
        slots = call.cache.length
        whole = isinstance(mask, Causal | Full) or (
            band is not None and band.dilation == 1 and band.left >= slots - 1
        )
        seen = mask if isinstance(mask, Pattern) and not whole else None
        if seen is None and score is not None and sees_query_position(score):
            seen = score
        if seen is not None:
            raise ValueError(
                f"{type(self).__name__} over a {type(call.cache).__name__} cannot apply "
                f"{seen!r}: that cache places the query after all its slots; use a KVCache"
            )

    def _score(self, position: AttentionPosition | None) -> ScoreFunction | None:
        """The position's score function, then the module's own, or None."""
        return composed(None if position is None else position.score(), self.score)

    def _attend(
        self,
        call: AttentionCall,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | Pattern | None,
        bias: Tensor | None,
        *,
        scale: float | None,
        score: ScoreFunction | None,
        causal: bool | None = None,
    ) -> Tensor:
        """q (B, H, L, D) over k, v (B, H_kv, S, D / D_v) -> (B, H, L, D_v) on the module's
        backend: mhsa.attention, or with a paged cache mhsa.paged_attention over its
        pools (k, v: (blocks, block_size, H_kv, D)) and its step. causal: the call's
        unless given."""
        causal = call.causal if causal is None else causal
        if call.paged:
            step = call.cache.paged_step  # every layer's, planned once per step
            options = {"causal": causal, "scale": scale, "backend": self.backend, "score": score}
            return paged_attention(q, k, v, step, mask, **options)
        return attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            causal=causal,
            scale=scale,
            dropout_p=call.dropout,
            backend=self.backend,
            score=score,
        )

    @staticmethod
    def _merge_heads(out: Tensor) -> Tensor:
        """(B, H, L, D) -> (B, L, H * D)."""
        batch, heads, length, width = out.shape
        return out.transpose(1, 2).reshape(batch, length, heads * width)


__all__ = ["AttentionCall", "AttentionModule", "check_input"]
