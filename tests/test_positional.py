"""Positional encodings: exact values, relative-offset properties, permutation equivariance."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import max_error
from mhsa.nn import MultiHeadAttention
from mhsa.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RelativePositionBias,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_slopes,
)
from optional import needs


def test_sinusoidal_exact_values():
    d_model = 7  # odd on purpose
    pe = SinusoidalPositionalEncoding(d_model, max_len=50)
    out = pe(torch.zeros(1, 50, d_model))[0]
    for pos in (0, 1, 13, 49):
        for i in range(d_model):
            angle = pos / 10000 ** ((i - i % 2) / d_model)
            want = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert out[pos, i].item() == pytest.approx(want, abs=1e-6)


def test_sinusoidal_offset_and_overflow():
    pe = SinusoidalPositionalEncoding(8, max_len=10)
    x = torch.randn(2, 4, 8)
    full = pe(torch.zeros(2, 10, 8))
    assert torch.allclose(pe(x, offset=3) - x, full[:, 3:7], atol=1e-6)
    with pytest.raises(ValueError, match="max_len=10"):
        pe(x, offset=7)


def test_learned_embedding_adds_per_position_vectors():
    emb = LearnedPositionalEmbedding(16, 8)
    x = torch.randn(2, 5, 8)
    assert torch.equal(emb(x, offset=2), x + emb.embedding.weight[2:7])
    with pytest.raises(ValueError, match="max_len=16"):
        emb(torch.zeros(1, 17, 8))


def test_rotary_scores_depend_only_on_relative_offset():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16)
    q = q.float()

    def score(m: int, n: int) -> float:
        return (rope(q, offset=m) * rope(k, offset=n)).sum().item()

    for m, n, shift in ((3, 1, 10), (0, 7, 100), (5, 5, 33)):
        assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-4)
    assert score(3, 1) != pytest.approx(score(1, 3), abs=1e-3)


def test_rotary_exact_values_at_known_positions():
    """Pair (c, c + D/2) at position m is rotated by m * base^(-2c/D), counter-clockwise:
    written out channel by channel in float64."""
    dim, base = 8, 10000.0
    x = torch.randn(1, 1, 4, dim)
    positions = [0, 1, 7, 1000]
    got = RotaryEmbedding(dim, base)(x, positions=torch.tensor(positions))
    for row, m in enumerate(positions):
        for c in range(dim // 2):
            angle = m * base ** (-2 * c / dim)
            a, b = x[0, 0, row, c].item(), x[0, 0, row, c + dim // 2].item()
            assert got[0, 0, row, c].item() == pytest.approx(
                a * math.cos(angle) - b * math.sin(angle), abs=2e-5
            )
            assert got[0, 0, row, c + dim // 2].item() == pytest.approx(
                b * math.cos(angle) + a * math.sin(angle), abs=2e-5)  # fmt: skip


def test_rotary_equals_transformers_apply_rotary_pos_emb():
    llama = needs("transformers.models.llama.modeling_llama")
    dim, base = 16, 500000.0
    q, k = torch.randn(2, 3, 9, dim), torch.randn(2, 3, 9, dim)
    offset = 5
    positions = torch.arange(offset, offset + 9, dtype=torch.float32)
    freqs = positions[:, None] * base ** (-torch.arange(0, dim, 2).float() / dim)[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)  # their layout: (L, D), halves repeated
    q_ref, k_ref = llama.apply_rotary_pos_emb(q, k, angles.cos()[None], angles.sin()[None])
    q_ours, k_ours = RotaryEmbedding(dim, base).rotate(q, k, offset=offset)
    assert max_error(q_ours, q_ref) < 1e-5 and max_error(k_ours, k_ref) < 1e-5


def test_rotary_preserves_norm_and_is_identity_at_zero():
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 6, 8)
    rotated = rope(x)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rotated[:, :, 0], x[:, :, 0])
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)


def test_alibi_slopes_for_any_head_count():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 12 heads: the 8-head sequence, then odd positions of the 16-head one
    sixteen = [2.0 ** (-(i + 1) / 2) for i in range(16)]
    want = [2.0 ** -(i + 1) for i in range(8)] + sixteen[0::2][:4]
    assert torch.allclose(alibi_slopes(12), torch.tensor(want))
    assert alibi_slopes(1).tolist() == [2.0**-8]


def test_alibi_bias_is_bottom_right_linear_distance():
    alibi = ALiBi(2)
    bias = alibi.dense_bias(2, 5)  # queries at positions 3 and 4
    assert bias.shape == (2, 2, 5)
    slope = alibi.slopes[0].item()
    assert bias[0, 1].tolist() == pytest.approx([-4 * slope, -3 * slope, -2 * slope, -slope, 0])
    assert bias[0, 0, 4].item() == pytest.approx(-slope)


def test_relative_bias_buckets():
    rel = RelativePositionBias(3, num_buckets=8, max_distance=20, bidirectional=True)
    offsets = torch.tensor([0, -1, -2, -3, 1, 3, -5, -19, -200, 200])
    # per direction 4 buckets: exact 0, 1; log buckets 2 (2..9), 3 (10..); keys after +4
    assert rel.bucket(offsets).tolist() == [0, 1, 2, 2, 5, 6, 2, 3, 3, 7]
    causal = RelativePositionBias(3, num_buckets=4, max_distance=8, bidirectional=False)
    assert causal.bucket(torch.tensor([0, -1, -2, -5, -100, 4])).tolist() == [0, 1, 2, 3, 3, 0]
    bias = rel.dense_bias(4, 6)
    assert bias.shape == (3, 4, 6)
    assert torch.equal(bias[:, 0, 2], rel.embedding.weight[0])  # query at 2, key at 2


def permute_check(mha: MultiHeadAttention, x: torch.Tensor, **kwargs) -> float:
    perm = torch.randperm(x.shape[1])
    return max_error(mha(x[:, perm], **kwargs), mha(x, **kwargs)[:, perm])


def test_self_attention_is_permutation_equivariant_without_positions():
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 9, 16)
    assert permute_check(mha, x) < 1e-5


@pytest.mark.parametrize(
    "position",
    [RotaryEmbedding(4), ALiBi(4), RelativePositionBias(4)],
    ids=["rotary", "alibi", "relative"],
)
def test_positions_break_permutation_equivariance(position):
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 9, 16)
    assert permute_check(mha, x, position=position) > 1e-3


def test_added_encodings_break_permutation_equivariance():
    mha = MultiHeadAttention(16, 4).eval()
    pe = SinusoidalPositionalEncoding(16)
    x = torch.randn(2, 9, 16)
    perm = torch.randperm(9)
    assert max_error(mha(pe(x[:, perm])), mha(pe(x))[:, perm]) > 1e-3
