"""The AttentionInterface entry for "mhsa": transformers' attention call on mhsa.attention.

transformers calls it as `(module, query (B, H, L, D), key (B, H_kv, S, D), value,
attention_mask, *, scaling, dropout, ...)` and takes back (out (B, L, H, D), weights or
None). Every argument it cannot honour is an error, never a silent change of results.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from mhsa.core.attention import attention, attention_and_weights
from mhsa.core.masks import BoolMask, Pattern, SlidingWindow
from mhsa.core.scores import Softcap

from .masks import LoweredMask

# arguments the models pass along that do not change attention: positions are already in
# the rotated q and k, the cache already holds the keys, the rest steer other outputs
IGNORED = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "return_dict",
        "logits_to_keep",  # (the head's; LLaVA-OneVision's and GOT-OCR2's reach every layer)
        "token_type_ids",  # (the mask function has read them)
    }
)
# arguments that do not change attention at these values (ModernBERT always passes its
# config's deterministic_flash_attn, False by default)
IGNORED_AT = {"deterministic": (False,)}
PATTERN_ATTRIBUTE = "_mhsa_pattern"  # where set_pattern puts a layer's pattern


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: LoweredMask | Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    output_attentions: bool = False,
    mhsa_pattern: Pattern | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """Attention of one transformers layer on mhsa's engine.

    Args:
        module: the model's attention module (its class names it in errors; its
            `is_causal` decides causality when the model passes no mask).
        query: (B, H, L, D); key, value: (B, H_kv, S, D), grouped-query when H_kv < H.
        attention_mask: what the "mhsa" mask function built (a LoweredMask), a 4-D mask
            the caller gave (bool, True = may attend, or float added to the scores), or
            None (nothing to mask but causality, if the module is causal).
        scaling: multiplies q k^T (default 1 / sqrt(D)).
        dropout: probability of dropping an attention weight (the models pass 0 in eval).
        is_causal: overrides module.is_causal when attention_mask is None.
        sliding_window: the layer's window; its mask already holds it, as for "eager".
        softcap: Gemma 2's cap * tanh(score / cap), as mhsa.scores.Softcap.
        s_aux: (H,) sink logits (GPT-OSS), as mhsa.attention's sinks.
        position_bias: float, broadcastable to (B, H, L, S), added to the scores (T5's
            relative positions), as mhsa.attention's bias.
        output_attentions: also return the probabilities (B, H, L, S) (so does a call
            while transformers records them, _collecting_weights), before dropout.
        mhsa_pattern: an mhsa pattern that narrows what the model's mask allows.

    Returns:
        (out (B, L, H, D_v), probabilities (B, H, L, S) with output_attentions, else None).
    """
    where = f"{type(module).__name__} (attn_implementation='mhsa')"
    _check_arguments(where, kwargs)
    query, key, value = _autocast(query, key, value)
    pattern = _pattern(where, module, mhsa_pattern)
    mask, bias, causal = _masks(where, module, attention_mask, query, key, is_causal)
    kv_len = key.shape[2]
    if isinstance(attention_mask, LoweredMask) and attention_mask.keys_used < kv_len:
        used = attention_mask.keys_used  # a StaticCache's free slots are never attended
        key, value = key[:, :, :used], value[:, :, :used]
        if position_bias is not None and position_bias.shape[-1] == kv_len:
            position_bias = position_bias[..., :used]
    if attention_mask is None and sliding_window is not None:
        raise ValueError(
            f"{where} got sliding_window={sliding_window} but no mask: mhsa (as 'eager') "
            "takes the window from the mask transformers builds, and this model built none; "
            "pass mhsa_pattern=SlidingWindow(...) or run it with attn_implementation='sdpa'"
        )
    if pattern is not None:
        if is_cross_attention(module):
            raise ValueError(
                f"{where} attends to another sequence (cross-attention), where a pattern's "
                "positions mean nothing; set patterns on self-attention layers with "
                "set_pattern(model, pattern) (which leaves cross-attention out)"
            )
        _check_placed(where, attention_mask, query.shape[2], key.shape[2])
        mask, causal = _narrowed(mask, causal, pattern)
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    call = dict(
        bias=bias,
        causal=causal,
        scale=scaling,
        dropout_p=float(dropout),
        score=None if softcap is None else Softcap(softcap),
        sinks=s_aux,
    )
    if output_attentions or _collecting_weights():
        if pattern is not None:
            raise ValueError(
                f"{where}: output_attentions=True with an mhsa_pattern would materialise "
                "the (B, H, L, S) probabilities the pattern exists to avoid; drop one of them "
                "(or ask mhsa.attention_weights for selected rows)"
            )
        out, weights = attention_and_weights(query, key, value, mask, **call)
        weights = nn.functional.pad(weights, (0, kv_len - key.shape[2]))  # the unused keys
    else:
        # as transformers' own kernels: no finiteness check, whose device sync per layer
        # they do not pay (their keys are projections of finite hidden states)
        out = attention(query, key, value, mask, isolate_nonfinite=False, **call)
        weights = None
    return out.transpose(1, 2).contiguous(), weights


def _autocast(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in autocast's dtype where autocast is on and they differ, as sdpa takes
    them: transformers' rotary step leaves q and k in float32 (its cos and sin) and v in
    bfloat16. Elsewhere they are left as they are (mixed dtypes: mhsa's error)."""
    device = query.device.type
    if query.dtype == key.dtype == value.dtype or not torch.is_autocast_enabled(device):
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _collecting_weights() -> bool:
    """Whether transformers is recording attention probabilities: its output-capturing
    hooks take them from the attention modules' outputs, and models such as GPT-2 and
    OPT keep output_attentions from the attention function (which then returned None)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    if capturing is None:  # (an older transformers passes output_attentions itself; a
        return False  # failed import per call would cost 14 us a layer)
    collector = getattr(capturing, "_active_collector", None)
    collected = None if collector is None else collector.get()
    return bool(collected) and ("attentions" in collected or "cross_attentions" in collected)


def _check_placed(where: str, attention_mask, q_len: int, kv_len: int) -> None:
    """A pattern places key j at position j and query i at i + S - L: raise where the
    layer's keys and queries sit elsewhere."""
    if isinstance(attention_mask, LoweredMask):
        if attention_mask.from_zero:
            return
        sits = (
            f"its keys start at position {attention_mask.kv_offset} and its queries at "
            f"{attention_mask.q_offset}"
        )
    elif q_len == kv_len:
        return
    else:
        sits = f"it has {q_len} queries, {kv_len} keys and no mask that places them"
    raise ValueError(
        f"{where}: mhsa_pattern needs key j at position j and the queries at the last "
        f"positions, but {sits} (a sliding-window cache, or cross-attention "
        "to another sequence); set the pattern on other layers with set_pattern(model, "
        "pattern, layers=...), or decode with a DynamicCache without sliding layers"
    )


