"""Exact tiled attention (FlashAttention-style) driven by a BlockPlan.

Forward: for each range of query rows, each key run of the plan is attended on its
own, giving a partial output and logsumexp; partials merge by their logsumexp (the
online softmax, float32 accumulators). Backward recomputes each run's probabilities
from q, k and the saved lse: only q, k, v, out and lse are kept, so memory is
O(L + S) per head. Empty tiles are never visited; full runs apply no mask.

Each run is computed by one of two segment kernels:
- fused: PyTorch's own CPU flash-attention kernel on the run (fast, float
  additive tile masks), for CPU calls without dropout and with D == D_v;
- unfused: matmuls and a softmax in torch (kernels.unfused), on any device, with
  dropout and any score function.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..checks import as_4d
from ..masks.causal import causal_allows, causal_shift
from ..scores import ScoreFunction
from .band import band_forward, interior_rows
from .dense import stats_dtype
from .merge import merge_partials
from .plan import BlockPlan
from .runs import add_keys, key_row_bias, run_keys, tile_bias
from .scored import add_sinks, sink_grad
from .unfused import RunGrads, UnfusedBackward, run_forward, unfused_backward

_FUSED_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def fused_available(q: Tensor, v: Tensor, dropout_p: float) -> bool:
    """Whether the fused CPU kernel can compute runs of this call."""
    return (
        _FUSED_FORWARD is not None
        and q.device.type == "cpu"
        and dropout_p == 0.0
        and q.shape[-1] == v.shape[-1]
    )


def _unit_last_stride(*tensors: Tensor) -> list[Tensor]:
    """The fused kernel misreads a tensor whose last dimension is strided (a (B, H, D, L)
    tensor transposed, say): such tensors are copied."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _flipped(attn: Tensor | None) -> Tensor | None:
    return None if attn is None else attn.flip(-2, -1)


def _fused_run(q_blk, k_run, v_run, attn, scale, triangle, masked) -> tuple[Tensor, Tensor]:
    """One run on the fused kernel; a triangle run in its causal mode, attn (the bias
    and score values, and the mask's -inf) added."""
    if triangle == "upper":  # c >= r is c' <= r' on reversed rows and keys
        out_r, lse_r = _FUSED_FORWARD(
            q_blk.flip(2),
            k_run.flip(2),
            v_run.flip(2),
            0.0,
            True,
            attn_mask=_flipped(attn),
            scale=scale,
        )
        out_r, lse_r = out_r.flip(2), lse_r.flip(-1)
    else:
        causal = triangle == "lower"
        out_r, lse_r = _FUSED_FORWARD(q_blk, k_run, v_run, 0.0, causal, attn_mask=attn, scale=scale)
    if masked and attn is not None:  # the kernel reports lse 0 for rows with no allowed key
        lse_r = lse_r.masked_fill(_dead_rows(attn, triangle, q_blk.shape[2]), -torch.inf)
    return out_r, lse_r


def _dead_rows(attn: Tensor, triangle: str | None, rows: int) -> Tensor:
    """The run's `rows` rows whose every key is -inf in attn (its rows, or one row for
    them all) among those its triangle (the kernel's causal mode, or that mode on
    reversed rows and keys) lets them see."""
    blocked = torch.isneginf(attn)
    if triangle is not None:  # (a row-broadcast attn: each row sees its own keys)
        blocked = blocked | ~_triangle_seen(rows, attn.shape[-1], triangle, attn.device)
    return blocked.all(dim=-1)


def _triangle_seen(rows: int, keys: int, triangle: str, device) -> Tensor:
    """(rows, keys) bool: what a triangle run's rows see in the kernel's causal mode
    (top-left: c <= r), or in that mode on reversed rows and keys ("upper")."""
    r = torch.arange(rows, device=device).view(-1, 1)
    c = torch.arange(keys, device=device).view(1, -1)
    if triangle == "lower":
        return causal_allows(r, c)
    return causal_allows(c - causal_shift(rows, keys), r)


