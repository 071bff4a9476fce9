"""The public attention functions: validate, then dispatch to a backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from . import validate
from .backends import AttentionSpec, get, select
from .backends.common import tracing
from .backends.isolate import (
    attends_bad_key,
    bad_keys,
    isolate_masked_nonfinite,
    zero_nonfinite,
)
from .backends.reference import attention_probs
from .checks import as_4d
from .kernels.dense import apply_dropout, grouped_scores, probs_times_v, stats_dtype
from .kernels.dropout import draw_seed
from .kernels.scored import SelectedHeads, softmax_with_sinks
from .masks import Pattern, with_causal
from .masks.base import part_kinds
from .masks.causal import causal_shift
from .paged import attention_over_pages
from .scores import Probe, ScoreFunction, apply_score, as_score, kinds


def _check_common(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float | None,
    sharded: bool = False,
    score: ScoreFunction | None = None,
    sinks: Tensor | None = None,
) -> float:
    """Validate mask/bias/causal/scale/score/sinks against q and k; return the resolved
    scale."""
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    validate.check_mask(mask, target, q.device, sharded)
    validate.check_bias(bias, target, q.device)
    validate.check_sinks(sinks, q.shape[1], q.device)
    if score is not None:
        # (tried within the call's positions: a table sized by them fits; traced, the
        # lengths may be symbols, and the plain tile is tried)
        compiling = torch.compiler.is_compiling()
        probe = Probe() if compiling else Probe.within(q.shape[2], k.shape[2])
        score.check(q.shape[1], q.device, stats_dtype(q.dtype), probe)
    validate.check_causal(causal)
    validate.check_scale(scale)
    return validate.resolved_scale(q, scale)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | Pattern | None = None,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_lse: bool = False,
    score: ScoreFunction | list | None = None,
    sinks: Tensor | None = None,
    block_table: Tensor | None = None,
    seq_lens: Tensor | Sequence[int] | None = None,
    isolate_nonfinite: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention: softmax(score(q k^T * scale) + bias) v.

    Args:
        q: (B, H, L, D) queries.
        k: (B, H_kv, S, D) keys; H % H_kv == 0 gives grouped-query attention
            (query head h uses key head h // (H // H_kv)); H_kv = 1 is multi-query.
        v: (B, H_kv, S, D_v) values.
        mask: an mhsa.core.masks pattern (e.g. SlidingWindow(256, 0)), or a bool tensor
            broadcastable to (B, H, L, S); True means "may attend".
        bias: float, broadcastable to (B, H, L, S); added to the scaled scores.
        causal: query i may attend key j only if j <= i + S - L (aligned
            bottom-right, so with a KV cache the newest query sees every key).
        scale: multiplies q k^T; defaults to 1 / sqrt(D).
        dropout_p: probability of dropping an attention weight (0 disables it).
        backend: "auto" (fastest that serves the call) or a name from mhsa.backends().
        return_lse: also return the logsumexp of each row's scores.
        score: an mhsa.core.scores function (ALiBi, RelativeBias, Softcap, ScoreMod) or a
            list of them applied in order to the scaled scores, before the bias and the
            mask; positions are global, query i at i + S - L like causal.
        sinks: (H,) float logits, one per query head, of a key without a value: it
            takes probability mass (exp(sink) joins each row's denominator).
        block_table: paged keys (a PagedKVCache's pages). k and v are then pools
            (num_blocks, block_size, H_kv, D) and (..., D_v) of N sequences' keys, q
            is (N, H, T, D): the T new queries of each, and block_table (N, max_blocks)
            holds integer block ids: sequence n's key j is row j % block_size of block
            block_table[n, j // block_size] (entries past its keys: any value).
            Attention is causal per sequence (causal=True), aligned bottom-right:
            query t of sequence n sits at position seq_lens[n] - T + t and sees the
            keys up to it (a query with no key gets 0), within SlidingWindow(left, 0)
            if that is the mask; score functions see each sequence's own positions.
            No bias, dropout, sinks or return_lse. Backends say in `mhsa info` whether
            they serve paged keys (flash: inference only; reference: differentiable).
            This checks the table at each call: a decoding step's layers share one
            checked mhsa.PagedStep through mhsa.paged_attention instead.
        seq_lens: with block_table, (N,) ints: the keys of each sequence, the new
            ones included, at most max_blocks * block_size.
        isolate_nonfinite: keep a non-finite key or value that a row is masked from out
            of that row (docs/attention.md), at the cost of one reduction and, on CUDA,
            a device synchronisation per call. False skips the check, as sdpa, flex
            and FlashAttention do (and as traced graphs always do): for callers whose
            keys and values are known finite.

    Returns:
        out (B, H, L, D_v) in q's dtype; with return_lse, (out, lse) where lse is
        (B, H, L) float32 (float64 for float64 inputs). A query row with no allowed
        key gets output 0, lse -inf (the sink's logit, with sinks) and zero gradients.
    """
    if not isinstance(isolate_nonfinite, bool):
        raise TypeError(
            f"isolate_nonfinite must be True or False, got {type(isolate_nonfinite).__name__}"
        )
    if block_table is not None or seq_lens is not None:
        return attention_over_pages(
            q,
            k,
            v,
            mask,
            block_table,
            seq_lens,
            bias=bias,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            backend=backend,
            return_lse=return_lse,
            score=score,
            sinks=sinks,
        )
    validate.check_qkv(q, k, v)
    validate.check_dropout(dropout_p)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    score = as_score(score)
    batch, num_heads, q_len, head_dim = q.shape
    kv_len, value_dim = k.shape[2], v.shape[3]
    spec = AttentionSpec(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=k.shape[1],
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        value_dim=value_dim,
        dtype=q.dtype,
        device=q.device,
        has_mask=mask is not None,
        has_bias=bias is not None,
        causal=causal,
        dropout_p=float(dropout_p),
        return_lse=return_lse,
        has_score=score is not None,
        score_kinds=kinds(score),
        mask_kinds=part_kinds(mask),
        has_sinks=sinks is not None,
        needs_grad=torch.is_grad_enabled()
        and any(
            isinstance(t, Tensor) and t.requires_grad
            for t in (q, k, v, bias, sinks, *(score.tensors() if score is not None else ()))
        ),
    )
    if batch == 0 or q_len == 0 or kv_len == 0:
        # the backend is still checked: a misspelt or unfit one fails as it would on
        # the same call with data in it
        select(dataclasses.replace(spec, batch=1, q_len=1, kv_len=1), backend)
        _check_common(q, k, mask, bias, causal, scale, score=score, sinks=sinks)
        return empty_result(q, k, v, sinks, return_lse)
    # one query aligned bottom-right sees every key (a decoding step): nothing to mask,
    # and backends take their unmasked fast paths; but a sharded (ring) backend's
    # causality is global, across the shards
    unmasked = causal is True and q_len == 1
    chosen = select(dataclasses.replace(spec, causal=False) if unmasked else spec, backend)
    if unmasked and chosen.sharded:
        chosen, unmasked = select(spec, backend), False
    if unmasked:
        causal = False
    resolved_scale = _check_common(q, k, mask, bias, causal, scale, chosen.sharded, score, sinks)
    call = dict(
        # a (S,) or 0-D mask or bias as (1, S) or (1, 1): backends read (L, S) from the right
        mask=torch.atleast_2d(mask) if isinstance(mask, Tensor) else mask,
        bias=None if bias is None else torch.atleast_2d(bias),
        causal=causal,
        scale=resolved_scale,
        dropout_p=float(dropout_p),
        return_lse=return_lse,
        score=score,
        sinks=sinks,
    )
    out, lse = chosen.forward(q, k, v, **call)
    if isolate_nonfinite:
        out, lse = isolate_masked_nonfinite(chosen, q, k, v, out, lse, call)
    return (out, lse) if return_lse else out


