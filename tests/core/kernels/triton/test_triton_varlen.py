"""mhsa.attention_varlen on the triton backend, in Triton's CPU interpreter: packed
sequences (lengths 1, 0, not multiples of the 16-row interpreter tiles, cross-attention,
GQA, a window, ALiBi and sinks) give the float64 formula on each sequence alone,
forward and backward; a score function that needs remapped positions is declined with
the reason."""

from __future__ import annotations

import pytest
import torch

from optional import needs

needs("triton")  # the interpreter is switched on in conftest.py

import mhsa
from helpers import golden_attention, max_error
from mhsa.core.scores import ALiBi, ScoreMod

Q_LENGTHS = [1, 0, 21, 40, 3]
K_LENGTHS = [2, 3, 21, 33, 0]


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def each_alone(q, k, v, q_lengths, k_lengths, mask_of=None, **kwargs):
    """The float64 formula on each sequence alone (mask_of(L, S) its bool mask); 0 for
    a sequence without keys."""
    cu_q, cu_k = offsets(q_lengths).tolist(), offsets(k_lengths).tolist()
    outs = []
    for s in range(len(q_lengths)):
        q_s = q[cu_q[s] : cu_q[s + 1]].transpose(0, 1)[None]
        k_s, v_s = (t[cu_k[s] : cu_k[s + 1]].transpose(0, 1)[None] for t in (k, v))
        if k_s.shape[2] == 0:
            outs.append(q_s.new_zeros(q_s.shape[2], q.shape[1], v.shape[2]).double() + 0 * q.sum())
            continue
        mask = None if mask_of is None else mask_of(q_s.shape[2], k_s.shape[2])
        out, _ = golden_attention(q_s, k_s, v_s, mask, **kwargs)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "q_lengths,k_lengths,causal,window,use_score",
    [
        (Q_LENGTHS, Q_LENGTHS, True, None, True),
        (Q_LENGTHS, K_LENGTHS, True, None, False),
        (Q_LENGTHS, Q_LENGTHS, False, (5, 2), False),
    ],
    ids=["self-causal-alibi-sinks", "cross-causal", "window"],
)
def test_triton_serves_packed_sequences(q_lengths, k_lengths, causal, window, use_score):
    q = torch.randn(sum(q_lengths), 4, 16, requires_grad=True)
    k, v = (torch.randn(sum(k_lengths), 2, 16, requires_grad=True) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    sinks = torch.tensor([0.5, -1.0, 1.0, 0.0]) if use_score else None
    out = mhsa.attention_varlen(
        q,
        k,
        v,
        offsets(q_lengths),
        offsets(k_lengths),
        max(q_lengths),
        max(k_lengths),
        causal=causal,
        window=window,
        score=ALiBi(slopes) if use_score else None,
        sinks=sinks,
        backend="triton",
    )

    def mask_of(q_len, kv_len):  # the window, bottom-right
        offset = torch.arange(kv_len).view(1, -1) - torch.arange(q_len).view(-1, 1)
        offset = offset - (kv_len - q_len)
        return (offset >= -window[0]) & (offset <= window[1])

    def modify(scores, i, j):
        return scores - slopes.double().view(1, -1, 1, 1) * (i - j).abs()

    kwargs = dict(causal=causal, mask_of=mask_of if window else None)
    if use_score:
        kwargs.update(modify=modify, sinks=sinks)
    want = each_alone(q, k, v, q_lengths, k_lengths, **kwargs)
    assert max_error(out, want) < 2e-5
    grad_out = torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = torch.autograd.grad(want, (q, k, v), grad_out.double())
    for g, e in zip(got, expected, strict=True):
        assert max_error(g, e) < 1e-4


def test_a_score_function_of_absolute_positions_is_declined():
    q = k = v = torch.randn(6, 2, 16)
    cu = offsets([2, 4])
    score = ScoreMod(lambda s, b, h, i, j: s + 0.1 * i)
    with pytest.raises(ValueError, match="triton"):
        mhsa.attention_varlen(q, k, v, cu, cu, 4, 4, score=score, backend="triton")