def _fused_run_backward(go_blk, q_blk, k_run, v_run, out_blk, lse_blk, attn, scale, triangle):
    if triangle == "upper":
        grads = _FUSED_BACKWARD(
            go_blk.flip(2),
            q_blk.flip(2),
            k_run.flip(2),
            v_run.flip(2),
            out_blk.flip(2),
            lse_blk.flip(-1),
            0.0,
            True,
            attn_mask=_flipped(attn),
            scale=scale,
        )
        return tuple(g.flip(2) for g in grads)
    return _FUSED_BACKWARD(
        go_blk,
        q_blk,
        k_run,
        v_run,
        out_blk,
        lse_blk,
        0.0,
        triangle == "lower",
        attn_mask=attn,
        scale=scale,
    )


class FlashCall(NamedTuple):
    """One call of the engine: q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v),
    bias (broadcastable to (B, H, L, S)) or None, the block plan, scale; dropout (p, seed)
    or None; fused selects the fused CPU segment kernel (then a score function must be
    additive); score an mhsa.core.scores function or None; sinks (H,), logits of a key
    without a value, or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    bias: Tensor | None
    plan: BlockPlan
    scale: float
    dropout: tuple[float, int] | None = None
    fused: bool = False
    score: ScoreFunction | None = None
    sinks: Tensor | None = None


def flash_forward(call: FlashCall) -> tuple[Tensor, Tensor]:
    """out (B, H, L, D_v) in q's dtype and lse (B, H, L) in the statistics dtype."""
    out, lse = _forward_runs(call)
    return (out, lse) if call.sinks is None else add_sinks(out, lse, call.sinks)


def _forward_runs(call: FlashCall) -> tuple[Tensor, Tensor]:
    q, k, v, bias, plan, scale, dropout, fused, score, _ = call
    batch, num_heads, q_len, _ = q.shape
    dtype = stats_dtype(q.dtype)
    shift = causal_shift(plan.q_len, plan.kv_len)
    if fused:
        q, k, v = _unit_last_stride(q, k, v)
    band = _band_interior(plan, bias, dropout, fused) if score is None else None
    plan_rows = plan.rows
    if band is not None:
        first, end = band
        plan_rows = [rows for rows in plan.rows if rows.q1 <= first or rows.q0 >= end]
    # every row is written below when the band and the plan's rows cover them all (rows
    # without runs are zeroed there): then out need not be zero-filled first
    covered = (end - first if band else 0) + sum(rows.q1 - rows.q0 for rows in plan_rows)
    shape = (batch, num_heads, q_len, v.shape[-1])
    out = q.new_empty(shape) if covered == q_len else q.new_zeros(shape)
    lse = torch.full((batch, num_heads, q_len), -torch.inf, dtype=dtype, device=q.device)
    if band is not None:
        band_forward(q, k, v, *plan.band, scale, first, end, out, lse)
    for rows in plan_rows:
        q0, q1 = rows.q0, rows.q1
        q_blk = q[:, :, q0:q1]
        partials = []
        for run in rows.runs:
            cols, index, k_run, v_run = run_keys(k, v, run, plan)
            if fused:
                triangle = run.triangle
                attn, row_term = _fused_bias(
                    plan, bias, q0, q1, run, cols, q.dtype, score, (batch, num_heads)
                )
                # attn may hold -inf: the mask's, or a bias's
                masked = bias is not None or (not run.full and triangle is None)
                out_r, lse_r = _fused_run(q_blk, k_run, v_run, attn, scale, triangle, masked)
                if row_term is not None:
                    lse_r = lse_r + row_term
            else:
                attn = tile_bias(plan, bias, q0, q1, run, cols, dtype)
                out_r, lse_r = run_forward(
                    q_blk, k_run, v_run, attn, scale, dropout, q0, cols, score, shift, dtype
                )
            partials.append((out_r, lse_r))
        if not partials:  # no allowed key in these rows
            out[:, :, q0:q1] = 0
            continue
        if len(plan.rows) == 1 and q0 == 0 and q1 == q_len and len(partials) == 1:
            return out_r.to(q.dtype), lse_r.to(dtype)  # one run covers everything
        out_rows, lse_rows = merge_partials(partials)
        out[:, :, q0:q1] = out_rows
        lse[:, :, q0:q1] = lse_rows
    return out, lse


