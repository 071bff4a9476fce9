"""The unfused segment kernel of the flash engine: one run (query rows x key run) on
materialised float tiles, by torch matmuls and a softmax, forward and backward, on
any device, with dropout and any score function.

Each tile is a scratch buffer, so the elementwise steps work on it in place (a score
tile becomes probabilities, then score gradients) rather than allocating a new tile
per step: fewer passes over memory, the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..masks.causal import causal_shift
from ..scores import ScoreFunction
from .dense import grouped_scores, probs_times_v
from .dropout import keep_mask
from .plan import BlockPlan
from .runs import add_bias_grad, run_keys, tile_bias
from .scored import score_grads, score_tile


def fold(t: Tensor, num_kv_heads: int) -> Tensor:
    """(B, H, rows, X) -> (B, H_kv, G * rows, X): query heads grouped by their kv head."""
    batch, num_heads, rows, width = t.shape
    return t.reshape(batch, num_kv_heads, num_heads // num_kv_heads * rows, width)


def _exp_rows_(scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """scores (B, H, rows, keys) -> (exp(scores - row max), in place; row sums (B, H,
    rows, 1), 1 on rows with no allowed key; lse (B, H, rows), -inf on those rows)."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = scores.sub_(row_max).exp_()
    total = exp.sum(dim=-1, keepdim=True)
    alive = total > 0
    safe_total = torch.where(alive, total, torch.ones_like(total))
    lse = torch.where(alive, row_max + torch.log(safe_total), -torch.inf)
    return exp, safe_total, lse.squeeze(-1)


def _drop_(probs: Tensor, dropout: tuple[float, int], q0: int, cols: Tensor) -> Tensor:
    """probs (B, H, rows, keys) of rows q0.. with the dropped entries zeroed and the rest
    scaled by 1/(1-p), in place."""
    p, seed = dropout
    keep = keep_mask(seed, *probs.shape[:2], q0, q0 + probs.shape[2], cols, p)
    return probs.mul_(keep).div_(1.0 - p)


def run_forward(q_blk, k_run, v_run, attn, scale, dropout, q0, cols, score, shift, dtype):
    """(out (B, H, rows, D_v), lse (B, H, rows)) in dtype of rows q0.. (q_blk) against one
    key run (keys cols); attn: an additive float tile or None; shift = S - L."""
    scores = grouped_scores(q_blk, k_run, scale, dtype)
    if score is not None:
        scores = score_tile(
            score, scores, *scores.shape[:2], q0 + shift, scores.shape[2], cols, in_place=True
        )
    if attn is not None:
        scores = scores.add_(attn)
    exp, total, lse = _exp_rows_(scores)
    if dropout is not None:  # dropping before normalising equals dropping after
        exp = _drop_(exp, dropout, q0, cols)
    return probs_times_v(exp, v_run).div_(total), lse


