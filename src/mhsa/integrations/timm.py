"""timm's vision transformers on mhsa's engine: each `timm.layers.Attention` (ViT, DeiT,
BEiT-style qkv with optional q_norm/k_norm, scale norm and output gate) replaced by a
TimmAttention that keeps its weights and computes attention with mhsa.attention, so
that patterns and score functions reach timm models.

    model = timm.create_model("vit_tiny_patch16_224")
    convert(model, pattern=SlidingWindow(16, 16))   # in place; returns the model

timm is imported only to find its layers; the model's weights are shared, not copied.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.attention import attention
from ..core.backends import registry
from ..core.masks import BoolMask, Pattern
from ..core.masks.base import pattern_or_none
from ..core.scores import ScoreFunction, as_score

__all__ = ["TimmAttention", "available", "convert"]

# timm.layers.Attention's parts, shared with the layer that replaces it
_PARTS = ("qkv", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop")


def available() -> tuple[bool, str]:
    """(whether timm can be used here, why not)."""
    try:
        import timm.layers  # noqa: F401
    except ImportError as error:  # timm, or torchvision beside it, missing or broken
        return False, f"timm cannot be imported ({error}); pip install timm"
    except RuntimeError as error:  # torchvision built for another torch
        return False, f"timm cannot be imported ({error})"
    return True, ""


def _timm_attention() -> type:
    ok, why = available()
    if not ok:
        raise ImportError(f"mhsa.integrations.timm needs timm: {why}")
    from timm.layers import Attention

    return Attention


class TimmAttention(nn.Module):
    """timm's Attention computed by mhsa.attention: x (B, N, C) -> (B, N, dim_out).

    pattern (an mhsa.core.masks Pattern) says which tokens may attend (None: all),
    score an mhsa.core.scores function applied to the scaled scores, backend as in
    mhsa.attention. forward takes timm's attn_mask (bool, True = may attend, or float,
    added to the scores; broadcastable to (B, H, N, N)) and is_causal, as timm's does.
    """

    def __init__(
        self,
        source: nn.Module,
        *,
        pattern: Pattern | None = None,
        score: ScoreFunction | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        attention_type = _timm_attention()
        if type(source) is not attention_type:
            raise TypeError(
                f"TimmAttention copies a timm.layers.Attention, got {type(source).__name__}; "
                "other timm attention layers (rotary, differential, ...) are not supported"
            )
        score = _checked_options(pattern, score, backend)
        for name in _PARTS:
            setattr(self, name, getattr(source, name))
        self.gate = getattr(source, "gate", None)
        self.num_heads, self.head_dim = source.num_heads, source.head_dim
        self.attn_dim, self.scale = self.num_heads * self.head_dim, source.scale
        self.pattern, self.score, self.backend = pattern, score, backend
        self.train(source.training)  # (a fresh module is in training mode: dropout in eval)

    def forward(
        self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        batch, length, _ = x.shape
        gate = None if self.gate is None else self.gate(x).sigmoid()
        qkv = self.qkv(x).reshape(batch, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, hd) each
        q, k = self.q_norm(q), self.k_norm(k)
        mask, bias = self.pattern, None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            mask = BoolMask(attn_mask) if mask is None else mask & BoolMask(attn_mask)
        elif attn_mask is not None:
            if not attn_mask.is_floating_point():
                raise TypeError(
                    f"attn_mask must be bool (True: may attend) or float (added to the "
                    f"scores), got {attn_mask.dtype}"
                )
            bias = attn_mask
        out = attention(
            q,
            k,
            v,
            mask,
            bias=bias,
            causal=is_causal,
            scale=self.scale,
            dropout_p=self.attn_drop.p if self.training else 0.0,
            score=self.score,
            backend=self.backend,
        )
        out = self.norm(out.transpose(1, 2).reshape(batch, length, self.attn_dim))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, pattern={self.pattern!r}"


def _checked_options(pattern, score, backend) -> ScoreFunction | None:
    """Raise for a bad pattern, score or backend now, not at the first forward; the
    score as one function."""
    pattern_or_none("pattern", pattern)
    score = as_score(score)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto":
        registry.get(backend)  # (ValueError naming the backends)
    return score


# timm's self-attention layers named *Attn (its channel attention, CBAM's ChannelAttn
# or ResNeSt's SplitAttn, is no attention over tokens and may stand beside)
TIMM_ATTN_LAYERS = frozenset(
    {"BottleneckAttn", "HaloAttn", "LocallyGroupedAttn", "GlobalSubSampleAttn"}
    | {"TalkingHeadAttn", "ClassAttn", "LambdaLayer"}
)


def convert(
    model: nn.Module,
    *,
    pattern: Pattern | None = None,
    score: ScoreFunction | None = None,
    backend: str = "auto",
) -> nn.Module:
    """Replace every timm.layers.Attention in model by a TimmAttention (in place, weights
    shared) and return model. Raises ValueError naming the layers of another attention
    type (they would keep timm's own attention), or when there is none to replace."""
    attention_type = _timm_attention()
    _checked_options(pattern, score, backend)  # before any layer is replaced
    others = sorted(
        {
            type(module).__name__
            for module in model.modules()
            if ("Attention" in type(module).__name__ or type(module).__name__ in TIMM_ATTN_LAYERS)
            and type(module) is not attention_type
            and not isinstance(module, TimmAttention)
        }
    )
    if others:
        raise ValueError(
            f"{type(model).__name__} has attention layers mhsa does not replace: "
            f"{', '.join(others)}; only timm.layers.Attention is supported"
        )
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is attention_type:
                layer = TimmAttention(child, pattern=pattern, score=score, backend=backend)
                setattr(parent, name, layer)
                replaced += 1
    if not replaced:
        raise ValueError(f"{type(model).__name__} has no timm.layers.Attention to replace")
    return model
