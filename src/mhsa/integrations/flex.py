"""FlexAttention's API on mhsa's flash engine: `flex_attention` and `create_block_mask`
with torch.nn.attention.flex_attention's arguments and results, forward and backward on
any device (torch's FlexAttention has none on CPU, pytorch#148752), with no compile step.

There is no second attention path: a BlockMask lowers to the engine's block plan
(flex_blocks.BlockMaskPattern: skipped blocks are never visited, full blocks apply no
mask, partial blocks call mask_mod on index tensors per tile) and a score_mod becomes
an mhsa score function evaluated per tile, whose backward differentiates each tile with
autograd, so gradients reach the tensors score_mod closes over (directly, or as the
parameters of a module it closes over).

Indices: FlexAttention's q_idx and kv_idx count from 0 in the query and in the key
(top-left), whatever L and S are. mhsa's own score functions and patterns see global
positions aligned bottom-right (query row r at r + S - L); here they are translated, so
a score_mod sees q_idx = r. An mhsa.core.scores function passed as score_mod (ALiBi,
Softcap, ...) is applied at Flex's indices too, and keeps its fast paths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.attention import attention
from ..core.checks import tensors_of_rank
from ..core.kernels.dense import stats_dtype
from ..core.kernels.memo import PatternCache
from ..core.score_checks import captured_tensors
from ..core.scores import ScoreFunction
from .flex_blocks import BlockMaskPattern, create_block_mask, flex_module, is_noop
from .flex_scores import FlexScore, ScoreModFn

__all__ = ["available", "create_block_mask", "flex_attention"]


def _check_tensors(query, key, value, enable_gqa: bool, block_mask) -> None:
    """FlexAttention's own rules on q, k, v; the rest is checked by mhsa.attention."""
    layout, hint = "(batch, heads, length, head_dim)", "; for one head add it with .unsqueeze(1)"
    tensors_of_rank(4, layout, hint, query=query, key=key, value=value)
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if not enable_gqa and num_heads != num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads but key/value have {num_kv_heads}: pass "
            "enable_gqa=True for grouped-query attention"
        )
    if enable_gqa and (num_kv_heads == 0 or num_heads % num_kv_heads != 0):
        raise ValueError(
            f"enable_gqa=True needs query heads ({num_heads}) to be a multiple of key/value "
            f"heads ({num_kv_heads})"
        )
    batch = query.shape[0]
    if key.shape[0] != batch and not (key.shape[0] == 1 and block_mask is not None):
        raise ValueError(
            f"query has batch {batch} but key has {key.shape[0]}: give them one batch size "
            "(a key batch of 1 is shared by every query sequence only with a block_mask)"
        )