def _fused_bias(
    plan: BlockPlan,
    bias,
    q0: int,
    q1: int,
    run,
    cols: Tensor,
    dtype: torch.dtype,
    score,
    heads: tuple[int, int],
) -> tuple[Tensor | None, Tensor | None]:
    """(attn, row term) that the fused kernel adds to run's scores of rows q0..q1 for
    heads (batch, num_heads): a separable score function's key term with its row term
    (which enters the run's lse, runs.key_row_bias), else the tile's bias, mask and
    score function (runs.tile_bias) and None. In bfloat16 or float16, each row's
    largest value is first taken out into the row term: ALiBi's terms reach slope x L,
    where those dtypes' steps are 0.5 or more (errors of 0.3 once)."""
    exact = stats_dtype(dtype)
    split = key_row_bias(plan, bias, q0, q1, run, cols, exact, score, heads[1], run.triangle)
    if split:
        keys, rows = split
        if dtype == exact:
            return split
        top = keys.amax(dim=-1, keepdim=True)  # (all the run's keys precede its rows)
        return (keys - top).to(dtype), rows + top.squeeze(-1)
    attn = tile_bias(plan, bias, q0, q1, run, cols, exact, score, heads, run.triangle)
    if attn is None or dtype == exact:
        return attn, None
    seen = ~torch.isneginf(attn)
    if run.triangle is not None:  # (per row of the run, attn broadcast over them or not)
        seen = seen & _triangle_seen(q1 - q0, attn.shape[-1], run.triangle, attn.device)
    top = torch.where(seen, attn, -torch.inf).amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # (a dead row keeps its -inf)
    return (attn - top).to(dtype), top.squeeze(-1)


def _band_interior(plan: BlockPlan, bias, dropout, fused: bool) -> tuple[int, int] | None:
    """The rows (first, end) that the strided band call computes, or None."""
    if plan.band is None or not fused or bias is not None or dropout is not None:
        return None
    band = interior_rows(plan.q_len, plan.kv_len, *plan.band, align=plan.block_q)
    if band is None:
        return None
    # the interior is aligned to the plan's rows (not to BAND_ROWS) so that the plan's
    # other rows are exactly the edges; only merged rows could straddle it
    first, end = band
    if any(
        rows.q0 < end and rows.q1 > first and not (first <= rows.q0 and rows.q1 <= end)
        for rows in plan.rows
    ):
        return None
    return band


def flash_backward(
    call: FlashCall,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    out: Tensor,
    lse: Tensor,
    bias_grad: bool = False,
    score_params: tuple[Tensor, ...] = (),
) -> tuple:
    """Gradients (dq, dk, dv, dbias or None, dsinks or None, [d score_params]) of call
    given those of its out and lse, recomputing each run's tile; dbias when bias_grad,
    dsinks when sinks are given."""
    q, k, v, bias, plan, scale, dropout, fused, score, sinks = call
    dtype = stats_dtype(q.dtype)
    batch, num_heads = q.shape[:2]
    param_grads: list[Tensor | None] = [None] * len(score_params)
    if fused:  # (the fused backward reads any grad_out strides correctly)
        q, k, v, out = _unit_last_stride(q, k, v, out)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)
    bias4 = as_4d(bias)
    dbias = torch.zeros(bias4.shape, dtype=dtype, device=q.device) if bias_grad else None
    # rows with no allowed key: lse +inf makes every recomputed probability exactly 0
    lse_inv = torch.where(torch.isneginf(lse), torch.full_like(lse, torch.inf), lse)
    if not fused or sinks is not None:
        delta = (grad_out.to(dtype) * out.to(dtype)).sum(dim=-1)
        if grad_lse is not None:
            delta = delta - grad_lse.to(dtype)
    if not fused:
        grads = RunGrads(dq, dk, dv, dbias, param_grads)
        unfused = UnfusedBackward(
            grad_out,
            q,
            k,
            v,
            bias4,
            lse_inv,
            delta,
            plan,
            scale,
            dropout,
            score,
            score_params,
            grads,
        )
    for rows in plan.rows:
        q0, q1 = rows.q0, rows.q1
        q_blk, go_blk = q[:, :, q0:q1], grad_out[:, :, q0:q1]
        for run in rows.runs:
            if not fused:
                unfused_backward(unfused, run, q0, q1)
                continue
            cols, index, k_run, v_run = run_keys(k, v, run, plan)
            attn, row_term = _fused_bias(
                plan, bias4, q0, q1, run, cols, q.dtype, score, (batch, num_heads)
            )
            lse_blk = lse_inv[:, :, q0:q1]
            lse_blk = (lse_blk - row_term if row_term is not None else lse_blk).contiguous()
            dq_r, dk_r, dv_r = _fused_run_backward(
                go_blk, q_blk, k_run, v_run, out[:, :, q0:q1], lse_blk, attn, scale, run.triangle
            )
            dq[:, :, q0:q1] += dq_r
            add_keys(dk, run, index, dk_r)
            add_keys(dv, run, index, dv_r)
    grad_bias = None if dbias is None else dbias.view(bias.shape).to(bias.dtype)
    grad_sinks = None if sinks is None else sink_grad(sinks, lse, delta)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grad_bias, grad_sinks, param_grads)


