"""MultiHeadAttention: equivalence with torch.nn.MultiheadAttention, GQA, cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mhsa
from helpers import cpu_backends, max_error
from mhsa.nn import MultiHeadAttention, from_torch_masks


def torch_mha(embed_dim=32, num_heads=4, **kwargs) -> nn.MultiheadAttention:
    module = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True, **kwargs).eval()
    with torch.no_grad():  # non-zero biases so that copying them is tested
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module


@pytest.mark.parametrize("backend", cpu_backends())
def test_self_attention_matches_torch_with_masks(backend):
    theirs = torch_mha()
    ours = MultiHeadAttention.from_torch(theirs, backend=backend).eval()
    x = torch.randn(3, 11, 32)
    attn_mask = torch.rand(11, 11) > 0.7  # torch: True = masked
    attn_mask.fill_diagonal_(False)
    padding = torch.zeros(3, 11, dtype=torch.bool)
    padding[1, 8:] = True
    padding[2, 10:] = True
    expected, expected_w = theirs(x, x, x, attn_mask=attn_mask, key_padding_mask=padding)
    mask, kpm, bias = from_torch_masks(attn_mask, padding)
    assert bias is None
    out = ours(x, mask=mask, key_padding_mask=kpm)
    out_w, weights = ours(x, mask=mask, key_padding_mask=kpm, need_weights=True)
    assert max_error(out, expected) < 1e-5
    assert max_error(out_w, expected) < 1e-5
    assert max_error(weights, expected_w) < 1e-5


def test_cross_attention_with_kdim_vdim_and_float_mask():
    theirs = torch_mha(32, 4, kdim=20, vdim=12)
    ours = MultiHeadAttention.from_torch(theirs).eval()
    query, key, value = torch.randn(2, 5, 32), torch.randn(2, 9, 20), torch.randn(2, 9, 12)
    float_mask = torch.randn(5, 9)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, 6:] = True
    expected, expected_w = theirs(query, key, value, attn_mask=float_mask, key_padding_mask=padding)
    mask, kpm, bias = from_torch_masks(float_mask, padding)
    assert mask is None and bias is not None
    out, weights = ours(query, key, value, key_padding_mask=kpm, bias=bias, need_weights=True)
    assert max_error(out, expected) < 1e-5
    assert max_error(weights, expected_w) < 1e-5
    assert max_error(ours(query, key, value, key_padding_mask=kpm, bias=bias), expected) < 1e-5
    out_b, weights = ours(query, key, value, key_padding_mask=kpm, need_weights=True)
    expected_b, expected_wb = theirs(query, key, value, key_padding_mask=padding)
    assert max_error(out_b, expected_b) < 1e-5 and max_error(weights, expected_wb) < 1e-5
    # the map needs no values: without them it once projected the keys as values (20 != 12)
    mapped = ours.attention_map(query, key, key_padding_mask=kpm).mean(dim=1)
    assert max_error(mapped, expected_wb) < 1e-5


def test_integer_masks_are_refused_not_added():
    """A uint8 key padding mask (or causal attn_mask) became a bias of +0/+1 that favoured
    the masked keys (0.71 off torch's bool mask); torch refuses it too."""
    padding = torch.zeros(2, 9, dtype=torch.uint8)
    for attn_mask, key_padding_mask, name in (
        (None, padding, "key_padding_mask"),
        (torch.ones(5, 9, dtype=torch.uint8).triu(1), None, "attn_mask"),
    ):
        with pytest.raises(TypeError, match=rf"{name} must be bool .* \.bool\(\)"):
            from_torch_masks(attn_mask, key_padding_mask)
    with pytest.raises(TypeError, match="attn_mask must be a tensor or None, got list"):
        from_torch_masks([[True]], None)
    # a mask for other lengths beside a key padding mask: torch's broadcast error once
    layer = MultiHeadAttention(16, 4).eval()
    x, padding = torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask of shape \(5, 6\) does not broadcast with"):
        layer(x, mask=torch.ones(5, 6, dtype=torch.bool), key_padding_mask=padding)


def test_per_head_weights_and_batch_first_false_source():
    theirs = nn.MultiheadAttention(16, 2).eval()  # sequence-first
    ours = MultiHeadAttention.from_torch(theirs).eval()
    x = torch.randn(7, 3, 16)  # (L, B, E) for torch
    expected, expected_w = theirs(x, x, x, average_attn_weights=False)
    out, weights = ours(x.transpose(0, 1), need_weights=True, average_weights=False)
    assert max_error(out.transpose(0, 1), expected) < 1e-5
    assert weights.shape == (3, 2, 7, 7) and max_error(weights, expected_w) < 1e-5


def test_grouped_query_heads_match_repeated_kv_heads():
    gqa = MultiHeadAttention(32, 8, num_kv_heads=2).eval()
    full = MultiHeadAttention(32, 8).eval()
    with torch.no_grad():  # expand each kv head's projection to its 4 query heads
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            small, big = getattr(gqa, name), getattr(full, name)
            big.weight.copy_(small.weight.view(2, 1, 4, 32).expand(2, 4, 4, 32).reshape(32, 32))
            big.bias.copy_(small.bias.view(2, 1, 4).expand(2, 4, 4).reshape(32))
    x = torch.randn(2, 9, 32)
    assert gqa.k_proj.out_features == 8
    assert max_error(gqa(x, causal=True), full(x, causal=True)) < 1e-5


@pytest.mark.parametrize(
    "position",
    [None, mhsa.nn.positional.RotaryEmbedding(8), mhsa.nn.positional.ALiBiPosition(4)],
    ids=["none", "rotary", "alibi"],
)
def test_cached_decoding_equals_full_recompute(position):
    mha = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 12, 32)
    full = mha(x, causal=True, position=position)
    cache = mhsa.KVCache(2, 2, 16, 8)
    steps = [mha(x[:, :5], causal=True, position=position, cache=cache)]  # prefill
    steps += [
        mha(x[:, t : t + 1], causal=True, position=position, cache=cache) for t in range(5, 12)
    ]
    assert cache.length == 12
    assert max_error(torch.cat(steps, dim=1), full) < 1e-5


