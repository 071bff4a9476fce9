"""The flash engine's strided sliding-window path (kernels/band.py): every row block of
the band's interior in one fused call, the edges through the block plan."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import assert_matches_reference, make_qkv, max_error, reference_with_grads
from mhsa import masks
from mhsa.core.backends.flash_plan import FUSED_BLOCK, plan_for
from mhsa.core.kernels import band, flash


@pytest.fixture
def band_calls(monkeypatch):
    """The row ranges (first, end) that band_forward computed during a test."""
    calls = []
    original = band.band_forward

    def spy(q, k, v, left, right, scale, first, end, out, lse):
        calls.append((first, end))
        return original(q, k, v, left, right, scale, first, end, out, lse)

    monkeypatch.setattr(flash, "band_forward", spy)
    return calls


CASES = [  # (q_len, kv_len, left, right, causal): L == S, L < S, L > S, one-sided windows
    (1100, 1100, 100, 37, False),
    (900, 1333, 64, 64, False),
    (1500, 1024, 200, 0, False),
    (1100, 1100, 0, 90, False),
    (1000, 1000, 120, 50, True),
    (800, 1250, 31, 0, False),
]


@pytest.mark.parametrize(("q_len", "kv_len", "left", "right", "causal"), CASES)
def test_band_matches_reference_forward_and_backward(
    band_calls, q_len, kv_len, left, right, causal
):
    pattern = masks.SlidingWindow(left, right)
    q, k, v = make_qkv(2, 3, q_len=q_len, kv_len=kv_len, head_dim=8, requires_grad=True)
    grad_out = torch.randn(2, 3, q_len, 8)
    out, lse = mhsa.attention(q, k, v, pattern, causal=causal, backend="flash", return_lse=True)
    out.backward(grad_out)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, pattern, None, causal, grad_out)
    assert_matches_reference(out, lse, (q, k, v, None), ref_out, ref_lse, ref_grads)
    assert len(band_calls) == 1
    first, end = band_calls[0]
    assert first % FUSED_BLOCK == 0 and end % FUSED_BLOCK == 0 and end > first


def test_band_gqa_noncontiguous_and_float64(band_calls):
    pattern = masks.SlidingWindow(70, 40)
    q, k, v = make_qkv(2, 6, 2, q_len=1000, kv_len=1100, head_dim=8, noncontiguous=True)
    out = mhsa.attention(q, k, v, pattern, backend="flash")
    assert max_error(out, mhsa.attention(q, k, v, pattern, backend="reference")) < 2e-6
    q64, k64, v64 = (t.double() for t in (q, k, v))
    out64 = mhsa.attention(q64, k64, v64, pattern, backend="flash")
    assert out64.dtype == torch.float64
    # 1e-9, not 1e-12: a first float64 matmul in a fresh process can round differently
    assert max_error(out64, mhsa.attention(q64, k64, v64, pattern, backend="reference")) < 1e-9
    assert len(band_calls) == 2


def test_band_gradcheck():
    pattern = masks.SlidingWindow(3, 2)
    q, k, v = make_qkv(
        1, 2, q_len=600, kv_len=600, head_dim=3, dtype=torch.float64, requires_grad=True
    )
    plan = plan_for(pattern, False, 600, 600, q.device, fused=True)
    assert flash._band_interior(plan, None, None, True) == (256, 512)

    def f(q, k, v):
        out, lse = flash.flash_attention(q, k, v, plan, scale=0.5, fused=True)
        return out[:, :, 250:520], lse[:, :, 250:520]

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_band_not_used_where_it_does_not_apply(band_calls):
    q, k, v = make_qkv(1, 2, q_len=1100, head_dim=8)
    window = masks.SlidingWindow(100, 100)
    mhsa.attention(q, k, v, window, bias=torch.zeros(1100, 1100), backend="flash")
    mhsa.attention(q, k, v, window & masks.GlobalTokens([3]), backend="flash")
    mhsa.attention(q, k, v, masks.SlidingWindow(600, 600), backend="flash")  # no interior
    short = make_qkv(1, 2, q_len=300, head_dim=8)
    mhsa.attention(*short, window, backend="flash")
    assert band_calls == []


def test_interior_rows():
    # rows whose window lies inside the keys, rounded inwards to the alignment
    assert band.interior_rows(1024, 1024, 100, 37, align=256) == (256, 768)
    assert band.interior_rows(1024, 1024, 0, 0, align=256) == (0, 1024)
    assert band.interior_rows(512, 1024, 600, 10, align=256) is None  # shift 512
    assert band.interior_rows(512, 1024, 700, 10, align=32) == (192, 480)
    assert band.interior_rows(1024, 1024, 900, 0, align=256) is None
    assert band.interior_rows(1024, 1024, 10, 10, align=48) is None  # not a BAND_ROWS multiple
    mask = band.band_mask(2, 1, torch.float32, "cpu")
    assert mask.shape == (band.BAND_ROWS, 3 + band.BAND_ROWS)
    assert torch.isfinite(mask[5]).nonzero().flatten().tolist() == [5, 6, 7, 8]