def _narrowed(
    mask: Pattern | Tensor | None, causal: bool, pattern: Pattern
) -> tuple[Pattern, bool]:
    """(mask, causal) allowing what both the model's mask and the pattern allow. Windows
    stay one SlidingWindow: the engines have fast paths for a band, not for an
    intersection of bands."""
    ours = pattern.band()
    if ours is not None and ours.dilation == 1:
        if mask is None and causal:
            return SlidingWindow(ours.left, min(ours.right, 0)), False
        theirs = mask.band() if isinstance(mask, Pattern) else None
        if theirs is not None and theirs.dilation == 1 and not causal:
            return SlidingWindow(min(ours.left, theirs.left), min(ours.right, theirs.right)), False
    if mask is None:
        return pattern, causal
    return (BoolMask(mask) if isinstance(mask, Tensor) else mask) & pattern, causal


def _check_arguments(where: str, kwargs: dict) -> None:
    unknown = sorted(
        name
        for name, value in kwargs.items()
        if name not in IGNORED
        and value is not None
        and not any(value is same for same in IGNORED_AT.get(name, ()))
    )
    if unknown:
        raise TypeError(
            f"{where} got {', '.join(map(repr, unknown))}, which mhsa cannot honour; "
            "run this model with attn_implementation='eager' or 'sdpa', or drop the argument"
            " (mhsa's own argument is mhsa_pattern=)"
        )


def is_cross_attention(module: nn.Module) -> bool:
    """Whether a transformers attention module attends to another sequence: it says so
    or its class's name does (BertCrossAttention), or it is a decoder's non-causal
    attention (BART, T5, Whisper and their kin)."""
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__:
        return True
    decoder = bool(getattr(module, "is_decoder", False))
    return decoder and getattr(module, "is_causal", None) is False


def _pattern(where: str, module: nn.Module, given: Pattern | None) -> Pattern | None:
    """The pattern of this call: the forward's mhsa_pattern or the layer's own."""
    own = getattr(module, PATTERN_ATTRIBUTE, None)
    if given is not None and not isinstance(given, Pattern):
        raise TypeError(
            f"{where}: mhsa_pattern must be an mhsa.masks pattern (SlidingWindow(...), "
            f"bigbird(...), ...), got {type(given).__name__}"
        )
    if given is not None and own is not None:
        raise ValueError(
            f"{where} has the pattern {own!r} from set_pattern and got mhsa_pattern={given!r}; "
            "pass one of them (set_pattern(model, None) clears the layers' patterns)"
        )
    return own if given is None else given


def _masks(
    where: str,
    module: nn.Module,
    attention_mask,
    query: Tensor,
    key: Tensor,
    is_causal: bool | None,
) -> tuple[Pattern | Tensor | None, Tensor | None, bool]:
    """(mask, bias, causal) for mhsa.attention from the model's attention_mask."""
    if isinstance(attention_mask, LoweredMask):
        sizes = (attention_mask.q_len, attention_mask.kv_len)
        if sizes != (query.shape[2], key.shape[2]):
            raise ValueError(
                f"{where}: the mask was built for L={sizes[0]} queries and S={sizes[1]} keys "
                f"but the layer has L={query.shape[2]} and S={key.shape[2]}; its cache "
                "returned other keys than it announced to the mask"
            )
        return attention_mask.mask, None, attention_mask.causal
    if attention_mask is None:
        causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        return None, None, bool(causal) and query.shape[2] > 1
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            return attention_mask, None, False
        if attention_mask.is_floating_point():
            return None, attention_mask, False
    raise TypeError(
        f"{where} got an attention_mask it cannot read: {_describe(attention_mask)}; "
        "it takes the masks of its own mask function (register() installs it), a 4-D bool "
        "mask (True = may attend) or a 4-D float mask added to the scores"
    )


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
