"""The flash engine as torch.library custom ops, for traced graphs (torch.compile,
torch.export): one `mhsa::flash_attention` node per attention call, its backward one
`mhsa::flash_attention_backward`, instead of the engine's block loop traced through.
The block plan is built inside the op when it runs, so a plan that depends on a mask's
values (padding) or on the lengths (dynamic shapes) neither breaks nor specialises the
graph.

Constants reach the op by value: a mask pattern as its repr, rebuilt from the
mhsa.core.masks classes inside the op (equal patterns give equal strings, so the same
pattern never recompiles); a bool mask tensor as a tensor. A pattern that holds
tensors (KeyPadding, BlockSparse, ...) is made a dense bool mask first. A score
function reaches it the same way, ScoreMod included: its text (backends.op_scores)
and the tensors it reads, which receive gradients; sinks as a tensor.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..kernels.flash import FlashCall, flash_backward, flash_forward
from ..scores import ScoreFunction
from .flash_plan import engine_call
from .op_scores import differentiable_score, rebuild_score, score_spec
from .op_values import (
    OpInputs,
    OutputGrads,
    backward_outputs,
    define_attention_ops,
    rebuild_pattern,
)


def _engine_call(inputs: OpInputs, score: ScoreFunction | None) -> FlashCall:
    """The flash engine's call for an op's inputs, as the flash backend makes it eagerly."""
    q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, _, _, sinks = inputs
    mask = mask if mask is not None else rebuild_pattern(pattern)
    dropout = (dropout_p, int(seed)) if dropout_p > 0 else None
    return engine_call(q, k, v, mask, bias, causal, scale, dropout, score, sinks)


@contextlib.contextmanager
def _autograd_on():
    """A custom op runs with autograd dispatch switched off; the backward differentiates
    a score function's tiles to reach its tensors (kernels.scored.score_grads), so it
    switches autograd back on for that."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    exclude = exclude.remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _forward(inputs: OpInputs) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, D_v), lse (B, H, L)) of the flash engine."""
    score_fn = rebuild_score(inputs.score, inputs.score_tensors)
    out, lse = flash_forward(_engine_call(inputs, score_fn))
    return out.contiguous(), lse.contiguous()


def _backward(inputs: OpInputs, grads: OutputGrads) -> tuple:
    """(dq, dk, dv, dbias, dsinks, d score_tensors), as AttentionOps.backward_op."""
    grad_out, grad_lse, out, lse, bias_grad, score_grad = grads
    targets: list[Tensor | None] = []  # what each score tensor's gradient is taken of
    if score_grad:
        score_fn, targets = differentiable_score(inputs.score, inputs.score_tensors)
    else:
        score_fn = rebuild_score(inputs.score, inputs.score_tensors)
    call = _engine_call(inputs, score_fn)
    # the fused kernel takes no lse gradient and returns no bias or score gradient
    call = call._replace(fused=call.fused and grad_lse is None and not bias_grad and not score_grad)
    params = tuple(t for t in targets if t is not None)
    # a score whose input gradient its output does not give (tanh, a ScoreMod) is
    # differentiated by autograd, which a custom op's backward runs with dispatch off
    by_autograd = score_fn is not None and not score_fn.grad_from_output
    with _autograd_on() if score_grad or by_autograd else contextlib.nullcontext():
        dq, dk, dv, dbias, dsinks, found = flash_backward(
            call, grad_out, grad_lse, out, lse, bias_grad, params
        )
    found = iter(found)
    param_grads = [None if target is None else next(found) for target in targets]
    dscore = (
        [
            torch.zeros_like(t) if g is None else g.detach()
            for t, g in zip(inputs.score_tensors, param_grads, strict=True)
        ]
        if score_grad
        else []
    )
    return backward_outputs(inputs.q, dq, dk, dv, dbias, dsinks, dscore)


FLASH_OPS = define_attention_ops("flash_attention", _forward, _backward)
flash_attention_op = FLASH_OPS.op  # mhsa::flash_attention
flash_attention_backward_op = FLASH_OPS.backward_op  # mhsa::flash_attention_backward
traced_flash_attention = FLASH_OPS.traced_call


def traceable(score: ScoreFunction | None) -> bool:
    """Whether the op takes this score function (it has a score_spec text)."""
    return score_spec(score) is not None
