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

from ..kernels.triton.function import (
    LaunchCall,
    _no_keys,
    _prepare,
    launch_backward,
    launch_forward,
)
from .op_scores import rebuild_score
from .op_values import (
    OpInputs,
    OutputGrads,
    backward_outputs,
    define_attention_ops,
    rebuild_pattern,
)


def _launch_inputs(inputs: OpInputs, score_grad: bool = False):
    """(plan, scale, dropout, kernel score, slopes, table) of a call, as triton_attention
    makes them eagerly; with score_grad a plan whose backward gives the score tensors'
    gradients."""
    q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, score, score_tensors, _ = inputs
    score_fn = rebuild_score(score, score_tensors)
    mask = mask if mask is not None else rebuild_pattern(pattern)
    band = dropout_p == 0 and not score_grad
    tiles, scale, kernel, slopes, table = _prepare(
        q, k, v, mask, bias, causal, scale, None, score_fn, band=band
    )
    dropout = (dropout_p, int(seed)) if dropout_p > 0 else None
    return tiles, scale, dropout, kernel, slopes, table


def _forward(inputs: OpInputs) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D_v), lse (B, H, L)) of the Triton kernels."""
    q, k, v, sinks = inputs.q, inputs.k, inputs.v, inputs.sinks
    if q.shape[2] == 0 or k.shape[2] == 0:
        out, lse = _no_keys(q, v, sinks)
        return out, lse.contiguous()  # (an op's outputs are not views)
    tiles, scale, dropout, kernel, slopes, table = _launch_inputs(inputs)
    return launch_forward(
        LaunchCall(q, k, v, inputs.bias, tiles, scale, dropout, kernel, (slopes, table, sinks))
    )


def _backward(inputs: OpInputs, grads: OutputGrads) -> tuple:
    """(dq, dk, dv, dbias, dsinks, d score_tensors), as AttentionOps.backward_op."""
    q, k, v, _, bias, *_, score_tensors, sinks = inputs
    grad_out, grad_lse, out, lse, bias_grad, score_grad = grads
    dscore = [torch.zeros_like(t) for t in score_tensors] if score_grad else []
    if q.shape[2] == 0 or k.shape[2] == 0:
        dbias = torch.zeros_like(bias) if bias_grad else q.new_empty(0)
        dsinks = q.new_empty(0) if sinks is None else torch.zeros_like(sinks)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias, dsinks, dscore
    tiles, scale, dropout, kernel, slopes, table = _launch_inputs(inputs, score_grad)
    wanted = (
        sinks is not None,
        score_grad and slopes is not None,
        score_grad and table is not None,
    )
    call = LaunchCall(q, k, v, bias, tiles, scale, dropout, kernel, (slopes, table, sinks))
    dq, dk, dv, dbias, dsinks, dslopes, dtable = launch_backward(
        call, grad_out, grad_lse, out, lse, bias_grad, wanted
    )
    for i, t in enumerate(score_tensors if score_grad else ()):  # (in score_spec's order)
        found = dslopes if t is slopes else dtable if t is table else None
        if found is not None:
            dscore[i] = found
    return backward_outputs(q, dq, dk, dv, dbias, dsinks, dscore)


TRITON_OPS = define_attention_ops("triton_attention", _forward, _backward)
triton_attention_op = TRITON_OPS.op  # mhsa::triton_attention
triton_attention_backward_op = TRITON_OPS.backward_op  # mhsa::triton_attention_backward
traced_triton_attention = TRITON_OPS.traced_call
