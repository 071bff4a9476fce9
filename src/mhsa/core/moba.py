"""MoBA (Mixture of Block Attention): each query block attends its own block causally
plus the top-k earlier key blocks that its queries score highest.

Keys are cut into blocks of block_size; a block's routing key is the mean of its keys.
A query block (queries by position, bottom-right aligned) is scored by the mean of its
queries against every strictly earlier block's routing key, per head, and keeps the
top_k. The choice is data (masks.SelectedBlocks), so the flash engine's block plan
visits only the selected tiles (full, unmasked) and the own block (a causal triangle).

The route is per query block, not per token as in the MoBA paper's gate: that keeps
every selected tile full, at the price that a token's route also depends on the later
queries of its block (no gradient flows through the choice). (batch, head) pairs that
chose the same blocks share one engine call and its plan.

Over paged keys (a PagedStep, as mhsa.paged_attention takes it, or block_table= and
seq_lens= as mhsa.attention takes them) each sequence's keys are gathered from its pages
and routed and attended as the call over those keys would be: the same answers as a
contiguous cache that holds them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import validate
from .attention import attention, empty_result
from .checks import int_at_least, is_int
from .kernels.paged import gather_pages
from .masks.blocks import num_blocks
from .masks.causal import causal_shift, strictly_earlier
from .masks.selected import SelectedBlocks
from .paged_step import PagedStep


def _block_means(x: Tensor, block: Tensor, n: int) -> Tensor:
    """x (B, H, T, D) averaged per block index block (T,) -> (B, H, n, D); empty -> 0."""
    sums = x.new_zeros(*x.shape[:2], n, x.shape[-1]).index_add_(2, block, x)
    counts = torch.bincount(block, minlength=n).clamp(min=1).to(x.dtype)
    return sums / counts.view(-1, 1)


def moba_select(q: Tensor, k: Tensor, block_size: int, top_k: int) -> Tensor:
    """The blocks MoBA chooses: bool (B, H, n, n), n = ceil(S / block_size); [b, c] is
    True when query block b attends key block c < b. q (B, H, L, D), k (B, H_kv, S, D)."""
    validate.check_qkv(q, k, k)
    q_len, kv_len = q.shape[2], k.shape[2]
    n = _check_sizes(q_len, kv_len, block_size, top_k)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        q, k = q.detach().to(dtype), k.detach().to(dtype)
        k_block = torch.arange(kv_len, device=k.device) // block_size
        routing = _block_means(k, k_block, n)  # (B, H_kv, n, D)
        routing = routing.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        positions = torch.arange(q_len, device=q.device) + causal_shift(q_len, kv_len)
        q_block = positions // block_size
        scores = _block_means(q, q_block, n) @ routing.transpose(-1, -2)  # (B, H, n, n)
        earlier = strictly_earlier(n, q.device)
        scores = scores.masked_fill(~earlier, -torch.inf)
        top = scores.topk(min(top_k, n), dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
        has_queries = torch.bincount(q_block, minlength=n) > 0  # blocks without queries
        return chosen & earlier & has_queries.view(-1, 1)


def _check_sizes(q_len: int, kv_len: int, block_size: int, top_k: int) -> int:
    int_at_least("block_size", block_size, 1)
    n = num_blocks(kv_len, block_size)
    if not is_int(top_k) or not 1 <= top_k <= max(n, 1):
        raise ValueError(
            f"top_k must be an int in 1..{n} (the number of key blocks: S = {kv_len} in "
            f"blocks of {block_size}), got {top_k!r}"
        )
    if q_len > kv_len:
        raise ValueError(
            f"MoBA needs L <= S (queries aligned bottom-right), got L={q_len}, S={kv_len}"
        )
    return n


def moba_mask(q: Tensor, k: Tensor, block_size: int, top_k: int) -> Tensor:
    """The element mask MoBA attends with, bool (B, H, L, S), True = may attend: for
    checks and pictures (it is L x S; moba_attention never builds it)."""
    selected = moba_select(q, k, block_size, top_k)
    return SelectedBlocks(selected, block_size).dense(q.shape[2], k.shape[2], device=q.device)


def moba_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_size: int,
    top_k: int,
    *,
    scale: float | None = None,
    backend: str = "flash",
    return_lse: bool = False,
    block_table: Tensor | None = None,
    seq_lens: Tensor | Sequence[int] | None = None,
    step: PagedStep | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mixture of Block Attention. q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v),
    L <= S (queries aligned bottom-right, as causal).

    Each query block (block_size positions) attends its own block causally and the
    top_k strictly earlier key blocks whose mean key scores highest against the
    block's mean query (per head; fewer where fewer exist). top_k must be in 1..number
    of key blocks; top_k = that number is causal attention. backend: an mhsa backend
    that plans patterns ("flash" visits only the selected tiles). Returns (B, H, L, D_v)
    and, with return_lse, the logsumexp (B, H, L). Differentiable in q, k and v.

    block_table, seq_lens: paged keys, as mhsa.attention takes them (a PagedKVCache's
    pages): k and v are then pools (num_blocks, page_size, H_kv, D) and (..., D_v), q is
    (N, H, T, D), the T newest queries of N sequences, and sequence n holds seq_lens[n]
    keys (>= T) in the blocks block_table[n]. Each sequence is attended as the call
    over its own keys; top_k >= 1 is capped at each sequence's number of key blocks.
    step: the same pages as a PagedStep (a decoding step's, checked once for every
    layer: mhsa.paged_attention's), instead of block_table and seq_lens.
    """
    if block_table is not None or seq_lens is not None or step is not None:
        options = {"scale": scale, "backend": backend, "return_lse": return_lse}
        step = _paged_step(q, k, v, block_table, seq_lens, step)
        return _paged(q, k, v, step, block_size, top_k, **options)
    validate.check_qkv(q, k, v)
    validate.check_scale(scale)
    if 0 in (q.shape[0], q.shape[2], k.shape[2]):  # (no block to choose)
        int_at_least("block_size", block_size, 1)
        int_at_least("top_k", top_k, 1)
        return empty_result(q, k, v, None, return_lse)
    selected = moba_select(q, k, block_size, top_k)  # (B, H, n, n)
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len, n = k.shape[1], k.shape[2], selected.shape[-1]
    # one engine call per distinct selection, its (batch, head) pairs as its batch
    layouts, group = torch.unique(selected.view(-1, n * n), dim=0, return_inverse=True)
    order = torch.argsort(group.cpu(), stable=True)
    sizes = torch.bincount(group.cpu(), minlength=layouts.shape[0]).tolist()
    pair = torch.arange(batch * heads)
    kv_pair = (pair // heads) * kv_heads + (pair % heads) // (heads // kv_heads)
    q_flat = q.reshape(batch * heads, 1, q_len, head_dim)
    k_flat = k.reshape(batch * kv_heads, 1, kv_len, head_dim)
    v_flat = v.reshape(batch * kv_heads, 1, kv_len, v.shape[-1])
    outs, lses = [], []
    for layout, members in zip(layouts, order.split(sizes), strict=True):
        kv_members = kv_pair[members].to(q.device)
        members = members.to(q.device)
        pattern = SelectedBlocks(layout.view(n, n), block_size)
        out, lse = attention(
            q_flat[members],
            k_flat[kv_members],
            v_flat[kv_members],
            pattern,
            scale=scale,
            backend=backend,
            return_lse=True,
        )
        outs.append(out)
        lses.append(lse)
    back = torch.argsort(order).to(q.device)  # from group order to (batch, head) order
    out = torch.cat(outs)[back].view(batch, heads, q_len, v.shape[-1])
    if not return_lse:
        return out
    return out, torch.cat(lses)[back].view(batch, heads, q_len)


def _paged_step(q, k_pool, v_pool, block_table, seq_lens, step) -> PagedStep:
    """The step of a paged call, checked against q and the pools: `step`, or a one-off
    one from block_table and seq_lens."""
    if step is None:
        if block_table is None:
            raise ValueError("seq_lens goes with block_table (paged keys); pass both or neither")
        return PagedStep.for_call(q, k_pool, v_pool, block_table, seq_lens)
    if block_table is not None or seq_lens is not None:
        raise ValueError("pass a step or block_table and seq_lens, not both")
    if not isinstance(step, PagedStep):
        raise TypeError(f"step must be an mhsa.PagedStep, got {type(step).__name__}")
    step.check(q, k_pool, v_pool)
    return step


def _paged(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    step: PagedStep,
    block_size: int,
    top_k: int,
    **options,
) -> Tensor | tuple[Tensor, Tensor]:
    """moba_attention over paged keys (see its docstring): each sequence's keys and
    values gathered from its pages, then the contiguous call over them."""
    seq_lens, table = step.seq_lens, step.block_table
    int_at_least("block_size", block_size, 1)
    int_at_least("top_k", top_k, 1)
    page = k_pool.shape[1]
    outs, lses = [], []
    for n, length in enumerate(seq_lens):
        pages = table[n : n + 1, : math.ceil(length / page)]  # (1, pages)
        keys = gather_pages(k_pool, pages)[:, :, :length]  # (1, H_kv, length, D)
        values = gather_pages(v_pool, pages)[:, :, :length]
        chosen = min(top_k, max(num_blocks(length, block_size), 1))
        out = moba_attention(q[n : n + 1], keys, values, block_size, chosen, **options)
        out, lse = out if options["return_lse"] else (out, None)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros(*q.shape[:3], v_pool.shape[3])
    if not options["return_lse"]:
        return out
    lse = torch.cat(lses) if lses else q.new_zeros(q.shape[:3], dtype=torch.float32)
    return out, lse


__all__ = ["moba_attention", "moba_mask", "moba_select"]
