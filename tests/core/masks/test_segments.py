"""masks.Segments, the pattern of packed sequences: its element mask is the
block-diagonal of the sequences with causal and window aligned bottom-right in each
(written out here per sequence), its block kinds never call a block FULL or EMPTY that
is not, its triangles are exact, and it plans from the offsets alone."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import expect_error
from mhsa.core.masks import Segments
from mhsa.core.masks.blocks import EMPTY, FULL, reduce_blocks


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()])


def written_out(q_lengths, k_lengths, causal, window) -> torch.Tensor:
    """The (total_q, total_k) mask, one sequence at a time."""
    mask = torch.zeros(sum(q_lengths), sum(k_lengths), dtype=torch.bool)
    r = c = 0
    for lq, lk in zip(q_lengths, k_lengths, strict=True):
        position = torch.arange(lq).view(-1, 1) + lk - lq
        key = torch.arange(lk).view(1, -1)
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= key <= position
        if window is not None:
            left, right = (window, window) if isinstance(window, int) else window
            allowed &= (key - position >= -left) & (key - position <= right)
        mask[r : r + lq, c : c + lk] = allowed
        r, c = r + lq, c + lk
    return mask


def random_case(rng: random.Random):
    count = rng.randint(1, 6)
    q_lengths = [rng.choice([0, 1, 2, 3, 5, 7, 16, 17, 40]) for _ in range(count)]
    k_lengths = (
        q_lengths if rng.random() < 0.5 else [rng.choice([0, 1, 4, 9, 16, 33]) for _ in q_lengths]
    )
    causal = rng.random() < 0.5
    window = rng.choice([None, 1, 3, (2, 0), (0, 2), (5, 1)])
    return q_lengths, k_lengths, causal, window


@pytest.mark.parametrize("seed", range(4))
def test_mask_kinds_and_triangles(seed):
    rng = random.Random(seed)
    for _ in range(60):
        q_lengths, k_lengths, causal, window = random_case(rng)
        pattern = Segments(offsets(q_lengths), offsets(k_lengths), causal=causal, window=window)
        q_len, kv_len = sum(q_lengths), sum(k_lengths)
        want = written_out(q_lengths, k_lengths, causal, window)
        assert torch.equal(pattern.dense(q_len, kv_len), want)
        pieces = pattern.diagonal_pieces(q_len, kv_len)
        assert (pieces is None) == (window is not None)
        if pieces is not None:  # the pieces, drawn, are the mask
            drawn = torch.zeros_like(want)
            for q0, q1, runs in pieces:
                for k0, k1, kind in runs:
                    rows, cols = torch.arange(q1 - q0).view(-1, 1), torch.arange(k1 - k0)
                    tile = cols.view(1, -1) <= rows if kind == "lower" else True
                    drawn[q0:q1, k0:k1] = tile
            assert torch.equal(drawn, want)
        if q_len == 0 or kv_len == 0:
            continue
        block_q, block_k = rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 3, 4, 8, 16])
        exact = reduce_blocks(want, q_len, kv_len, block_q, block_k)
        kinds = pattern.block_layout(q_len, kv_len, block_q, block_k)
        assert not ((kinds == FULL) & (exact != FULL)).any()
        assert not ((kinds == EMPTY) & (exact != EMPTY)).any()
        # a tile said to be a causal triangle is exactly one
        for q0 in range(0, q_len, block_q):
            for k0 in range(0, kv_len, block_k):
                q1, k1 = min(q_len, q0 + block_q), min(kv_len, k0 + block_k)
                if pattern.lower_triangular(q0, q1, k0, k1, q_len, kv_len):
                    rows, cols = torch.arange(q1 - q0).view(-1, 1), torch.arange(k1 - k0)
                    assert torch.equal(want[q0:q1, k0:k1], cols.view(1, -1) <= rows)


def test_self_attention_diagonal_tiles_are_causal_triangles():
    pattern = Segments(offsets([64, 64, 128]), causal=True)
    assert pattern.lower_triangular(0, 64, 0, 64, 256, 256)
    assert pattern.lower_triangular(128, 192, 128, 192, 256, 256)
    assert not pattern.lower_triangular(0, 128, 0, 128, 256, 256)  # two sequences
    assert not Segments(offsets([64]), causal=False).lower_triangular(0, 64, 0, 64, 64, 64)


def test_checks():
    pattern = Segments(offsets([2, 3]))
    assert "the segments cover 5 queries and 5 keys" in expect_error(lambda: pattern.dense(5, 6))
    assert "cu_seqlens_q has 2 segments but cu_seqlens_k has 1" in expect_error(
        lambda: Segments(offsets([2, 3]), offsets([5]))
    )
    assert "window must be None, an int or (left, right)" in expect_error(
        lambda: Segments(offsets([2]), window="wide")
    )
    assert "causal must be True or False" in expect_error(lambda: Segments(offsets([2]), causal=1))
    assert repr(Segments(offsets([2, 3]), causal=True, window=4)) == (
        "Segments(2 segments, causal, window=(4, 4))"
    )
