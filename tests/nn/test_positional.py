"""Positional encodings: exact values, relative-offset properties, permutation equivariance."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import max_error
from mhsa.nn import MultiHeadAttention
from mhsa.nn.positional import (
    ALiBiPosition,
    LearnedPositionalEmbedding,
    RelativeBiasPosition,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_slopes,
    relative_offsets,
    sinusoidal_table,
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
                b * math.cos(angle) + a * math.sin(angle), abs=2e-5
            )


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
    alibi = ALiBiPosition(2)
    bias = alibi.dense_bias(2, 5)  # queries at positions 3 and 4
    assert bias.shape == (2, 2, 5)
    slope = alibi.slopes[0].item()
    assert bias[0, 1].tolist() == pytest.approx([-4 * slope, -3 * slope, -2 * slope, -slope, 0])
    assert bias[0, 0, 4].item() == pytest.approx(-slope)


def test_relative_bias_buckets():
    rel = RelativeBiasPosition(3, num_buckets=8, max_distance=20, bidirectional=True)
    offsets = torch.tensor([0, -1, -2, -3, 1, 3, -5, -19, -200, 200])
    # per direction 4 buckets: exact 0, 1; log buckets 2 (2..9), 3 (10..); keys after +4
    assert rel.bucket(offsets).tolist() == [0, 1, 2, 2, 5, 6, 2, 3, 3, 7]
    causal = RelativeBiasPosition(3, num_buckets=4, max_distance=8, bidirectional=False)
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
    [RotaryEmbedding(4), ALiBiPosition(4), RelativeBiasPosition(4)],
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


# --- argument checks: each names the argument and what it got -----------------------


@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_sizes_must_be_positive_ints_and_say_which(bad):
    cases = [
        (lambda v: SinusoidalPositionalEncoding(v), "d_model"),
        (lambda v: SinusoidalPositionalEncoding(8, max_len=v), "max_len"),
        (lambda v: LearnedPositionalEmbedding(v, 8), "max_len"),
        (lambda v: LearnedPositionalEmbedding(8, v), "d_model"),
        (lambda v: RotaryEmbedding(v), "head_dim"),
        (alibi_slopes, "num_heads"),
        (lambda v: RelativeBiasPosition(v), "num_heads"),
        (lambda v: RelativeBiasPosition(2, max_distance=v), "max_distance"),
    ]
    for build, name in cases:
        with pytest.raises(ValueError, match=rf"^{name} must be an int >= 1, got {bad!r}$"):
            build(bad)


def test_rotary_bases_and_factors_that_make_no_frequencies_are_refused():
    """base 0 gave an infinite frequency, -1 a nan one: the module then output its
    bias alone, silently."""
    for base in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="base must be a finite number > 0"):
            RotaryEmbedding(8, base=base)
    for factor in (0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="rope scaling factor must be a finite number > 0"):
            RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": factor})
    # llama3 took a negative context, yarn raised "math domain error"; a string scaling
    # raised "dictionary update sequence element #0"
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4}
    yarn = {"rope_type": "yarn", "factor": 4.0}
    for scaling in (llama3, yarn):
        for context in (0, -3):
            with pytest.raises(ValueError, match="original_max_position_embeddings must be an int"):
                RotaryEmbedding(8, scaling={**scaling, "original_max_position_embeddings": context})
    with pytest.raises(TypeError, match="rope scaling must be a dict .* got 'linear'"):
        RotaryEmbedding(8, scaling="linear")


def test_a_top_level_original_context_wins_as_in_transformers():
    """Phi-3's convention: original_max_position_embeddings beside rope_scaling, not in it."""
    from mhsa.models.llama import LlamaConfig

    config = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 16,
        "rope_scaling": {"type": "yarn", "factor": 4.0},
    }
    scaling = LlamaConfig.from_hf_config(config).rope_scaling
    assert scaling["original_max_position_embeddings"] == 16  # (was 64)


def test_negative_positions_are_refused():
    """A sinusoidal table once read position -1 as its last row."""
    for module in (SinusoidalPositionalEncoding(8, max_len=16), LearnedPositionalEmbedding(16, 8)):
        with pytest.raises(ValueError, match="positions must be >= 0, got -1"):
            module(torch.zeros(1, 2, 8), positions=torch.tensor([[-1, 0]]))


def test_positions_of_another_shape_or_dtype_and_bad_bases_are_refused():
    """(B, 1) positions broadcast: every token of a row got one position, silently; a
    base of 0 or below made a nan table."""
    for module in (SinusoidalPositionalEncoding(8, max_len=16), LearnedPositionalEmbedding(16, 8)):
        x = torch.zeros(2, 4, 8)
        with pytest.raises(ValueError, match=r"positions must be \(4,\) or \(2, 4\).*got \(2, 1\)"):
            module(x, positions=torch.zeros(2, 1, dtype=torch.long))
        with pytest.raises(TypeError, match="positions must hold integer positions"):
            module(x, positions=torch.zeros(2, 4))
        with pytest.raises(ValueError, match=r"x must be \(batch, length, 8\), got \(2, 4, 6\)"):
            module(torch.zeros(2, 4, 6))
        assert torch.equal(module(x, positions=torch.arange(4)[None]), module(x))
    for base in (0.0, -1.0, float("nan"), "10000"):
        with pytest.raises(ValueError, match="base must be a finite number > 0"):
            SinusoidalPositionalEncoding(8, base=base)


