"""Our Triton kernels as torch.library custom ops, for traced graphs: one
`mhsa::triton_attention` node per attention call and one
`mhsa::triton_attention_backward`, with the same arguments as the flash ops
(backends.flash_op): patterns by repr, score functions by text and tensors
(backends.op_scores). The tile lists are built inside the op when it runs, so masks
and lengths neither break nor specialise the graph. Importing this module imports
triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.triton.function import _backward, _forward, _no_keys, _prepare
from ..kernels.triton.scores import kernel_score
from ..scores import ScoreFunction
from .op_scores import rebuild_score
from .op_values import backward_outputs, rebuild_pattern, register_attention_op, traced_call


def _launch_inputs(
    q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, score, score_tensors
):
    """(tiles, scale, dropout, kernel score, slopes, table) of a call, as triton_attention
    makes them eagerly."""
    score_fn = rebuild_score(score, score_tensors)
    kernel, slopes, table = kernel_score(score_fn)
    mask = mask if mask is not None else rebuild_pattern(pattern)
    tiles, scale = _prepare(q, k, v, mask, bias, causal, scale, None, score_fn)
    dropout = (dropout_p, int(seed)) if dropout_p > 0 else None
    return tiles, scale, dropout, kernel, slopes, table


@torch.library.custom_op("mhsa::triton_attention", mutates_args=())
def triton_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    pattern: str,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: Tensor,
    score: str,
    score_tensors: list[Tensor],
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D_v), lse (B, H, L)) of the Triton kernels; arguments as
    mhsa::flash_attention's."""
    if q.shape[2] == 0 or k.shape[2] == 0:
        out, lse = _no_keys(q, v, sinks)
        return out, lse.contiguous()  # (an op's outputs are not views)
    tiles, scale, dropout, kernel, slopes, table = _launch_inputs(
        q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, score, score_tensors
    )
    return _forward(q, k, v, bias, tiles, scale, dropout, kernel, (slopes, table, sinks))


@torch.library.custom_op("mhsa::triton_attention_backward", mutates_args=())
def triton_attention_backward_op(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    out: Tensor,
    lse: Tensor,
    pattern: str,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: Tensor,
    score: str,
    score_tensors: list[Tensor],
    sinks: Tensor | None,
    bias_grad: bool,
    score_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, dbias, dsinks, d score_tensors), as mhsa::flash_attention_backward."""
    dscore = [torch.zeros_like(t) for t in score_tensors] if score_grad else []
    if q.shape[2] == 0 or k.shape[2] == 0:
        dbias = torch.zeros_like(bias) if bias_grad else q.new_empty(0)
        dsinks = q.new_empty(0) if sinks is None else torch.zeros_like(sinks)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias, dsinks, dscore
    tiles, scale, dropout, kernel, slopes, table = _launch_inputs(
        q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, score, score_tensors
    )
    wanted = (
        sinks is not None,
        score_grad and slopes is not None,
        score_grad and table is not None,
    )
    dq, dk, dv, dbias, dsinks, dslopes, dtable = _backward(
        grad_out,
        grad_lse,
        q,
        k,
        v,
        bias,
        out,
        lse,
        tiles,
        scale,
        dropout,
        bias_grad,
        kernel,
        (slopes, table, sinks),
        wanted,
    )
    for i, t in enumerate(score_tensors if score_grad else ()):  # (in score_spec's order)
        found = dslopes if t is slopes else dtable if t is table else None
        if found is not None:
            dscore[i] = found
    return backward_outputs(q, dq, dk, dv, dbias, dsinks, dscore)


register_attention_op(triton_attention_op, triton_attention_backward_op)


def traced_triton_attention(
    q,
    k,
    v,
    mask,
    bias,
    causal: bool,
    scale: float,
    dropout_p: float,
    score: ScoreFunction | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The op's call for a traced graph (op_values.traced_call)."""
    return traced_call(
        triton_attention_op, q, k, v, mask, bias, causal, scale, dropout_p, score, sinks
    )
