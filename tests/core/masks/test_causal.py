"""The causal alignment (mhsa.core.masks.causal) has one definition: checked here
against the formula, and the source tree is checked to hold no second copy."""

from __future__ import annotations

import re

import pytest
import torch

from helpers import source_code
from mhsa.core.masks import Causal, SlidingWindow, bigbird
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


POSITION_PATTERNS = [
    Causal(),
    SlidingWindow(3, 0),
    SlidingWindow(2, 5),
    SlidingWindow(4, 1) & Causal(),
    SlidingWindow(0, 0) | Causal(),
]


@pytest.mark.parametrize("pattern", POSITION_PATTERNS, ids=repr)
@pytest.mark.parametrize("q_len,kv_len", [(1, 9), (6, 6), (4, 11), (11, 4)])
def test_a_position_rule_is_the_patterns_element_mask(pattern, q_len, kv_len):
    """positions() at global positions (row i at i + S - L) is the dense mask: the rule
    flex's mask_mod and the paged kernels evaluate."""
    assert pattern.by_position
    q_pos = torch.arange(q_len).view(-1, 1) + causal_shift(q_len, kv_len)
    by_position = pattern.positions(q_pos, torch.arange(kv_len).view(1, -1))
    assert torch.equal(by_position, pattern.dense(q_len, kv_len).view(q_len, kv_len))


def test_patterns_of_more_than_positions_say_so():
    pattern = SlidingWindow(2, 0) | bigbird(4, seed=0)
    assert not pattern.by_position and not bigbird(4).by_position
    with pytest.raises(NotImplementedError, match="not a rule of positions"):
        pattern.positions(torch.zeros(1, 1), torch.zeros(1, 1))


def test_flex_and_the_paged_kernels_ask_the_pattern_for_their_rule():
    """No engine states the window's or the causal comparison again: flex's mask_mod
    and the paged kernels call Pattern.positions."""
    code = source_code()
    for name in ("core/backends/flex.py", "core/kernels/paged.py"):
        assert ". positions (" in code[name] and "causal_allows" not in code[name], name
