"""attention() over paged keys (block_table=, seq_lens=): validate, then dispatch to the
chosen backend's forward_paged (the layout and the math: mhsa.core.kernels.paged).

Every layer of a decoding step makes the same call but for its own q and pools (same
shapes, same table, same lengths), so the checked plan of the last call is kept and a
call that matches it skips the checks (about 60 Python calls a layer).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from . import validate
from .backends import AttentionSpec, select
from .kernels.dense import stats_dtype
from .scores import as_score, kinds


class _Plan(NamedTuple):
    """A checked paged call: what forward_paged takes besides q and the pools."""

    spec: AttentionSpec
    seq_lens: list[int]
    table: Tensor
    window: int | None
    scale: float


class _LastPlan:
    """The last plain call's key (shapes, dtypes, devices, lengths, options), its table
    (a weak reference: another table object is another call) and its plan. A table
    changed in place has a new _version; an inference tensor has none, which is why
    validate's table check keeps the same rule (see validate._LastTable)."""

    key: tuple = ()
    table: weakref.ref | None = None
    plan: _Plan | None = None


def paged_attention(
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
    """attention() over paged keys: q (N, H, T, D), pools (num_blocks, block_size, H_kv,
    D) / (..., D_v) -> (N, H, T, D_v); see mhsa.attention's block_table and seq_lens."""
    plain = (
        mask is None
        and score is None
        and bias is None
        and sinks is None
        and not dropout_p
        and not return_lse
        and not torch.is_grad_enabled()
        and isinstance(seq_lens, list)
        and isinstance(block_table, Tensor)
        and isinstance(q, Tensor)
        and isinstance(k_pool, Tensor)
        and isinstance(v_pool, Tensor)
    )
    key = _key(q, k_pool, v_pool, block_table, seq_lens, causal, scale, backend) if plain else ()
    last = _LastPlan.table() if _LastPlan.table is not None else None
    if plain and last is block_table and _LastPlan.key == key:
        plan = _LastPlan.plan
    else:
        options = (bias, causal, scale, dropout_p, backend, return_lse, score, sinks)
        plan = _checked(q, k_pool, v_pool, mask, block_table, seq_lens, *options)
        if plain and not torch.compiler.is_compiling():
            _LastPlan.key, _LastPlan.table, _LastPlan.plan = key, weakref.ref(block_table), plan
    chosen = select(plan.spec, backend)
    batch, num_heads, q_len, _ = q.shape
    if batch == 0 or q_len == 0:
        return q.new_zeros(batch, num_heads, q_len, v_pool.shape[3])
    return chosen.forward_paged(
        q,
        k_pool,
        v_pool,
        block_table=plan.table,
        seq_lens=plan.seq_lens,
        scale=plan.scale,
        score=as_score(score),
        window=plan.window,
    )


def _key(q, k_pool, v_pool, block_table, seq_lens, causal, scale, backend) -> tuple:
    """What a plain call's checks depend on."""
    table_version = None if block_table.is_inference() else block_table._version
    return (
        q.shape,
        q.dtype,
        q.device,
        k_pool.shape,
        k_pool.dtype,
        k_pool.device,
        v_pool.shape,
        v_pool.dtype,
        v_pool.device,
        block_table.shape,
        block_table.dtype,
        block_table.device,
        table_version,
        tuple(seq_lens),
        causal,
        scale,
        backend,
    )


def _checked(q, k_pool, v_pool, mask, block_table, seq_lens, *options) -> _Plan:
    """Every check of a paged call; its plan."""
    bias, causal, scale, dropout_p, backend, return_lse, score, sinks = options
    if block_table is None:
        raise ValueError("seq_lens goes with block_table (paged keys); pass both or neither")
    seq_lens, table = validate.check_paged(q, k_pool, v_pool, block_table, seq_lens)
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
    validate.check_causal(causal)
    window = validate.paged_window(mask, causal, q.shape[2])
    validate.check_scale(scale)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    score = as_score(score)
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
        kv_len=max(seq_lens, default=0),
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
    select(spec, backend)  # a backend that cannot serve the call raises here
    return _Plan(spec, seq_lens, table, window, validate.resolved_scale(q, scale))