def run_backward(
    q_blk: Tensor,
    go_blk: Tensor,
    k_run: Tensor,
    v_run: Tensor,
    attn: Tensor | None,
    lse_rows: Tensor,
    delta_rows: Tensor,
    scale: float,
    dropout,
    q0: int,
    cols: Tensor,
    score,
    shift: int,
    params: tuple[Tensor, ...],
    param_grads: list,
    on_grad_scores: Callable[[Tensor], None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq (B, H, rows, D), dk, dv (B, H_kv, keys, D or D_v)) in lse's dtype of one run,
    recomputed from the rows' final lse (+inf on rows with no allowed key) and delta =
    rowsum(dO * O) - dlse (B, H, rows). Gradients of params are added to param_grads;
    on_grad_scores sees the gradient of the final scores (a bias's)."""
    dtype = lse_rows.dtype
    batch, num_heads, rows = q_blk.shape[:3]
    num_kv_heads = k_run.shape[1]
    raw = grouped_scores(q_blk, k_run, scale, dtype)
    # the score function's output is kept when its gradient is computed from it
    autograd = score is not None and (bool(params) or not score.grad_from_output)
    keep_output = score is not None and not score.additive
    modified = raw
    if score is not None:
        modified = score_tile(
            score, raw, batch, num_heads, q0 + shift, rows, cols, in_place=not autograd
        )
    if attn is not None:
        scores = torch.add(modified, attn) if keep_output else modified.add_(attn)
    else:
        scores = modified.clone() if keep_output else modified
    probs = scores.sub_(lse_rows.unsqueeze(-1)).exp_()
    go_f = fold(go_blk.to(dtype), num_kv_heads)
    grad_probs = (go_f @ v_run.to(dtype).transpose(-1, -2)).view(probs.shape)
    if dropout is not None:
        grad_probs = _drop_(grad_probs, dropout, q0, cols)
        dv = fold(_drop_(probs.clone(), dropout, q0, cols), num_kv_heads).transpose(-1, -2) @ go_f
    else:
        dv = fold(probs, num_kv_heads).transpose(-1, -2) @ go_f
    grad_scores = grad_probs.sub_(delta_rows.unsqueeze(-1)).mul_(probs)
    if on_grad_scores is not None:
        on_grad_scores(grad_scores)
    if score is not None:
        if autograd:
            grad_scores = score_grads(
                score, raw, q0 + shift, cols, grad_scores, params, param_grads
            )
        else:
            grad_scores = score.input_grad(modified, grad_scores)
    grad_scores_f = fold(grad_scores, num_kv_heads)
    dq = (grad_scores_f @ k_run.to(dtype)).view(batch, num_heads, rows, -1).mul_(scale)
    dk = (grad_scores_f.transpose(-1, -2) @ fold(q_blk.to(dtype), num_kv_heads)).mul_(scale)
    return dq, dk, dv


# the unfused backward's tiles: a run of a plan made for the fused kernel (which tiles
# internally) is cut into pieces of at most this many rows and keys
UNFUSED_ROWS, UNFUSED_KEYS = 256, 2048


class RunGrads(NamedTuple):
    """The float accumulators the runs' gradients are added to: dq (B, H, L, D), dk,
    dv (B, H_kv, S, D or D_v), dbias (bias's shape as 4-d) or None, and the score
    function's param grads (a list, None where none arrived yet)."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    dbias: Tensor | None
    param_grads: list


class UnfusedBackward(NamedTuple):
    """What every run's unfused backward of one call reads, built once per call: grad_out,
    q, k, v, the bias as 4-d (or None), the final lse (+inf on rows with no allowed key)
    and delta = rowsum(dO * O) - dlse (B, H, L), the call's plan, scale, dropout (p,
    seed) or None, score function, its params, and the accumulators."""

    grad_out: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    bias4: Tensor | None
    lse_inv: Tensor
    delta: Tensor
    plan: BlockPlan
    scale: float
    dropout: tuple[float, int] | None
    score: ScoreFunction | None
    params: tuple[Tensor, ...]
    grads: RunGrads


def unfused_backward(call: UnfusedBackward, run, q0: int, q1: int) -> None:
    """Add the gradients of run for rows q0..q1 to call.grads, piece by piece."""
    grad_out, q, k, v, bias4, lse_inv, delta, plan, scale, dropout, score, params, grads = call
    dq, dk, dv, dbias, param_grads = grads
    dtype, shift = dq.dtype, causal_shift(plan.q_len, plan.kv_len)
    cols_all, index, k_run, v_run = run_keys(k, v, run, plan)
    for r0 in range(q0, q1, UNFUSED_ROWS):
        r1 = min(q1, r0 + UNFUSED_ROWS)
        for c0 in range(0, len(cols_all), UNFUSED_KEYS):
            c1 = min(len(cols_all), c0 + UNFUSED_KEYS)
            cols = cols_all[c0:c1]
            attn = tile_bias(plan, bias4, r0, r1, run, cols, dtype)
            on_grad = None
            if dbias is not None:  # the bias is added after the score function

                def on_grad(grad, r0=r0, r1=r1, cols=cols):
                    add_bias_grad(dbias, r0, r1, cols, grad)

            dq_r, dk_r, dv_r = run_backward(
                q[:, :, r0:r1],
                grad_out[:, :, r0:r1],
                k_run[:, :, c0:c1],
                v_run[:, :, c0:c1],
                attn,
                lse_inv[:, :, r0:r1],
                delta[:, :, r0:r1],
                scale,
                dropout,
                r0,
                cols,
                score,
                shift,
                params,
                param_grads,
                on_grad,
            )
            dq[:, :, r0:r1] += dq_r
            if index is None:
                dk[:, :, run.k0 + c0 : run.k0 + c1] += dk_r
                dv[:, :, run.k0 + c0 : run.k0 + c1] += dv_r
            else:
                dk.index_add_(2, cols, dk_r)
                dv.index_add_(2, cols, dv_r)
