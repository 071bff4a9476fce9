"""The output gate (Qwen3-Next's full-attention layers): MultiHeadAttention with
output_gate=True, (1 + w) QK-norms and partial rotary equals transformers'
Qwen3NextAttention, the layer alone with the same weights, forward and gradients."""

from __future__ import annotations

import pytest
import torch

from helpers import max_error
from mhsa.nn import MultiHeadAttention
from mhsa.nn.positional import RotaryEmbedding
from optional import needs

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, PARTIAL, THETA, EPS = 48, 4, 2, 16, 0.25, 10000.0, 1e-6


def qwen3_next_attention(bias: bool):
    """transformers' layer with random weights (its norms' too), eager attention."""
    needs("transformers")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen

    config = Qwen3NextConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        attention_bias=bias,
        rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        partial_rotary_factor=PARTIAL,
        num_hidden_layers=1,
        vocab_size=32,
    )
    config._attn_implementation = "eager"
    layer = qwen.Qwen3NextAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    return layer, qwen.Qwen3NextRotaryEmbedding(config)


def ours_from(layer) -> MultiHeadAttention:
    ours = MultiHeadAttention(
        HIDDEN,
        HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        bias=layer.q_proj.bias is not None,
        qk_norm_eps=EPS,
        qk_norm_unit_offset=True,
        output_gate=True,
    ).eval()
    with torch.no_grad():
        for name in ("weight", "bias"):
            theirs = getattr(layer.q_proj, name)
            if theirs is None:
                continue
            query, gate = MultiHeadAttention.split_query_gate(theirs, HEADS)
            getattr(ours.q_proj, name).copy_(query)
            getattr(ours.gate_proj, name).copy_(gate)
            for mine, their in (("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
                getattr(getattr(ours, mine), name).copy_(getattr(getattr(layer, their), name))
        ours.q_norm.weight.copy_(layer.q_norm.weight)
        ours.k_norm.weight.copy_(layer.k_norm.weight)
    return ours


@pytest.mark.parametrize("bias", [False, True])
def test_equals_transformers_qwen3_next_attention(bias):
    layer, rotary_hf = qwen3_next_attention(bias)
    ours = ours_from(layer)
    batch, length = 2, 13
    x = torch.randn(batch, length, HIDDEN)
    positions = torch.arange(length).expand(batch, length)
    cos, sin = rotary_hf(x, positions)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    additive = torch.zeros(batch, 1, length, length).masked_fill(~causal, torch.finfo().min)
    x_hf = x.clone().requires_grad_()
    want, _ = layer(x_hf, (cos, sin), additive)
    rotary = RotaryEmbedding(HEAD_DIM, THETA, rotary_dim=int(HEAD_DIM * PARTIAL))
    x_ours = x.clone().requires_grad_()
    got = ours(x_ours, causal=True, position=rotary)
    assert max_error(got, want) < 1e-5
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    assert max_error(x_ours.grad, x_hf.grad) < 1e-5
    theirs_q, theirs_gate = MultiHeadAttention.split_query_gate(layer.q_proj.weight.grad, HEADS)
    assert max_error(ours.q_proj.weight.grad, theirs_q) < 1e-5
    assert max_error(ours.gate_proj.weight.grad, theirs_gate) < 1e-5
    for mine, their in (("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
        assert max_error(getattr(ours, mine).weight.grad, getattr(layer, their).weight.grad) < 1e-5
    assert max_error(ours.q_norm.weight.grad, layer.q_norm.weight.grad) < 1e-5
    assert max_error(ours.k_norm.weight.grad, layer.k_norm.weight.grad) < 1e-5


def test_gate_with_a_cache_and_fused_projections_equals_the_full_forward():
    from mhsa.cache import KVCache

    torch.manual_seed(1)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, output_gate=True, qk_norm_eps=1e-6).eval()
    rotary = RotaryEmbedding(8, rotary_dim=4)
    x = torch.randn(2, 9, 32)
    full = mha(x, causal=True, position=rotary)
    cache = KVCache(2, 2, 16, 8)
    steps = [mha(x[:, :5], causal=True, position=rotary, cache=cache)]
    steps += [mha(x[:, i : i + 1], causal=True, position=rotary, cache=cache) for i in range(5, 9)]
    assert max_error(torch.cat(steps, dim=1), full) < 1e-5
    mha.fuse_projections()
    assert max_error(mha(x, causal=True, position=rotary), full) < 1e-5


def test_bad_gate_arguments_are_one_line_errors():
    with pytest.raises(TypeError, match="output_gate must be True or False"):
        MultiHeadAttention(16, 2, output_gate="yes")
    with pytest.raises(ValueError, match="qk_norm_unit_offset needs qk_norm_eps"):
        MultiHeadAttention(16, 2, qk_norm_unit_offset=True)
    with pytest.raises(ValueError, match=r"projection's first axis \(30\) must be"):
        MultiHeadAttention.split_query_gate(torch.zeros(30, 4), 4)
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        MultiHeadAttention.split_query_gate(torch.zeros(32, 4), 0)
