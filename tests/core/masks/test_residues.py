"""Dilated attention by residue classes (masks/residues.py): each class is a sliding
window on strided views, so the flash backend's cost follows the allowed entries."""

from __future__ import annotations

import itertools

import pytest
import torch

import mhsa
from helpers import assert_matches_reference, make_qkv, reference_with_grads
from mhsa import masks
from mhsa.core.backends.flash import FlashBackend
from mhsa.core.masks.residues import residue_classes


def classes_as_dense(classes, dilation: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The (L, S) mask that the classes' windows allow, in the full problem's indices."""
    dense = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for c in classes:
        rows = torch.arange(c.q_start, q_len, dilation)
        keys = torch.arange(c.k_start, kv_len, dilation)
        dense[rows.view(-1, 1), keys.view(1, -1)] = c.window.dense(len(rows), len(keys))
    return dense


@pytest.mark.parametrize("causal", [False, True])
def test_classes_allow_exactly_the_dilated_mask(causal):
    used = 0
    for window, dilation, q_len, kv_len in itertools.product(
        (0, 1, 3), (1, 2, 3, 5), (1, 4, 9, 17), (1, 6, 9, 23)
    ):
        classes = residue_classes(window, dilation, causal, q_len, kv_len)
        if classes is None:
            continue
        used += 1
        want = masks.Dilated(window, dilation).dense(q_len, kv_len)
        if causal:
            want = want & torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        assert torch.equal(classes_as_dense(classes, dilation, q_len, kv_len), want), (
            window,
            dilation,
            q_len,
            kv_len,
        )
    assert used > 100  # most shapes decompose; the others go through the block plan


@pytest.fixture
def residue_calls(monkeypatch):
    calls = []
    original = FlashBackend._by_residue

    def spy(self, q, k, v, classes, dilation, scale):
        calls.append(len(classes))
        return original(self, q, k, v, classes, dilation, scale)

    monkeypatch.setattr(FlashBackend, "_by_residue", spy)
    return calls


CASES = [  # (q_len, kv_len, window, dilation, causal, kv_heads)
    (700, 700, 40, 4, False, 3),
    (700, 700, 40, 4, True, 3),
    (613, 1001, 25, 3, False, 1),
    (1000, 614, 25, 3, True, 3),
    (333, 333, 0, 5, False, 3),
    (40, 40, 2, 64, False, 3),  # dilation beyond the length: each query its own class
    (700, 700, 30, 1, True, 3),  # dilation 1 is its sliding window: the band path directly
]


@pytest.mark.parametrize(("q_len", "kv_len", "window", "dilation", "causal", "kv_heads"), CASES)
def test_dilated_flash_matches_reference(
    residue_calls, q_len, kv_len, window, dilation, causal, kv_heads
):
    pattern = masks.Dilated(window, dilation)
    q, k, v = make_qkv(
        2,
        3,
        kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=8,
        noncontiguous=True,
        requires_grad=True,
    )
    grad_out = torch.randn(2, 3, q_len, 8)
    out, lse = mhsa.attention(q, k, v, pattern, causal=causal, backend="flash", return_lse=True)
    out.backward(grad_out)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, pattern, None, causal, grad_out)
    assert_matches_reference(out, lse, (q, k, v, None), ref_out, ref_lse, ref_grads)
    expected = residue_classes(window, dilation, causal, q_len, kv_len)
    assert residue_calls == ([] if expected is None or dilation == 1 else [len(expected)])


def test_dilated_with_bias_or_dropout_keeps_the_block_plan(residue_calls):
    q, k, v = make_qkv(1, 2, q_len=200, head_dim=8)
    pattern = masks.Dilated(10, 3)
    mhsa.attention(q, k, v, pattern, bias=torch.zeros(200, 200), backend="flash")
    mhsa.attention(q, k, v, pattern, dropout_p=0.1, backend="flash")
    assert residue_calls == []