def empty_result(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, return_lse: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """attention's (moba's, cluster's) answer when B, L or S is 0: exact zeros that stay
    in the autograd graph (zero gradients), as SDPA's do; a sum over no elements is 0 whatever the
    inputs hold, nan included. lse is -inf, or the sink's logit (a row's only "key")."""
    batch, num_heads, q_len, _ = q.shape
    connected = sum(t.reshape(-1)[:0].sum() for t in (q, k, v))
    out = q.new_zeros(batch, num_heads, q_len, v.shape[3]) + connected
    lse = q.new_full((batch, num_heads, q_len), -torch.inf, dtype=stats_dtype(q.dtype))
    if sinks is not None:
        lse = sinks.to(lse.dtype).view(1, -1, 1).expand(batch, num_heads, q_len)
    return (out, lse) if return_lse else out


def attention_weights(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    backend: str = "auto",
    heads: Sequence[int] | Tensor | None = None,
    rows: Sequence[int] | Tensor | None = None,
    score: ScoreFunction | list | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The attention probabilities softmax(score(q k^T * scale) + bias), (B, h, r, S).

    Same arguments and conventions as `attention`; rows with no allowed key are 0.
    heads and rows pick query heads and query rows (default all): only those
    (B, len(heads), len(rows), S) probabilities are computed, never the rest.
    backend "flash" normalises them by the logsumexp of the tiled engine (exactly
    what its forward used); "reference" by a softmax over each selected row. "auto"
    is "reference" for all heads and rows, else "flash". Computed in float32
    (float64 for float64 inputs) and returned in q's dtype.
    """
    validate.check_qkv(q, k, k)
    score = as_score(score)
    resolved_scale = _check_common(q, k, mask, bias, causal, scale, score=score, sinks=sinks)
    num_heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    head_idx = _indices("heads", heads, num_heads, q.device)
    row_idx = _indices("rows", rows, q_len, q.device)
    if backend == "auto":
        backend = "reference" if heads is None and rows is None else "flash"
    if backend not in ("reference", "flash", "triton"):
        raise ValueError(
            "attention_weights backend must be 'auto', 'reference', 'flash' or 'triton', "
            f"got {backend!r}"
        )
    if head_idx.numel() == 0 or row_idx.numel() == 0:  # an empty selection is no error
        return q.new_zeros(q.shape[0], head_idx.numel(), row_idx.numel(), kv_len)
    q_sel = q.index_select(1, head_idx)
    k_sel = k.index_select(1, head_idx // (num_heads // k.shape[1]))
    keys = torch.arange(kv_len, device=q.device)
    if isinstance(mask, Tensor):
        mask_sel = _select(mask, 1, head_idx)
    else:
        mask_sel = None if mask is None else mask.of_heads(head_idx)
    # what may attend: the mask and the causal rule as one pattern, on the selected rows
    pattern = with_causal(mask_sel, causal)
    allowed = None
    if pattern is not None:
        allowed = pattern.allowed(row_idx.view(-1, 1), keys.view(1, -1), q_len, kv_len)
    bias_sel = _select(bias, 1, head_idx)
    score_sel = None if score is None else SelectedHeads(score, head_idx, num_heads)
    sinks_sel = None if sinks is None else sinks.index_select(0, head_idx)
    if backend == "triton":  # visited tiles only, normalised by the kernel's own lse
        from .kernels.triton import score_of_heads, triton_attention_weights  # imports triton

        probs = triton_attention_weights(
            q_sel,
            k_sel,
            mask_sel,
            bias=bias_sel,
            causal=causal,
            scale=resolved_scale,
            score=score_of_heads(score, head_idx),
            sinks=sinks_sel,
        )
        return probs.index_select(2, row_idx).to(q.dtype)
    dtype = stats_dtype(q.dtype)
    scores = grouped_scores(q_sel.index_select(2, row_idx), k_sel, resolved_scale, dtype)
    if score is not None:
        q_pos = row_idx + causal_shift(q_len, kv_len)
        scores = apply_score(score, scores, q_pos, keys, head_idx)
    if bias_sel is not None:
        scores = scores + _select(bias_sel, 2, row_idx).to(dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    if backend == "reference":
        return softmax_with_sinks(scores, sinks_sel)[0].to(q.dtype)
    _, lse = attention(
        q_sel,
        k_sel,
        k_sel,
        mask_sel,
        bias=bias_sel,
        causal=causal,
        scale=resolved_scale,
        backend="flash",
        return_lse=True,
        score=score_sel,
        sinks=sinks_sel,
    )
    lse = lse.index_select(2, row_idx)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, torch.inf), lse)
    return torch.exp(scores - lse.unsqueeze(-1)).to(q.dtype)


def _indices(name: str, value, size: int, device: torch.device) -> Tensor:
    """A 1-D int64 index tensor from None (all), a sequence or a tensor of ints."""
    if value is None:
        return torch.arange(size, device=device)
    idx = torch.as_tensor(value, device=device)
    if idx.numel() == 0 and not isinstance(value, Tensor):
        idx = idx.long()  # [] is a float tensor to torch: an empty selection of ints
    if idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool:
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {value!r}")
    if idx.numel() and (idx.min() < 0 or idx.max() >= size):
        raise ValueError(f"{name} must lie in [0, {size}), got {idx.tolist()}")
    return idx.long()


def _select(t: Tensor | None, dim: int, idx: Tensor) -> Tensor | None:
    """Index a (B, H, L, S)-broadcastable tensor along dim 1 (heads) or 2 (rows)."""
    if t is None:
        return None
    t = as_4d(t)
    return t if t.shape[dim] == 1 else t.index_select(dim, idx)


def attention_and_weights(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    score: ScoreFunction | list | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D_v), probs (B, H, L, S)) from one pass of the reference math.

    For modules that return weights (need_weights=True); probs are before dropout. A
    masked non-finite key or value changes nothing, as in attention().
    """
    validate.check_qkv(q, k, v)
    score = as_score(score)
    resolved_scale = _check_common(q, k, mask, bias, causal, scale, score=score, sinks=sinks)
    validate.check_dropout(dropout_p)
    seed = draw_seed() if dropout_p > 0 else None  # one draw: the clean pass drops alike
    call = dict(mask=mask, bias=bias, causal=causal, scale=resolved_scale, score=score)

    def one_pass(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        probs, _ = attention_probs(q, keys, **call, sinks=sinks)
        dropped = apply_dropout(probs, dropout_p, seed) if seed is not None else probs
        return probs_times_v(dropped, values).to(q.dtype), probs.to(q.dtype)

    out, probs = one_pass(k, v)
    if (mask is None and bias is None and not causal) or tracing():
        return out, probs  # every key allowed: a non-finite one reaches every row
    bad = bad_keys(k, v)
    if not bool(bad.any()):
        return out, probs
    clean_out, clean_probs = one_pass(zero_nonfinite(k), zero_nonfinite(v))
    reference = dict(call, dropout_p=0.0, return_lse=False, sinks=sinks)
    poisoned = attends_bad_key(get("reference"), q, k, v, bad, reference).unsqueeze(-1)
    out = torch.where(poisoned, out.detach(), clean_out)
    return out, torch.where(poisoned, probs.detach(), clean_probs)
