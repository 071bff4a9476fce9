"""One run of a block plan as tensors, for the flash engine's segment kernels: its keys
and values, the additive float tile it reads (a bias, an additive score function's
values, the mask's -inf), the separable form of that tile, and the scatter of
gradients back to the run's keys and to the bias."""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import as_4d
from ..masks.causal import causal_allows, causal_shift
from .dense import stats_dtype
from .plan import BlockPlan, Run
from .scored import score_tile


def run_keys(k: Tensor, v: Tensor, run: Run, plan: BlockPlan):
    """(key indices, gather index or None when contiguous, k_run, v_run) of one run:
    the keys and values are views for contiguous runs, gathered copies otherwise."""
    index = run.key_index(plan.block_k, k.device)
    if index is None:
        cols = torch.arange(run.k0, run.k1, device=k.device)
        return cols, None, k[:, :, run.k0 : run.k1], v[:, :, run.k0 : run.k1]
    return index, index, k.index_select(2, index), v.index_select(2, index)


def add_keys(acc: Tensor, run: Run, index: Tensor | None, value: Tensor) -> None:
    """acc[:, :, run's keys] += value."""
    if index is None:
        acc[:, :, run.k0 : run.k1] += value
    else:
        acc.index_add_(2, index, value.to(acc.dtype))


def _tile_rows(t: Tensor, q0: int, q1: int, cols: Tensor) -> Tensor:
    """Rows q0:q1 and key columns cols of a (..., L or 1, S or 1) tensor."""
    rows = t if t.shape[-2] == 1 else t[..., q0:q1, :]
    return rows if rows.shape[-1] == 1 else rows.index_select(-1, cols)


def tile_bias(
    plan: BlockPlan,
    bias: Tensor | None,
    q0: int,
    q1: int,
    run: Run,
    cols: Tensor,
    dtype: torch.dtype,
    score=None,
    shape: tuple = (),
    triangle: str | None = None,
) -> Tensor | None:
    """Additive tile (1 or B, 1 or H, rows, keys): the bias (and an additive score
    function's values, given the call's (B, H)), -inf where the mask forbids, unless
    the run is a triangle that the kernel computes in its causal mode."""
    attn = None if bias is None else _tile_rows(bias, q0, q1, cols).to(dtype)
    if score is not None:
        q_pos = q0 + causal_shift(plan.q_len, plan.kv_len)
        values = score_tile(score, None, *shape, q_pos, q1 - q0, cols)
        attn = values.to(dtype) if attn is None else attn + values.to(dtype)
    if not run.full and triangle is None:
        allowed = plan.tile(q0, q1, cols)
        base = torch.zeros((), dtype=dtype, device=cols.device) if attn is None else attn
        minus_inf = torch.tensor(-torch.inf, dtype=dtype, device=cols.device)
        attn = torch.where(allowed, base, minus_inf)
    if attn is not None and attn.dim() < 4:
        attn = as_4d(attn)
    return attn


def key_row_bias(
    plan: BlockPlan,
    bias,
    q0: int,
    q1: int,
    run: Run,
    cols: Tensor,
    dtype: torch.dtype,
    score,
    heads: int,
    triangle: str | None,
):
    """(key term (1, H, 1, keys), row term (1, H, rows)) when the run's scores change by
    a separable score function alone and all its keys precede its rows; else None. The
    fused kernel then reads one row of values for the whole tile, and the row term goes
    into the run's lse."""
    shift = causal_shift(plan.q_len, plan.kv_len)
    if (
        score is None
        or not score.separable
        or bias is not None
        or not run.full
        or triangle is not None
        or not causal_allows(q0 + shift, run.k1 - 1)
    ):
        return None
    q_pos = torch.arange(q0 + shift, q1 + shift, device=cols.device)
    rows, keys = score.split_left(torch.arange(heads, device=cols.device), q_pos, cols)
    return keys.to(dtype), rows.squeeze(-1).to(stats_dtype(dtype))


def _reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a (B, H, rows, keys) gradient over the dims where the target has size 1."""
    dims = [i for i, size in enumerate(shape) if size == 1 and grad.shape[i] != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def add_bias_grad(dbias: Tensor, q0: int, q1: int, cols: Tensor, grad_scores: Tensor) -> None:
    """dbias[..., q0:q1, cols] += grad_scores, summed over dims where dbias has size 1."""
    grad = _reduce_to(grad_scores, dbias.shape[:2] + (q1 - q0, len(cols)))
    grad = grad.sum(dim=-2, keepdim=True) if dbias.shape[-2] == 1 else grad
    grad = grad.sum(dim=-1, keepdim=True) if dbias.shape[-1] == 1 else grad
    rows = dbias if dbias.shape[-2] == 1 else dbias[..., q0:q1, :]
    if dbias.shape[-1] == 1:
        rows += grad
    else:
        rows.index_add_(-1, cols, grad)