# lowered BlockMasks, so that a model calling one BlockMask in every layer lowers it (and
# checks its diagonal tiles) once
_LOWERED = PatternCache(size=16)
_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _lowered(block_mask, batch: int, heads: int, q_len: int, kv_len: int, device):
    """block_mask as the engine's pattern, or None when everything may attend."""
    if block_mask is None:
        return None
    if not all(hasattr(block_mask, name) for name in ("kv_num_blocks", "kv_indices")):
        raise TypeError(
            "block_mask must be a BlockMask (mhsa.flex.create_block_mask or torch's), got "
            f"{type(block_mask).__name__}"
        )
    if is_noop(block_mask):
        return None
    made_for = tuple(block_mask.seq_lengths)
    if made_for != (q_len, kv_len):
        raise ValueError(
            f"block_mask was made for (Q_LEN, KV_LEN) = {made_for} but query has L={q_len} "
            f"and key S={kv_len}: build it with create_block_mask(mask_mod, B, H, {q_len}, "
            f"{kv_len})"
        )
    if block_mask.kv_num_blocks.device != device:
        raise ValueError(
            f"block_mask is on {block_mask.kv_num_blocks.device} but query is on {device}: "
            f"move it with block_mask.to({str(device)!r}) or build it with device="
        )
    fields = (getattr(block_mask, name) for name in _FIELDS)
    key = (
        id(block_mask),
        id(block_mask.mask_mod),
        tuple(block_mask.BLOCK_SIZE),
        *((id(t), t._version) for t in fields if t is not None),  # in-place edits too
        # (the tiles' triangles and windows are read from mask_mod: the tensors it reads)
        *((id(t), t._version) for t in captured_tensors(block_mask.mask_mod)),
        batch,
        heads,
        q_len,
        kv_len,
    )

    def build():  # the entry holds block_mask: its id is not reused while cached
        return block_mask, BlockMaskPattern(block_mask, batch, heads, q_len, kv_len)

    return _LOWERED.get(None, key, build)[1]


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: ScoreModFn | ScoreFunction | None = None,
    block_mask=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux=None,
):
    """torch.nn.attention.flex_attention.flex_attention on mhsa's flash engine,
    differentiable on any device (CPU included) without compiling.

    softmax(score_mod(q k^T * scale) masked by block_mask) v, where score_mod(score,
    b, h, q_idx, kv_idx) rewrites each score and the BlockMask decides what may attend.

    Args:
        query: (B, Hq, L, E).
        key: (B, Hkv, S, E).
        value: (B, Hkv, S, Ev).
        score_mod: an elementwise fn(score, b, h, q_idx, kv_idx) -> score written with
            torch ops (called per tile with broadcastable int64 index tensors, not
            under vmap), or an mhsa.core.scores function; q_idx and kv_idx count from 0
            in the query and the key, h is the query head. Tensors it closes over
            (directly, or as parameters of a module it closes over) get gradients.
        block_mask: a BlockMask from create_block_mask (this module's or torch's) for
            exactly (L, S), with B and H of 1 or the call's; None: every key.
        scale: multiplies q k^T; 1 / sqrt(E) by default.
        enable_gqa: allow Hkv < Hq (Hq % Hkv == 0): query head h uses kv head
            h // (Hq // Hkv).
        return_lse: also return the logsumexp of each row's scores.
        kernel_options: tuning of torch's Triton kernels; accepted and ignored (mhsa's
            results do not depend on it).
        return_aux: torch's newer form of return_lse, an AuxRequest(lse=True): then
            (out, AuxOutput(lse=lse)) is returned. max_scores is not served.

    Returns:
        out (B, Hq, L, Ev) in query's dtype; with return_lse, (out, lse (B, Hq, L)) with
        lse float32 (float64 for float64 inputs). A row with no allowed key gets output
        0 and lse -inf, and zero gradients.
    """
    if return_aux is not None:
        if return_lse:
            raise ValueError("pass return_lse=True or return_aux, not both")
        if getattr(return_aux, "max_scores", False):
            raise ValueError(
                "return_aux=AuxRequest(max_scores=True) is not served by mhsa.flex: request "
                "lse only"
            )
    _check_tensors(query, key, value, enable_gqa, block_mask)
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(
            f"kernel_options must be a dict or None, got {type(kernel_options).__name__}"
        )
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            "score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx) or an "
            f"mhsa.core.scores function, got {type(score_mod).__name__}"
        )
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    pattern = _lowered(block_mask, batch, heads, q_len, kv_len, query.device)
    if key.shape[0] != batch:  # a key batch of 1 shared by every sequence, as torch allows
        key = key.expand(batch, *key.shape[1:])
        value = value.expand(batch, *value.shape[1:])
    score = None if score_mod is None else FlexScore(score_mod, q_len, kv_len)
    if score is not None and torch.is_grad_enabled():
        score.check_gradients_reach(heads, query.device, stats_dtype(query.dtype))
    out, lse = attention(
        query,
        key,
        value,
        pattern,
        scale=scale,
        score=score,
        return_lse=True,
        backend="flash",
    )
    if return_aux is not None:
        return out, flex_module().AuxOutput(lse=lse if return_aux.lse else None)
    return (out, lse) if return_lse else out


def available() -> tuple[bool, str]:
    """(usable here, why): for `mhsa info`."""
    try:
        flex_module()
    except ImportError:
        return False, "needs torch.nn.attention.flex_attention (torch >= 2.5) for its BlockMask"
    return True, "FlexAttention's API on the flash engine: forward and backward, CPU included"