class FlashAttention(torch.autograd.Function):
    """(q, k, v, bias, sinks, *score tensors) -> (out, lse); saves only the inputs, out
    and lse. The score function's tensors are inputs so that gradients reach them."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, plan, scale, dropout, fused, score, *score_params):
        out, lse = flash_forward(
            FlashCall(q, k, v, bias, plan, scale, dropout, fused, score, sinks)
        )
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.save_for_backward(q, k, v, bias, sinks, out, lse, *score_params)
        ctx.plan, ctx.scale, ctx.dropout, ctx.fused = plan, scale, dropout, fused
        ctx.score = score
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, sinks, out, lse, *saved_params = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        wanted = ctx.needs_input_grad[10:]
        params = tuple(p for p, want in zip(saved_params, wanted, strict=True) if want)
        # the fused kernel takes no lse gradient and returns no bias or score gradient
        fused = ctx.fused and grad_lse is None and not bias_grad and not params
        call = FlashCall(q, k, v, bias, ctx.plan, ctx.scale, ctx.dropout, fused, ctx.score, sinks)
        dq, dk, dv, dbias, dsinks, found = flash_backward(
            call, grad_out, grad_lse, out, lse, bias_grad, params
        )
        found = iter(found)
        param_grads = [next(found) if want else None for want in wanted]
        return (dq, dk, dv, dbias, dsinks, None, None, None, None, None, *param_grads)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: BlockPlan,
    *,
    bias: Tensor | None = None,
    scale: float,
    dropout: tuple[float, int] | None = None,
    fused: bool | None = None,
    score=None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Tiled exact attention over `plan`: (out (B, H, L, D_v), lse (B, H, L)).

    score: an mhsa.core.scores function applied to each tile's scaled scores (before the
    bias and the mask); sinks (H,): per-head logits of a key without a value.
    fused=None picks the fused CPU kernel where it applies; False forces the unfused kernel.
    """
    can_fuse = fused_available(q, v, dropout[0] if dropout else 0.0)
    can_fuse = can_fuse and (score is None or score.additive)
    if fused and not can_fuse:
        raise ValueError(
            "the fused kernel needs a CPU tensor, no dropout, D == D_v and no "
            "score function other than additive ones"
        )
    use_fused = can_fuse if fused is None else fused
    return flash_apply(FlashCall(q, k, v, bias, plan, scale, dropout, use_fused, score, sinks))


def flash_apply(call: FlashCall) -> tuple[Tensor, Tensor]:
    """The engine on call, differentiable in q, k, v, bias, sinks and the score
    function's tensors: (out (B, H, L, D_v), lse (B, H, L))."""
    q, k, v, bias, plan, scale, dropout, fused, score, sinks = call
    params = () if score is None else score.tensors()
    return FlashAttention.apply(q, k, v, bias, sinks, plan, scale, dropout, fused, score, *params)
