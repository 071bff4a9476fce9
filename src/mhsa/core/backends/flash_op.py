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

from ..kernels.flash import flash_backward, flash_forward, fused_available
from ..scores import ScoreFunction
from .flash_plan import plan_for
from .op_scores import differentiable_score, rebuild_score, score_spec
from .op_values import backward_outputs, rebuild_pattern, register_attention_op, traced_call


def _engine_inputs(q, v, mask, pattern, causal, dropout_p, seed, score):
    """(plan, dropout, fused) of a call, as the flash backend makes them eagerly."""
    # the fused kernel adds a float mask per tile: additive score functions only
    fused = fused_available(q, v, dropout_p) and (score is None or score.additive)
    plan = plan_for(
        mask if mask is not None else rebuild_pattern(pattern),
        causal,
        q.shape[2],
        v.shape[2],
        q.device,
        fused,
        score,
    )
    dropout = (dropout_p, int(seed)) if dropout_p > 0 else None
    return plan, dropout, fused


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


@torch.library.custom_op("mhsa::flash_attention", mutates_args=())
def flash_attention_op(
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
    """(out (B, H, L, D_v), lse (B, H, L)) of the flash engine; seed: an int64 scalar;
    score: a score_spec text, reading score_tensors; sinks (H,) or None."""
    score_fn = rebuild_score(score, score_tensors)
    plan, dropout, fused = _engine_inputs(q, v, mask, pattern, causal, dropout_p, seed, score_fn)
    out, lse = flash_forward(q, k, v, bias, plan, scale, dropout, fused, score_fn, sinks)
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("mhsa::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
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
    """(dq, dk, dv, dbias, dsinks, d score_tensors); dbias is empty unless bias_grad,
    dsinks unless sinks are given, d score_tensors unless score_grad."""
    targets: list[Tensor | None] = []  # what each score tensor's gradient is taken of
    if score_grad:
        score_fn, targets = differentiable_score(score, score_tensors)
    else:
        score_fn = rebuild_score(score, score_tensors)
    plan, dropout, fused = _engine_inputs(q, v, mask, pattern, causal, dropout_p, seed, score_fn)
    # the fused kernel takes no lse gradient and returns no bias or score gradient
    fused = fused and grad_lse is None and not bias_grad and not score_grad
    with _autograd_on() if score_grad else contextlib.nullcontext():
        dq, dk, dv, dbias, dsinks, found = flash_backward(
            grad_out,
            grad_lse,
            q,
            k,
            v,
            bias,
            out,
            lse,
            plan,
            scale,
            dropout,
            fused,
            bias_grad,
            score_fn,
            sinks,
            tuple(t for t in targets if t is not None),
        )
    found = iter(found)
    grads = [None if target is None else next(found) for target in targets]
    dscore = (
        [
            torch.zeros_like(t) if g is None else g.detach()
            for t, g in zip(score_tensors, grads, strict=True)
        ]
        if score_grad
        else []
    )
    return backward_outputs(q, dq, dk, dv, dbias, dsinks, dscore)


register_attention_op(flash_attention_op, flash_attention_backward_op)


def traceable(score: ScoreFunction | None) -> bool:
    """Whether the op takes this score function (it has a score_spec text)."""
    return score_spec(score) is not None


def traced_flash_attention(
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
        flash_attention_op, q, k, v, mask, bias, causal, scale, dropout_p, score, sinks
    )
