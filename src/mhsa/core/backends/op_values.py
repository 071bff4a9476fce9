"""What the custom ops (flash_op, triton_op) share: masks as values, the dropout seed,
the traced call, and the fake implementations and autograd registration.

A pattern built from plain values reaches an op as its repr (Pattern.plain_values),
rebuilt inside it; equal patterns give equal texts, so a traced graph never recompiles
for the same one. Score functions reach it as texts and tensors (backends.op_scores).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import masks
from ..kernels.dense import stats_dtype
from ..masks import Pattern
from ..scores import ScoreFunction
from .op_scores import score_spec

_PATTERN_CLASSES = {
    name: getattr(masks, name) for name in masks.__all__ if isinstance(getattr(masks, name), type)
}
_REBUILT: dict[str, Pattern] = {}


def rebuild_pattern(text: str) -> Pattern | None:
    """The pattern whose repr is text ("" for none), built once per text."""
    if not text:
        return None
    if text not in _REBUILT:
        _REBUILT[text] = eval(text, {"__builtins__": {}}, _PATTERN_CLASSES)  # noqa: S307
    return _REBUILT[text]


def traced_mask(mask, q_len: int, kv_len: int, device) -> tuple[str, Tensor | None]:
    """(pattern text, bool mask tensor) for an op: a pattern of plain values by repr,
    one that holds tensors made dense."""
    if not isinstance(mask, Pattern):
        return "", mask
    if mask.plain_values:
        return repr(mask), None
    return "", mask.dense(q_len, kv_len, device)


def traced_seed(dropout_p: float) -> Tensor:
    """The dropout seed as an int64 scalar tensor, drawn only with dropout (as eager)."""
    if dropout_p > 0:
        return torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    return torch.zeros((), dtype=torch.int64)


def traced_call(
    op,
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
    """op's call for a traced graph, from a backend's forward arguments: patterns by
    repr, those holding tensors dense, score functions by text and tensors."""
    pattern, mask = traced_mask(mask, q.shape[2], k.shape[2], q.device)
    text, tensors = score_spec(score)
    return op(
        q,
        k,
        v,
        mask,
        bias,
        pattern,
        causal,
        scale,
        dropout_p,
        traced_seed(dropout_p),
        text,
        tensors,
        sinks,
    )


def register_attention_op(op, backward_op) -> None:
    """The fake (shape-only) implementations of an attention op and its backward op,
    and backward_op as op's gradient. The op takes
    (q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, score, score_tensors,
    sinks) -> (out, lse) and a backward op taking (grad_out, grad_lse, q, k, v, mask,
    bias, out, lse, pattern, causal, scale, dropout_p, seed, score, score_tensors, sinks,
    bias_grad, score_grad) -> (dq, dk, dv, dbias, dsinks, d score_tensors)."""

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, score, tensors, sinks = inputs
        ctx.save_for_backward(q, k, v, mask, bias, output[0], output[1], seed, sinks, *tensors)
        ctx.constants = (pattern, causal, scale, dropout_p)
        ctx.score = score

    def backward(ctx, grad_out, grad_lse):
        q, k, v, mask, bias, out, lse, seed, sinks, *tensors = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        wanted = ctx.needs_input_grad[11]  # a list input gets one flag per tensor
        score_grad = any(wanted) if isinstance(wanted, list | tuple) else bool(wanted)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dbias, dsinks, dscore = backward_op(
            grad_out,
            grad_lse,
            q,
            k,
            v,
            mask,
            bias,
            out,
            lse,
            *ctx.constants,
            seed,
            ctx.score,
            tensors,
            sinks,
            bias_grad,
            score_grad,
        )
        return (
            dq,
            dk,
            dv,
            None,
            dbias if bias_grad else None,
            None,
            None,
            None,
            None,
            None,
            None,
            dscore if score_grad else [None] * len(tensors),
            dsinks if sinks is not None else None,
        )

    op.register_autograd(backward, setup_context=setup_context)
    op.register_fake(_fake_forward)
    backward_op.register_fake(_fake_backward)


def backward_outputs(
    q: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dbias: Tensor | None,
    dsinks: Tensor | None,
    dscore: list[Tensor],
) -> tuple:
    """A backward op's (dq, dk, dv, dbias, dsinks, dscore), contiguous; an op returns no
    None, so an absent dbias or dsinks is an empty tensor."""
    dbias = q.new_empty(0) if dbias is None else dbias.contiguous()
    dsinks = q.new_empty(0) if dsinks is None else dsinks.contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias, dsinks, dscore


def _fake_forward(
    q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, score, score_tensors, sinks
):
    batch, heads, q_len, _ = q.shape
    out = q.new_empty(batch, heads, q_len, v.shape[-1])
    return out, q.new_empty(batch, heads, q_len, dtype=stats_dtype(q.dtype))


def _fake_backward(
    grad_out,
    grad_lse,
    q,
    k,
    v,
    mask,
    bias,
    out,
    lse,
    pattern,
    causal,
    scale,
    dropout_p,
    seed,
    score,
    score_tensors,
    sinks,
    bias_grad,
    score_grad,
):
    # contiguous, as the real ops' (empty_like would copy q's strides, and a graph
    # traced on those would misread the real gradients)
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    dscore = [t.new_empty(t.shape) for t in score_tensors] if score_grad else []
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    return dq, dk, dv, dbias, dsinks, dscore
