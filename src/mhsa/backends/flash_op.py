"""The flash engine as torch.library custom ops, for traced graphs (torch.compile,
torch.export): one `mhsa::flash_attention` node per attention call, its backward one
`mhsa::flash_attention_backward`, instead of the engine's block loop traced through.
The block plan is built inside the op when it runs, so a plan that depends on a mask's
values (padding) or on the lengths (dynamic shapes) neither breaks nor specialises the
graph.

Constants reach the op by value: a mask pattern as its repr, rebuilt from the
mhsa.masks classes inside the op (equal patterns give equal strings, so the same
pattern never recompiles); a bool mask tensor as a tensor. A pattern that holds
tensors (KeyPadding, BlockSparse, ...) is made a dense bool mask first. Calls with a
score function or sinks are traced through the engine instead (FlashBackend.forward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import masks
from ..kernels.dense import stats_dtype
from ..kernels.flash import flash_backward, flash_forward, fused_available
from ..masks import Pattern
from .flash_plan import plan_for

_PATTERN_CLASSES = {name: getattr(masks, name) for name in masks.__all__
                    if isinstance(getattr(masks, name), type)}  # fmt: skip
_REBUILT: dict[str, Pattern] = {}


def _pattern(text: str) -> Pattern | None:
    """The pattern whose repr is text ("" for none), built once per text."""
    if not text:
        return None
    if text not in _REBUILT:
        _REBUILT[text] = eval(text, {"__builtins__": {}}, _PATTERN_CLASSES)  # noqa: S307
    return _REBUILT[text]


def _engine_inputs(q, v, mask, pattern, causal, dropout_p, seed):
    """(plan, dropout, fused) of a call, as the flash backend makes them eagerly."""
    fused = fused_available(q, v, dropout_p)
    plan = plan_for(mask if mask is not None else _pattern(pattern), causal, q.shape[2],
                    v.shape[2], q.device, fused)  # fmt: skip
    dropout = (dropout_p, int(seed)) if dropout_p > 0 else None
    return plan, dropout, fused


@torch.library.custom_op("mhsa::flash_attention", mutates_args=())
def flash_attention_op(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, pattern: str,
    causal: bool, scale: float, dropout_p: float, seed: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out (B, H, L, D_v), lse (B, H, L)) of the flash engine; seed: an int64 scalar."""
    plan, dropout, fused = _engine_inputs(q, v, mask, pattern, causal, dropout_p, seed)
    out, lse = flash_forward(q, k, v, bias, plan, scale, dropout, fused)
    return out.contiguous(), lse.contiguous()


@flash_attention_op.register_fake
def _(q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed):
    batch, heads, q_len, _ = q.shape
    out = q.new_empty(batch, heads, q_len, v.shape[-1])
    return out, q.new_empty(batch, heads, q_len, dtype=stats_dtype(q.dtype))


@torch.library.custom_op("mhsa::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
    mask: Tensor | None, bias: Tensor | None, out: Tensor, lse: Tensor, pattern: str,
    causal: bool, scale: float, dropout_p: float, seed: Tensor, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv, dbias); dbias is empty unless bias_grad."""
    plan, dropout, fused = _engine_inputs(q, v, mask, pattern, causal, dropout_p, seed)
    # the fused kernel takes no lse gradient and returns no bias gradient
    fused = fused and grad_lse is None and not bias_grad
    dq, dk, dv, dbias, _, _ = flash_backward(grad_out, grad_lse, q, k, v, bias, out, lse, plan,
                                             scale, dropout, fused, bias_grad)  # fmt: skip
    dbias = q.new_empty(0) if dbias is None else dbias.contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias


@flash_attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, mask, bias, out, lse, pattern, causal, scale, dropout_p,
      seed, bias_grad):  # fmt: skip
    # contiguous, as the real op's (empty_like would copy q's strides, and a graph
    # traced on those would misread the real gradients)
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, mask, bias, output[0], output[1], seed)
    ctx.constants = (pattern, causal, scale, dropout_p)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, mask, bias, out, lse, seed = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[4]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dbias = flash_attention_backward_op(
        grad_out, grad_lse, q, k, v, mask, bias, out, lse, *ctx.constants, seed, bias_grad
    )
    return dq, dk, dv, None, dbias if bias_grad else None, None, None, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


def traced_flash_attention(q, k, v, mask, bias, causal: bool, scale: float,
                           dropout_p: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The op's call for a traced graph: patterns by repr, those holding tensors dense."""
    pattern = ""
    if isinstance(mask, Pattern):
        if mask.plain_values:
            pattern, mask = repr(mask), None
        else:
            mask = mask.dense(q.shape[2], k.shape[2], q.device)
    seed = torch.zeros((), dtype=torch.int64)  # draws only with dropout, as eager does
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    return flash_attention_op(q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed)
