"""What the custom ops (flash_op, triton_op) share: their schemas, written once
(define_attention_ops makes an engine's pair of ops from two functions of OpInputs),
masks as values, the dropout seed, the traced call, and the fake implementations and
autograd registration.

A pattern built from plain values reaches an op as its repr (Pattern.plain_values),
rebuilt inside it; equal patterns give equal texts, so a traced graph never recompiles
for the same one. Score functions reach it as texts and tensors (backends.op_scores).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

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


class OpInputs(NamedTuple):
    """An attention op's inputs, in FORWARD_SCHEMA's order: q (B, H, L, D), k, v;
    a bool mask tensor or a pattern's repr; seed an int64 scalar; a score function's
    text and the tensors it reads; sinks (H,) or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    bias: Tensor | None
    pattern: str
    causal: bool
    scale: float
    dropout_p: float
    seed: Tensor
    score: str
    score_tensors: list[Tensor]
    sinks: Tensor | None


class OutputGrads(NamedTuple):
    """What a backward op takes besides the inputs: the forward's outputs, their
    gradients (grad_lse None when lse is unused), and whether dbias and d score_tensors
    are wanted."""

    grad_out: Tensor
    grad_lse: Tensor | None
    out: Tensor
    lse: Tensor
    bias_grad: bool
    score_grad: bool


# the ops' schemas; the backward op takes (grad_out, grad_lse, q, k, v, mask, bias, out,
# lse, the other inputs, bias_grad, score_grad)
_TENSORS = "Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias"
_CONSTANTS = (
    "str pattern, bool causal, float scale, float dropout_p, Tensor seed, str score, "
    "Tensor[] score_tensors, Tensor? sinks"
)
FORWARD_SCHEMA = f"({_TENSORS}, {_CONSTANTS}) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (
    f"(Tensor grad_out, Tensor? grad_lse, {_TENSORS}, Tensor out, Tensor lse, {_CONSTANTS}, "
    "bool bias_grad, bool score_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])"
)


def _join_backward_args(inputs: OpInputs, grads: OutputGrads) -> tuple:
    """A backward op's arguments, in BACKWARD_SCHEMA's order."""
    q, k, v, mask, bias, *constants = inputs
    grad_out, grad_lse, out, lse, bias_grad, score_grad = grads
    return (grad_out, grad_lse, q, k, v, mask, bias, out, lse, *constants, bias_grad, score_grad)


def _split_backward_args(args: tuple) -> tuple[OpInputs, OutputGrads]:
    """A backward op's arguments (BACKWARD_SCHEMA's order) as (inputs, output grads)."""
    grad_out, grad_lse, q, k, v, mask, bias, out, lse, *constants, bias_grad, score_grad = args
    inputs = OpInputs(q, k, v, mask, bias, *constants)
    return inputs, OutputGrads(grad_out, grad_lse, out, lse, bias_grad, score_grad)


@dataclass(frozen=True)
class AttentionOps:
    """An engine's pair of custom ops: op(*OpInputs) -> (out (B, H, L, D_v), lse
    (B, H, L)) and backward_op -> (dq, dk, dv, dbias, dsinks, d score_tensors), dbias
    empty unless bias_grad, dsinks unless sinks are given, d score_tensors unless
    score_grad."""

    op: Callable
    backward_op: Callable

    def traced_call(
        self,
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
        """The op's call for a traced graph, from a backend's forward arguments: patterns
        by repr, those holding tensors dense, score functions by text and tensors."""
        pattern, mask = traced_mask(mask, q.shape[2], k.shape[2], q.device)
        text, tensors = score_spec(score)
        seed = traced_seed(dropout_p)
        inputs = OpInputs(
            q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, text, tensors, sinks
        )
        return self.op(*inputs)


def define_attention_ops(
    name: str,
    forward: Callable[[OpInputs], tuple[Tensor, Tensor]],
    backward: Callable[[OpInputs, OutputGrads], tuple],
) -> AttentionOps:
    """The custom ops mhsa::name (FORWARD_SCHEMA) running forward(inputs) and
    mhsa::name_backward (BACKWARD_SCHEMA) running backward(inputs, grads), with their
    fake (shape-only) implementations, the backward op registered as the op's gradient."""

    def run_forward(*args):
        return forward(OpInputs(*args))

    def run_backward(*args):
        return backward(*_split_backward_args(args))

    op = torch.library.custom_op(
        f"mhsa::{name}", run_forward, mutates_args=(), schema=FORWARD_SCHEMA
    )
    backward_op = torch.library.custom_op(
        f"mhsa::{name}_backward", run_backward, mutates_args=(), schema=BACKWARD_SCHEMA
    )
    _register(op, backward_op)
    return AttentionOps(op, backward_op)


def _register(op, backward_op) -> None:
    """The fake (shape-only) implementations of an attention op and its backward op,
    and backward_op as op's gradient."""

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
        inputs = OpInputs(q, k, v, mask, bias, *ctx.constants, seed, ctx.score, tensors, sinks)
        grads = OutputGrads(grad_out, grad_lse, out, lse, bias_grad, score_grad)
        dq, dk, dv, dbias, dsinks, dscore = backward_op(*_join_backward_args(inputs, grads))
        input_grads = dict.fromkeys(OpInputs._fields)  # None for the constants
        input_grads.update(
            q=dq,
            k=dk,
            v=dv,
            bias=dbias if bias_grad else None,
            score_tensors=dscore if score_grad else [None] * len(tensors),
            sinks=dsinks if sinks is not None else None,
        )
        return tuple(input_grads.values())

    op.register_autograd(backward, setup_context=setup_context)
    op.register_fake(lambda *args: _fake_forward(OpInputs(*args)))
    backward_op.register_fake(lambda *args: _fake_backward(*_split_backward_args(args)))


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


def _fake_forward(inputs: OpInputs) -> tuple[Tensor, Tensor]:
    q = inputs.q
    batch, heads, q_len, _ = q.shape
    out = q.new_empty(batch, heads, q_len, inputs.v.shape[-1])
    return out, q.new_empty(batch, heads, q_len, dtype=stats_dtype(q.dtype))


def _fake_backward(inputs: OpInputs, grads: OutputGrads) -> tuple:
    # contiguous, as the real ops' (empty_like would copy q's strides, and a graph
    # traced on those would misread the real gradients)
    q, k, v, _, bias, *_, score_tensors, sinks = inputs
    dbias = bias.new_empty(bias.shape) if grads.bias_grad else q.new_empty(0)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    dscore = [t.new_empty(t.shape) for t in score_tensors] if grads.score_grad else []
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    return dq, dk, dv, dbias, dsinks, dscore