def test_out_of_range_offsets_name_the_positions_and_the_fix():
    pe, emb = SinusoidalPositionalEncoding(8, max_len=10), LearnedPositionalEmbedding(10, 8)
    for module in (pe, emb):
        with pytest.raises(
            ValueError,
            match=r"^positions 7\.\.10 exceed max_len=10; build the encoding with a larger "
            r"max_len$",
        ):
            module(torch.zeros(1, 4, 8), offset=7)
        with pytest.raises(ValueError, match=r"positions -1\.\.1 exceed max_len=10"):
            module(torch.zeros(1, 3, 8), offset=-1)
        module(torch.zeros(1, 4, 8), offset=6)  # the last four positions fit
        big = torch.tensor([[0, 3], [10, 2]])
        with pytest.raises(
            ValueError,
            match=r"^position 10 exceeds max_len=10; build the encoding with a larger max_len$",
        ):
            module(torch.zeros(2, 2, 8), positions=big)


def test_sinusoidal_default_max_len_is_4096():
    pe = SinusoidalPositionalEncoding(4)
    pe(torch.zeros(1, 1, 4), offset=4095)
    with pytest.raises(ValueError, match="max_len=4096"):
        pe(torch.zeros(1, 1, 4), offset=4096)


def test_rotary_rejects_wrong_head_dim_and_positions_shape_with_details():
    rope = RotaryEmbedding(8)
    with pytest.raises(
        ValueError, match=r"^x has head_dim 6 but this RotaryEmbedding was built for 8$"
    ):
        rope(torch.zeros(1, 2, 5, 6))
    with pytest.raises(
        ValueError,
        match=r"^positions must be \(5,\) or \(1, 5\), one per token of x, got \(2, 5\)$",
    ):
        rope(torch.zeros(1, 2, 5, 8), positions=torch.arange(10).view(2, 5))


def test_relative_bias_minimum_bucket_counts():
    RelativeBiasPosition(2, num_buckets=4)  # two per direction: the fewest that work
    RelativeBiasPosition(2, num_buckets=2, bidirectional=False)
    with pytest.raises(ValueError, match=r"^num_buckets must be an int >= 4, got 3$"):
        RelativeBiasPosition(2, num_buckets=3)
    with pytest.raises(ValueError, match=r"^num_buckets must be an int >= 2, got 1$"):
        RelativeBiasPosition(2, num_buckets=1, bidirectional=False)
    with pytest.raises(ValueError, match=r"^num_buckets must be an int >= 4, got True$"):
        RelativeBiasPosition(2, num_buckets=True)


# --- exact values on the paths the tests above do not take ---------------------------


def sinusoid(pos: int, i: int, d_model: int, base: float = 10000.0) -> float:
    angle = pos / base ** ((i - i % 2) / d_model)
    return math.sin(angle) if i % 2 == 0 else math.cos(angle)


def test_sinusoidal_table_is_accurate_far_from_the_origin():
    """The angles are formed in float64: in float32 they would be off by ~1e-3 at 4000."""
    d_model = 6
    table = sinusoidal_table(4096, d_model)  # the default base, 10000
    assert table.dtype == torch.float32 and table.shape == (4096, d_model)
    for pos in (0, 1, 1000, 4095):
        for i in range(d_model):
            assert table[pos, i].item() == pytest.approx(sinusoid(pos, i, d_model), abs=1e-6)


def test_sinusoidal_encoding_uses_its_base():
    pe = SinusoidalPositionalEncoding(4, max_len=8, base=100.0)
    out = pe(torch.zeros(1, 8, 4, dtype=torch.float64))[0]
    want = torch.tensor([[sinusoid(p, i, 4, 100.0) for i in range(4)] for p in range(8)])
    assert max_error(out, want) < 1e-6


