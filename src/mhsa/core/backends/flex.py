"""The flex backend: PyTorch's compiled FlexAttention, for patterns on CUDA.

A call's mask and bottom-right causal alignment become a BlockMask built from the
pattern's block kinds in O(blocks) (flex_plan.py: no L x S mask, and a mask_mod that
every FlexAttention compiler lowers; a bool tensor is looked up); an mhsa.core.scores
function becomes a score_mod, with our global query positions. FlexAttention then
skips the empty tiles and applies no mask in full ones. BlockMasks of patterns are
cached per (pattern, causal, shape, device), so a model calling the same pattern in
every layer builds it once. Used on CUDA only: on CPU FlexAttention has no backward,
and our flash engine serves patterns there.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..checks import as_4d
from ..kernels.memo import PatternCache
from ..kernels.scored import add_sinks
from ..masks import Pattern, with_causal
from ..masks.causal import causal_shift
from .common import combined_mask, recompile_limit
from .flex_plan import block_mask_from_kinds, pattern_block_mask
from .registry import PAGED_REASON, AttentionSpec, Backend

BLOCK = 128  # FlexAttention's tile


def _flex_module():
    from torch.nn.attention import flex_attention

    return flex_attention


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(_flex_module().flex_attention, dynamic=False)


def _dense_mask(
    mask: Tensor | Pattern | None, causal: bool, q_len: int, kv_len: int, device
) -> Tensor | None:
    """(Bm, Hm, L, S) bool, True = may attend, or None when nothing is masked."""
    dense = as_4d(combined_mask(mask, causal, q_len, kv_len, device))
    # mask_mod indexes [q_idx, kv_idx]: a mask broadcast over rows or keys is spread out
    return None if dense is None else dense.expand(*dense.shape[:2], q_len, kv_len)


def block_mask_for(
    mask: Tensor | Pattern | None, causal: bool, shape: tuple[int, int, int, int], device
):
    """The FlexAttention BlockMask of a call (batch, heads, L, S); None if unmasked.
    Patterns and plain causal masks are cached; tensor masks are rebuilt each call
    (they may change in place)."""
    if mask is None and not causal:
        return None
    if isinstance(mask, Tensor):
        return _build_block_mask(mask, causal, shape, device)
    build = functools.partial(_build_block_mask, mask, causal, shape, device)
    return _CACHE.get(mask, (causal, tuple(shape), str(device)), build)


_CACHE = PatternCache(size=64)


def _build_block_mask(mask, causal: bool, shape: tuple, device):
    batch, heads, q_len, kv_len = shape
    if mask is None or isinstance(mask, Pattern):
        pattern = with_causal(mask, causal)
        if not pattern.by_position:
            return pattern_block_mask(pattern, q_len, kv_len, BLOCK, device)
        shift = causal_shift(q_len, kv_len)

        def position_mod(b, h, q_idx, kv_idx):  # a closed form: no bitmaps
            return pattern.positions(q_idx + shift, kv_idx)

        kinds = pattern.kinds(q_len, kv_len, BLOCK, BLOCK)
        return block_mask_from_kinds(kinds, position_mod, q_len, kv_len, BLOCK, device)
    dense = _dense_mask(mask, causal, q_len, kv_len, device)
    per_batch, per_head = dense.shape[0] > 1, dense.shape[1] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b if per_batch else 0, h if per_head else 0, q_idx, kv_idx]

    return _flex_module().create_block_mask(
        mask_mod,
        batch if per_batch else None,
        heads if per_head else None,
        q_len,
        kv_len,
        device=device,
        BLOCK_SIZE=BLOCK,
    )


def _score_mod(score, q_len: int, kv_len: int):
    """An mhsa.core.scores function as FlexAttention's score_mod: flex numbers query rows
    0..L-1, our functions see global positions (row + S - L)."""
    if score is None:
        return None
    shift = causal_shift(q_len, kv_len)

    def score_mod(value, b, h, q_idx, kv_idx):
        return score(value, b, h, q_idx + shift, kv_idx)

    return score_mod


def flex_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Pattern | None,
    causal: bool,
    scale: float,
    compiled: bool = True,
    score=None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D_v), lse (B, H, L) float32) with FlexAttention; score is an
    mhsa.core.scores function or None; sinks (H,) join each row's denominator after
    FlexAttention, through its differentiable lse; compiled=False runs it eagerly
    (slow; for checking on CPU)."""
    batch, heads, q_len, _ = q.shape
    block_mask = block_mask_for(mask, causal, (batch, heads, q_len, k.shape[2]), q.device)
    flex = _compiled_flex() if compiled else _flex_module().flex_attention
    with recompile_limit():
        out, lse = flex(
            q,
            k,
            v,
            score_mod=_score_mod(score, q_len, k.shape[2]),
            block_mask=block_mask,
            scale=scale,
            enable_gqa=k.shape[1] != heads,
            **_lse_request(),
        )
    lse = getattr(lse, "lse", lse).float()  # an AuxOutput where return_aux was used
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def _lse_request() -> dict:
    """How this torch asks flex_attention for the logsumexp: `return_aux=AuxRequest(lse=
    True)` where it exists (`return_lse` is deprecated there, with a warning per call),
    `return_lse=True` in older torch."""
    aux_request = getattr(_flex_module(), "AuxRequest", None)
    return {"return_lse": True} if aux_request is None else {"return_aux": aux_request(lse=True)}


class FlexBackend(Backend):
    name = "flex"

    def available(self) -> str | None:
        try:
            _flex_module()
        except ImportError:
            return "torch.nn.attention.flex_attention is missing (torch >= 2.5 has it)"
        return None

    def supports(self, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cuda":
            return (
                "used on CUDA only: on CPU FlexAttention has no backward, and without one "
                "the flash engine serves the same patterns and scores faster (mhsa bench sparse)"
            )
        if spec.paged:
            return PAGED_REASON
        if spec.has_bias:
            return "no additive bias (triton and flash take one)"
        if spec.dropout_p:
            return "no dropout (triton and flash take it with any pattern)"
        return None

    def preference(self, spec: AttentionSpec) -> float:
        # On CUDA: the choice for patterns (sdpa wins unmasked and aligned-causal calls)
        return 2.5 if spec.has_mask or spec.causal else 0.5

    def forward(
        self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse, score=None, sinks=None
    ):
        out, lse = flex_forward(
            q, k, v, mask=mask, causal=causal, scale=scale, score=score, sinks=sinks
        )
        return out, (lse if return_lse else None)
