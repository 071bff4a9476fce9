"""Decoding layouts (mhsa.nn.layout): transposed float weights and fused projections
compute what the layers they replace compute, on their own and inside a Llama with a
KV cache."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import assert_same_greedy, max_error
from mhsa.models.llama import Llama, LlamaConfig
from mhsa.nn import GatedFeedForward, MultiHeadAttention
from mhsa.nn.layout import TransposedEmbedding, TransposedLinear, fuse_linears
from mhsa.nn.quantized import Int4Linear, Int8Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7)])
def test_transposed_linear_equals_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=bias)
    moved = TransposedLinear.from_linear(linear)
    x = torch.randn(*shape, 40)
    assert moved.weight_t.is_contiguous() and torch.equal(moved.weight, linear.weight)
    want = linear(x)
    assert max_error(moved(x), want) <= 1e-6 * want.abs().max()


def test_transposed_embedding_looks_up_and_projects_like_the_table():
    torch.manual_seed(0)
    table = nn.Embedding(50, 16)
    moved = TransposedEmbedding.from_embedding(table)
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    assert torch.equal(moved(ids), table(ids))
    x = torch.randn(2, 16)
    want = x @ table.weight.T
    assert max_error(x @ moved.weight.T, want) <= 1e-6 * want.abs().max()


def _int4(rows: int) -> Int4Linear:
    return Int4Linear.from_float(torch.randn(rows, 64))


@pytest.mark.parametrize(
    "make",
    [
        lambda rows: nn.Linear(64, rows, bias=rows == 32),  # missing biases are zeros
        lambda rows: TransposedLinear.from_linear(nn.Linear(64, rows, bias=False)),
        _int4,
        lambda rows: Int8Linear.from_float(torch.randn(rows, 64), torch.randn(rows)),
    ],
    ids=["linear", "transposed", "int4", "int8"],
)
def test_fused_layers_give_the_outputs_side_by_side(make):
    torch.manual_seed(0)
    layers = [make(32), make(16), make(16)]
    fused = fuse_linears(layers)
    x = torch.randn(2, 3, 64)
    want = torch.cat([layer(x) for layer in layers], dim=-1)
    assert max_error(fused(x), want) <= 1e-5 * want.abs().max()


def test_fusing_refuses_mixed_kinds_and_widths():
    with pytest.raises(ValueError, match="one kind and one input width"):
        fuse_linears([nn.Linear(64, 16), Int8Linear.from_float(torch.randn(16, 64))])
    with pytest.raises(ValueError, match="one kind and one input width"):
        fuse_linears([nn.Linear(64, 16), nn.Linear(32, 16)])


def test_fused_attention_equals_separate_projections_with_a_cache():
    torch.manual_seed(0)
    attn = MultiHeadAttention(48, 6, num_kv_heads=2, bias=True, qk_norm_eps=1e-6).eval()
    fused = MultiHeadAttention(48, 6, num_kv_heads=2, bias=True, qk_norm_eps=1e-6).eval()
    fused.load_state_dict(attn.state_dict())
    assert fused.fuse_projections() and fused.q_proj is None
    x = torch.randn(2, 5, 48)
    from mhsa.cache import KVCache

    caches = [KVCache(2, 2, 8, 8), KVCache(2, 2, 8, 8)]
    with torch.no_grad():
        for part in (x[:, :4], x[:, 4:]):
            want = attn(part, causal=True, cache=caches[0])
            got = fused(part, causal=True, cache=caches[1])
            assert max_error(got, want) <= 1e-6
    with pytest.raises(ValueError, match="self-attention only"):
        fused(x, torch.randn(2, 3, 48))


def test_cross_attention_widths_do_not_fuse():
    attn = MultiHeadAttention(32, 4, kdim=16, vdim=16)
    with pytest.raises(ValueError, match="kdim, vdim"):
        attn.fuse_projections()


def test_fused_gated_feed_forward_equals_separate():
    torch.manual_seed(0)
    ff = GatedFeedForward(24, 40, activation="silu")
    x = torch.randn(3, 24)
    want = ff(x)
    assert ff.fuse_projections() and ff.gate is None
    assert max_error(ff(x), want) <= 1e-6


def test_a_llama_in_the_decoding_layout_decodes_the_same_tokens():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, tie_embeddings=True
    )
    model = Llama(config).eval()
    prompt = torch.randint(0, 96, (1, 7))
    want_logits = model(prompt)
    want = model.generate(prompt, 12, temperature=0.0, eos_token=[])[0]
    reference = copy.deepcopy(model)
    model.decoding_layout()
    assert type(model.embed).__name__ == "TransposedEmbedding"
    assert max_error(model(prompt), want_logits) <= 1e-5
    got = model.generate(prompt, 12, temperature=0.0, eos_token=[])[0]
    assert_same_greedy(
        got.tolist(), want.tolist(), lambda i: reference(want[:i].view(1, -1))[0, -1]
    )


def test_a_gpt_in_the_decoding_layout_decodes_the_same_tokens():
    from mhsa.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_len=64)).eval()
    prompts = [torch.randint(0, 96, (7,)), torch.randint(0, 96, (4,))]  # left-padded
    want = model.generate(prompts, 12, temperature=0.0)
    want_logits = model(prompts[0].view(1, -1))
    reference = copy.deepcopy(model)
    model.decoding_layout()
    assert model.blocks[0].self_attn.qkv_proj is not None
    assert max_error(model(prompts[0].view(1, -1)), want_logits) <= 1e-5
    got = model.generate(prompts, 12, temperature=0.0)
    for g, w in zip(got, want, strict=True):
        assert_same_greedy(
            g.tolist(), w.tolist(), lambda i, w=w: reference(w[:i].view(1, -1))[0, -1]
        )
