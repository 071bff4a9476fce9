"""Masked keys never leak: a key or value the mask hides cannot change the output.

A backend computes p @ v and q @ k^T with matmuls, where 0 * nan is nan: a non-finite
key or value poisons every row of its tile, allowed or not (caches hold unwritten
slots, padded batches hold garbage). `isolate_masked_nonfinite` makes the guarantee
for any backend without touching the fast path's arithmetic:

- clean calls (the usual case) cost one isfinite pass: over the output when no
  gradient is needed (decoding), over k and v when one is (a backward multiplies
  dS @ k, so a masked nan reaches dq even when the output is finite);
- otherwise the call is recomputed with non-finite entries of k and v set to 0, and
  the rows that do attend a non-finite key or value (found by one more call with
  zero scores, which spreads each row's weight uniformly over its allowed keys) keep
  the first result, detached: their output is non-finite, as the formula says.

Under torch.compile and torch.export (and so ONNX export) a graph cannot branch on a
value: the traced graph keeps the fast path only, and assumes finite keys and values
(they are in our models, where every key is a projection of a finite embedding and
caches start zeroed). A torch.cond of the check exports too, but doubles the trace time
and adds an If node to every layer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import tracing
from .registry import Backend


def bad_keys(k: Tensor, v: Tensor) -> Tensor:
    """(B, H_kv, S) bool: keys whose key or value vector holds a non-finite entry."""
    return ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))


def zero_nonfinite(t: Tensor) -> Tensor:
    """t with its nan and inf entries set to 0."""
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))


def isolate_masked_nonfinite(
    backend: Backend,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor | None,
    call: dict,
) -> tuple[Tensor, Tensor | None]:
    """(out, lse) of `backend.forward(q, k, v, **call)` with masked non-finite keys
    and values ignored. out (B, H, L, D_v) and lse are that call's results."""
    if call["mask"] is None and call["bias"] is None and (not call["causal"] or q.shape[2] == 1):
        return out, lse  # every key is allowed (causal: the one query sees them all)
    if tracing():
        return out, lse  # a traced graph: the fast path only (module docstring)
    score = call.get("score")
    inputs = (q, k, v, call["bias"], call.get("sinks"), *(score.tensors() if score else ()))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in inputs
    )
    # a sum is non-finite when any term is (it may also overflow: then the slow path
    # below finds no bad key and returns); one reduction, no boolean tensor
    terms = (k, v) if needs_grad else (out,)
    total = sum(t.sum(dtype=torch.float32) for t in terms)
    if not backend.any_rank(not math.isfinite(total.item())):
        return out, lse
    bad = bad_keys(k, v)
    if not backend.any_rank(bool(bad.any())):
        return out, lse  # the non-finite output comes from q or the bias: the formula's
    clean_out, clean_lse = backend.forward(q, zero_nonfinite(k), zero_nonfinite(v), **call)
    poisoned = attends_bad_key(backend, q, k, v, bad, call)  # (B, H, L)
    out = torch.where(poisoned.unsqueeze(-1), out.detach(), clean_out)
    if lse is not None:
        lse = torch.where(poisoned, lse.detach(), clean_lse)
    return out, lse


def attends_bad_key(
    backend: Backend, q: Tensor, k: Tensor, v: Tensor, bad: Tensor, call: dict
) -> Tensor:
    """(B, H, L) bool: rows with an allowed key in `bad`. With q = k = 0 every allowed
    score is equal, so a row's output is the share of its allowed keys that are bad:
    positive exactly when it has one (no exp can underflow)."""
    bias = call["bias"]
    if bias is not None:  # only its -inf entries, which mask, matter here
        zero = torch.zeros((), dtype=bias.dtype, device=bias.device)
        bias = torch.where(torch.isneginf(bias), bias, zero).detach()
    indicator = bad.to(v.dtype).unsqueeze(-1).expand(v.shape).contiguous()
    with torch.no_grad():
        share, _ = backend.forward(
            torch.zeros_like(q),
            torch.zeros_like(k),
            indicator,
            **{
                **call,
                "bias": bias,
                "dropout_p": 0.0,
                "return_lse": False,
                "score": None,
                "sinks": None,
            },
        )
    return share[..., 0] > 0
