"""paged_attention(q, k_pool, v_pool, step): each layer's attention over paged keys,
with its own queries and pools, through the step's PagedStep (its block table and
lengths, checked once: mhsa.core.paged_step). The layout and the math:
mhsa.core.kernels.paged.

Every layer of a step makes the same call but for its q and pools, so each kind of call
(its shapes, window, scale, backend) is planned once per step: the checks, the backend's
choice and what the backend prepares (flash: its fused engine's positions, tiles and
masks) are made at the first layer's call and kept in the step, which the other layers
are handed, as vLLM hands its attention metadata to every layer. Nothing is remembered
between steps. mhsa.attention(..., block_table=, seq_lens=) makes a one-off step per
call (attention_over_pages).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import validate
from .backends import AttentionSpec, Backend, select
from .backends.registry import forced
from .kernels.dense import stats_dtype
from .kernels.paged import PagedCall
from .masks import Pattern
from .paged_step import PagedStep, check_pools
from .scores import ScoreFunction, as_score, kinds


class _Plan(NamedTuple):
    """A checked kind of call of a step: its backend, window, resolved scale, and what
    the backend prepared for it (prepare_paged)."""

    backend: Backend
    window: int | None
    scale: float
    prepared: object | None


def _plan(step: PagedStep, q, k_pool, v_pool, window, scale, backend, score) -> _Plan:
    """The plan of a call of the step (q and the pools as paged_attention takes them;
    window from validate.paged_window): the step's plan of its kind, made and kept at
    its first call (step.plans), or made for this call alone with a score function."""
    if score is not None:  # its tensors are the layer's own: checked each call
        return _planned(step, q, k_pool, v_pool, window, scale, backend, score)
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k_pool.requires_grad or v_pool.requires_grad
    )
    key = (
        q.shape,
        q.dtype,
        q.device,
        k_pool.shape,
        k_pool.dtype,
        k_pool.device,
        v_pool.shape,
        v_pool.dtype,
        v_pool.device,
        window,
        scale,
        type(scale),  # (True == 1, and check_scale refuses a bool)
        backend,
        forced(),
        needs_grad,
    )
    try:
        plan = step.plans.get(key)
    except TypeError:  # an unhashable scale or backend: the checks name it
        return _planned(step, q, k_pool, v_pool, window, scale, backend, None)
    if plan is None:
        plan = _planned(step, q, k_pool, v_pool, window, scale, backend, None)
        if not torch.compiler.is_compiling():
            step.plans[key] = plan
    return plan


def _planned(step: PagedStep, q, k_pool, v_pool, window, scale, backend, score) -> _Plan:
    """Every check of a call against the step; its plan."""
    step.check(q, k_pool, v_pool)
    validate.check_scale(scale)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if score is not None:
        score.check(q.shape[1], q.device, stats_dtype(q.dtype))
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k_pool, v_pool, *(score.tensors() if score else ()))
    )
    batch, num_heads, q_len, head_dim = q.shape
    spec = AttentionSpec(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=k_pool.shape[2],
        q_len=q_len,
        kv_len=max(step.seq_lens, default=0),
        head_dim=head_dim,
        value_dim=v_pool.shape[3],
        dtype=q.dtype,
        device=q.device,
        has_mask=window is not None,
        has_bias=False,
        causal=True,
        dropout_p=0.0,
        return_lse=False,
        has_score=score is not None,
        score_kinds=kinds(score),
        paged=True,
        needs_grad=needs_grad,
    )
    chosen = select(spec, backend)  # a backend that cannot serve the call raises here
    scale = validate.resolved_scale(q, scale)
    prepared = None
    if batch and q_len:
        call = PagedCall(q, k_pool, v_pool, step.block_table, step.seq_lens, scale, score, window)
        prepared = chosen.prepare_paged(call)
    return _Plan(chosen, window, scale, prepared)


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    step: PagedStep,
    mask: Pattern | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    score: ScoreFunction | list | None = None,
) -> Tensor:
    """Attention of N sequences' new queries over their keys in a pool of blocks (a
    PagedKVCache's pages; flash-attn's flash_attn_with_kvcache(block_table=)).

    Args:
        q: (N, H, T, D), the T new queries of each sequence.
        k_pool: (num_blocks, block_size, H_kv, D) keys; H % H_kv == 0 (grouped-query).
        v_pool: (num_blocks, block_size, H_kv, D_v) values.
        step: the PagedStep of this decoding step (its block table and lengths, checked
            once): every layer's call of the step takes the same one.
        mask: None, or SlidingWindow(left, 0): each query also sees only the keys at
            most `left` positions before it.
        causal: attention is causal per sequence, aligned bottom-right: query t of
            sequence n sits at position seq_lens[n] - T + t and sees the keys up to it
            (a query with no key gets 0). False is allowed for one query (T = 1), which
            sees every key either way.
        scale: multiplies q k^T; defaults to 1 / sqrt(D).
        backend: "auto" or a backend that serves paged keys (flash: inference only;
            triton: the Triton paged kernel, inference only, which `auto` takes on
            CUDA; reference: differentiable; `mhsa info` says which do).
        score: an mhsa.core.scores function (or a list), at each sequence's own
            positions.

    Returns:
        (N, H, T, D_v) in q's dtype.
    """
    if not isinstance(step, PagedStep):
        raise TypeError(
            f"step must be an mhsa.PagedStep (the block table and lengths of the step: "
            f"PagedStep(block_table, seq_lens, num_blocks=, block_size=)), got "
            f"{type(step).__name__}"
        )
    validate.check_causal(causal)
    tensors = isinstance(k_pool, Tensor) and isinstance(v_pool, Tensor)
    if not (tensors and isinstance(q, Tensor) and q.dim() == 4):
        check_pools(q, k_pool, v_pool)  # (raises, naming the argument)
    window = validate.paged_window(mask, causal, q.shape[2])
    if score is not None:
        score = as_score(score)
    plan = _plan(step, q, k_pool, v_pool, window, scale, backend, score)
    batch, num_heads, q_len, _ = q.shape
    if batch == 0 or q_len == 0:
        return q.new_zeros(batch, num_heads, q_len, v_pool.shape[3])
    call = PagedCall(q, k_pool, v_pool, step.block_table, step.seq_lens, plan.scale, score, window)
    return plan.backend.forward_paged(call, plan.prepared)


def attention_over_pages(
    q,
    k_pool,
    v_pool,
    mask,
    block_table,
    seq_lens,
    *,
    bias,
    causal,
    scale,
    dropout_p,
    backend,
    return_lse,
    score,
    sinks,
) -> Tensor:
    """mhsa.attention(..., block_table=, seq_lens=): a one-off PagedStep, then
    paged_attention. q (N, H, T, D), pools (num_blocks, block_size, H_kv, D) / (...,
    D_v) -> (N, H, T, D_v)."""
    if block_table is None:
        raise ValueError("seq_lens goes with block_table (paged keys); pass both or neither")
    step = PagedStep.for_call(q, k_pool, v_pool, block_table, seq_lens)
    if bias is not None or dropout_p or return_lse or sinks is not None:
        unserved = {
            "bias": bias is not None,
            "dropout_p": bool(dropout_p),
            "return_lse": return_lse,
            "sinks": sinks is not None,
        }
        names = ", ".join(name for name, given in unserved.items() if given)
        raise ValueError(
            f"attention over paged keys (block_table=) takes no bias, dropout_p, "
            f"return_lse or sinks; got {names}"
        )
    options = {"causal": causal, "scale": scale, "backend": backend, "score": score}
    return paged_attention(q, k_pool, v_pool, step, mask, **options)