def test_cache_overflow_is_a_clear_error():
    cache = mhsa.KVCache(1, 2, 4, 8)
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match="overflow.*max_len 4"):
        cache.update(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    assert cache.length == 3


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiHeadAttention(32, 4, num_kv_heads=3)
    for options, name in (({"num_heads": 4.0}, "num_heads"), ({"num_heads": True}, "num_heads")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            MultiHeadAttention(32, **options)  # (a torch error naming no argument, or 1 head)
    with pytest.raises(ValueError, match="num_kv_heads must be an int >= 1"):
        MultiHeadAttention(32, 4, num_kv_heads=2.0)
    mha = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match="query must be"):
        mha(torch.randn(5, 32))
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        mha(torch.randn(2, 5, 32), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    # with a pattern, a float or misshaped key_padding_mask was read as lengths or as
    # another batch size; a float mask beside key padding raised inside torch's `&`
    x, padding = torch.randn(2, 5, 32), torch.ones(2, 5, dtype=torch.bool)
    window = mhsa.masks.SlidingWindow(2, 0)
    for bad in (torch.zeros(2, 5), torch.ones(3, 5, dtype=torch.bool), torch.tensor([5, 3])):
        with pytest.raises(ValueError, match=r"key_padding_mask must be bool .* \(2, 5\)"):
            mha(x, mask=window, key_padding_mask=bad)
    with pytest.raises(TypeError, match="mask must have dtype torch.bool .* bias="):
        mha(x, mask=torch.zeros(5, 5), key_padding_mask=padding)


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_module_gradients_match_reference_backend(backend):
    """Through the module, grad_out reaches the backend as a non-contiguous view."""
    torch.manual_seed(0)
    ours = MultiHeadAttention(32, 8, num_kv_heads=2, backend=backend)
    ref = MultiHeadAttention(32, 8, num_kv_heads=2, backend="reference")
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 37, 32)
    padding = torch.ones(2, 37, dtype=torch.bool)
    padding[1, 30:] = False
    for module in (ours, ref):
        module(x, causal=True, key_padding_mask=padding).square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert max_error(p.grad, q.grad) < 1e-4, name


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"embed_dim": -8}, "embed_dim must be an int >= 1"),
        ({"dropout": 1.5}, "dropout must be"),
        ({"kdim": 0}, "kdim must be an int >= 1"),
    ],
)
def test_module_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**{"embed_dim": 16, "num_heads": 2, **options})


def test_head_dim_scale_and_score_options():
    """head_dim with H * D != E, a scale of its own and a score function after the
    position's: the same as mhsa.attention called with them."""
    torch.manual_seed(0)
    position = mhsa.nn.positional.ALiBiPosition(4)
    mha = MultiHeadAttention(
        16,
        4,
        num_kv_heads=2,
        head_dim=6,
        scale=0.3,
        score=mhsa.core.scores.Softcap(2.0),
        backend="flash",
    )
    assert mha.q_proj.weight.shape == (24, 16) and mha.out_proj.weight.shape == (16, 24)
    x = torch.randn(2, 9, 16)
    q = mha.q_proj(x).view(2, 9, 4, 6).transpose(1, 2)
    k = mha.k_proj(x).view(2, 9, 2, 6).transpose(1, 2)
    v = mha.v_proj(x).view(2, 9, 2, 6).transpose(1, 2)
    score = [position.score(), mhsa.core.scores.Softcap(2.0)]
    out = mhsa.attention(q, k, v, causal=True, scale=0.3, score=score, backend="reference")
    expected = mha.out_proj(out.transpose(1, 2).reshape(2, 9, 24))
    assert max_error(mha(x, causal=True, position=position), expected) < 1e-5
    weights = mhsa.attention_weights(q, k, causal=True, scale=0.3, score=score)
    assert max_error(mha.attention_map(x, causal=True, position=position), weights) < 1e-5
    _, averaged = mha(x, causal=True, position=position, need_weights=True)
    assert max_error(averaged, weights.mean(dim=1)) < 1e-5
    with pytest.raises(TypeError, match="score must be an mhsa.core.scores function"):
        MultiHeadAttention(16, 4, score=lambda s: s)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        MultiHeadAttention(16, 4, scale=0.0)
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        MultiHeadAttention(16, 4, head_dim=0)


def test_module_inputs_are_checked():
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"query must be \(batch, length, 16\), got \(2, 5, 12\)"):
        mha(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r"key must be \(batch, length, 16\), got \(5, 16\)"):
        mha(x, torch.randn(5, 16))
    with pytest.raises(TypeError, match="query is torch.float64 but the module's weights are"):
        mha(x.double())


def test_zero_head_dim_is_a_clear_error():
    q = torch.randn(1, 2, 3, 0)
    with pytest.raises(ValueError, match="head_dim 0: both must be >= 1"):
        mhsa.attention(q, q, q)