@pytest.mark.parametrize("module", ["sinusoidal", "learned"])
def test_added_encodings_at_per_sequence_positions(module):
    """positions (B, L), e.g. a left-padded batch: row b gets the encodings of its own
    positions, which may exceed d_model (the table is indexed by position, not channel)."""
    d_model, max_len = 4, 20
    if module == "sinusoidal":
        enc = SinusoidalPositionalEncoding(d_model, max_len=max_len)
        rows = torch.tensor(
            [[sinusoid(p, i, d_model) for i in range(d_model)] for p in range(max_len)]
        )
    else:
        enc = LearnedPositionalEmbedding(max_len, d_model)
        rows = enc.embedding.weight.detach()
    x = torch.randn(2, 3, d_model)
    positions = torch.tensor([[0, 0, 1], [5, 12, 19]])
    got = enc(x, positions=positions)
    for b in range(2):
        for t in range(3):
            want = x[b, t] + rows[positions[b, t]]
            assert max_error(got[b, t], want) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_outputs_keep_the_input_dtype(dtype):
    x4 = torch.randn(1, 2, 3, 8).to(dtype)
    x3 = x4[0]
    positions = torch.tensor([[0, 2, 1], [3, 0, 1]])
    assert SinusoidalPositionalEncoding(8)(x3).dtype == dtype
    assert SinusoidalPositionalEncoding(8)(x3, positions=positions).dtype == dtype
    assert LearnedPositionalEmbedding(8, 8)(x3).dtype == dtype
    assert RotaryEmbedding(8)(x4).dtype == dtype
    assert RotaryEmbedding(8)(x4, positions=torch.tensor([4, 1, 0])).dtype == dtype


@pytest.mark.parametrize("base", [None, 500.0])
def test_rotary_default_base_and_rotate_default_offset(base):
    """rotate(q, k) without an offset starts at position 0; the default base is 10000."""
    dim = 8
    rope = RotaryEmbedding(dim) if base is None else RotaryEmbedding(dim, base)
    base = 10000.0 if base is None else base
    q, k = torch.randn(1, 2, 3, dim), torch.randn(1, 1, 3, dim)
    for x, got in zip((q, k), rope.rotate(q, k), strict=True):
        for h in range(x.shape[1]):
            for m in range(3):
                for c in range(dim // 2):
                    angle = m * base ** (-2 * c / dim)
                    a, b = x[0, h, m, c].item(), x[0, h, m, c + dim // 2].item()
                    want = a * math.cos(angle) - b * math.sin(angle)
                    assert got[0, h, m, c].item() == pytest.approx(want, abs=1e-5)


def test_rotary_at_fixed_positions_rotates_q_and_k_alike():
    """at(positions) is the rotation of a shard: position p of q and k as in the full
    sequence, whatever `offset` the caller passes."""
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    full_q, full_k = rope.rotate(torch.cat([q, q], 2), torch.cat([k, k], 2))
    q_at, k_at = rope.at(torch.tensor([3, 4, 5])).rotate(q, k, offset=17)
    assert max_error(q_at, full_q[:, :, 3:]) < 1e-5 and max_error(k_at, full_k[:, :, 3:]) < 1e-5


def test_rotary_and_alibi_follow_the_device_of_their_inputs():
    """Positions are made where x (rotary) or the slopes (ALiBi) live: checked on the meta
    device, which needs no GPU and refuses to mix with CPU tensors."""
    meta = torch.device("meta")
    assert RotaryEmbedding(8)(torch.zeros(1, 2, 3, 8, device=meta)).device == meta
    assert ALiBiPosition(2).to(meta).dense_bias(2, 5).device == meta
    assert relative_offsets(2, 5, meta).device == meta


def test_fixed_tables_are_not_saved_in_the_state_dict():
    """Sinusoidal tables, rotary frequencies and ALiBi slopes are recomputed, not loaded:
    their state_dicts are empty, so checkpoints stay small and load across max_len."""
    modules = (SinusoidalPositionalEncoding(8, max_len=16), RotaryEmbedding(8), ALiBiPosition(4))
    for module in modules:
        assert module.state_dict() == {}
        assert len(list(module.buffers())) == 1


def t5_bucket(offset: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5's _relative_position_bucket for one offset (key minus query), in float64."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if offset > 0 else 0
        distance = abs(offset)
    else:
        distance = max(-offset, 0)
    exact = num_buckets // 2
    if distance < exact:
        return bucket + distance
    scale = math.log(distance / exact) / math.log(max_distance / exact)
    return bucket + min(num_buckets - 1, exact + int(scale * (num_buckets - exact)))


def test_relative_bias_defaults_are_t5s():
    rel = RelativeBiasPosition(3)
    assert rel.embedding.weight.shape == (32, 3)  # loads T5's (32, heads) table
    offsets = list(range(-300, 301))
    want = [t5_bucket(o, 32, 128, True) for o in offsets]
    assert rel.bucket(torch.tensor(offsets)).tolist() == want


def test_relative_bias_one_exact_bucket():
    """With a single exact bucket (distance 0), distance 1 starts the log buckets at 1."""
    rel = RelativeBiasPosition(1, num_buckets=3, max_distance=4, bidirectional=False)
    offsets = [0, -1, -2, -3, -4, -100, 5]
    want = [t5_bucket(o, 3, 4, False) for o in offsets]
    assert want == [0, 1, 2, 2, 2, 2, 0]
    assert rel.bucket(torch.tensor(offsets)).tolist() == want
