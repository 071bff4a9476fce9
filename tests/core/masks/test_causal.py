"""The causal alignment (mhsa.core.masks.causal) has one definition: checked here
against the formula, and the source tree is checked to hold no second copy."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import source_code
from mhsa.core.masks.causal import causal_allows, causal_mask, causal_shift


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 9), (5, 5), (4, 11), (11, 4), (7, 0)])
def test_causal_mask_is_the_bottom_right_rule(q_len, kv_len):
    expected = torch.tensor(
        [[j <= i + kv_len - q_len for j in range(kv_len)] for i in range(q_len)], dtype=torch.bool
    ).view(q_len, kv_len)
    assert torch.equal(causal_mask(q_len, kv_len), expected)
    assert causal_shift(q_len, kv_len) == kv_len - q_len
    if q_len and kv_len:
        assert bool(causal_mask(q_len, kv_len)[-1].all())  # the last query sees every key
    assert causal_allows(3, 3) and causal_allows(3, 2) and not causal_allows(3, 4)


def test_causal_shift_takes_per_sequence_lengths():
    lengths = torch.tensor([4, 9, 1])
    assert torch.equal(causal_shift(1, lengths), torch.tensor([3, 8, 0]))


def test_the_causal_alignment_is_written_once():
    """No module but masks/causal.py computes S - L, a triangle or the causal
    comparison itself (the triton kernels receive the shift as an argument and
    compare in-kernel, where Python cannot be called)."""
    shift = re.compile(
        r"\b(\w+\.)?kv_len - (\w+\.)?q_len\b|\b(\w+\.)?q_len - (\w+\.)?kv_len\b"
        r"|\btril\b|\btriu\b"
    )
    offenders = [
        name
        for name, code in source_code().items()
        if name != "core/masks/causal.py" and shift.search(code)
    ]
    assert offenders == []
