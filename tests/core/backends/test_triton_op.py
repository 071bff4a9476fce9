"""The Triton kernels as custom ops (backends.triton_op), run in Triton's CPU
interpreter: opcheck and float64 gradcheck with patterns, padding, bias, score
functions and sinks, and a compiled GPT on the triton backend as one graph whose
outputs and gradients equal eager."""

from __future__ import annotations

import pytest
import torch

from optional import needs

needs("triton")  # the interpreter is switched on in conftest.py

import mhsa
from helpers import max_error
from mhsa.core.backends.op_scores import rebuild_score, score_spec
from mhsa.core.backends.op_values import rebuild_pattern
from mhsa.core.backends.triton_op import triton_attention_op
from mhsa.core.scores import ALiBi, Compose, RelativeBias, Softcap
from mhsa.models.gpt import GPT, GPTConfig


def _inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(4, 9, 9, dtype=torch.float64, requires_grad=True)
    return q, k, v, bias


CASES = {
    "causal, padded": ("", True, "padded", None),
    "window": ("SlidingWindow(2, 1)", False, None, None),
    "alibi, sinks": ("", True, None, lambda: [ALiBi(torch.rand(4, dtype=torch.float64))]),
    "t5 then softcap": (
        "",
        False,
        None,
        lambda: [RelativeBias(torch.randn(8, 4, dtype=torch.float64), 8, 16, False), Softcap(2.0)],
    ),
}


def _reference(q, k, v, mask, bias, pattern, causal, scale, dropout_p, seed, text, tensors, sinks):
    """The reference backend on the op's arguments: (out, lse)."""
    return mhsa.attention(
        q,
        k,
        v,
        mask if mask is not None else rebuild_pattern(pattern),
        bias=bias,
        causal=causal,
        scale=scale,
        backend="reference",
        score=rebuild_score(text, tensors),
        sinks=sinks,
        return_lse=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_triton_op_passes_opcheck_and_equals_the_reference(case):
    """Outputs, lse and every gradient (q, k, v, bias, score tensors, sinks) in float64.
    (gradcheck's numerical differences would take minutes in the interpreter.)"""
    pattern, causal, padded, make_score = CASES[case]
    q, k, v, bias = _inputs()
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        mask[1, ..., 6:] = False
    text, tensors = score_spec(None if make_score is None else Compose(*make_score()))
    tensors = [t.requires_grad_() for t in tensors]
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True) if tensors else None
    args = (q, k, v, mask, bias, pattern, causal, 0.3, 0.0, torch.tensor(0), text, tensors, sinks)
    torch.library.opcheck(triton_attention_op, args)
    leaves = [t for t in (q, k, v, bias, *tensors, sinks) if t is not None]
    grad_out, grad_lse = torch.randn(2, 4, 9, 8, dtype=torch.float64), torch.randn(2, 4, 9)
    results = []
    for run in (triton_attention_op, _reference):
        out, lse = run(*args)
        loss = (out * grad_out).sum() + (lse * grad_lse.double()).sum()
        results.append((out, lse, torch.autograd.grad(loss, leaves)))
    (out, lse, grads), (want_out, want_lse, want_grads) = results
    assert max_error(out, want_out) <= 1e-10
    assert max_error(lse, want_lse) <= 1e-10
    for got, want in zip(grads, want_grads, strict=True):
        assert max_error(got, want) <= 1e-10


def test_the_triton_op_without_keys_gives_zeros_and_the_sinks_logit():
    """No keys: output 0, lse each row's sink (contiguous, as an op's outputs are), and
    zero gradients; opcheck passes."""
    q, k, v, _ = _inputs()
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    args = (
        q,
        k[:, :, :0],
        v[:, :, :0],
        None,
        None,
        "",
        False,
        0.3,
        0.0,
        torch.tensor(0),
        "",
        [],
        sinks,
    )
    torch.library.opcheck(triton_attention_op, args)
    out, lse = triton_attention_op(*args)
    assert torch.equal(out, torch.zeros(2, 4, 9, 8, dtype=torch.float64))
    assert lse.is_contiguous()
    assert torch.equal(lse, sinks.detach().view(1, 4, 1).expand(2, 4, 9))
    grads = torch.autograd.grad(out.sum(), (q, sinks), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


@pytest.mark.slow
def test_a_compiled_gpt_on_triton_is_one_graph_equal_to_eager():
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=64, max_len=64, d_model=32, n_head=2, n_layer=2, dropout=0.0, position="alibi"
    )
    model = GPT(config)
    idx = torch.randint(0, 64, (1, 20))
    torch._dynamo.reset()
    with mhsa.use_backend("triton"):
        explained = torch._dynamo.explain(model)(idx)
        assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        results = []
        for run in (model, compiled):
            model.zero_grad()
            out = run(idx)
            out.square().mean().backward()
            results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    assert max_error(got, want) <= 1e-5
    for g, w in zip(got_grads, want_grads, strict=True):
        assert max_error(g, w) <= 1e-5
