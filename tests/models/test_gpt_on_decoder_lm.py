"""GPT on DecoderLM: its caches, cache layout and decoding layout are DecoderLM's (a
window as long as the caches keeps plain caches), and GPT-2 loads by the families'
names (GPTConfig.from_hf_config, GPT.from_hf, GPT.from_pretrained)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_greedy, max_error, tiny_hf_gpt2
from mhsa.cache import KVCache, SlidingWindowCache
from mhsa.models import GPT, GPTConfig
from mhsa.models.decoder_lm import DecoderLM
from mhsa.models.graph_step import StaticDecodeStep, fixed_slots_problem


def small(**changes) -> GPT:
    options = dict(vocab_size=61, n_layer=2, n_head=4, d_model=32, max_len=64)
    options.update(changes)
    return GPT(GPTConfig(**options)).eval()


def test_gpt_keeps_no_copy_of_the_caches_or_layouts():
    assert issubclass(GPT, DecoderLM)
    shared = ("make_caches", "cache_layout", "decoding_layout", "fuse_projections", "_positions")
    assert [name for name in shared if name in vars(GPT)] == []
    model = small()
    with pytest.raises(ValueError, match=r"one cache per layer \(2\), got 1"):
        model(torch.tensor([[1, 2]]), caches=model.make_caches(1, 4)[:1])


@pytest.mark.parametrize(
    ("window", "position"), [(40, "learned"), (41, "rotary"), (100, "alibi"), (40, "t5")]
)
def test_a_window_as_long_as_the_caches_keeps_plain_caches(window, position):
    """window >= max_len: every key the caches can hold is in the window, so
    make_caches gives plain KVCaches of max_len, which a ring buffer of `window` slots
    would only have copied in the same order (DecoderLM's rule; GPT made ring buffers).
    Cached decoding equals the full recompute and the ring buffers' logits, and the
    caches have the fixed slots a captured decoding step needs."""
    torch.manual_seed(0)
    model = small(window=window, position=position)
    caches = model.make_caches(2, 40)
    assert all(type(cache) is KVCache and cache.max_len == 40 for cache in caches)
    assert fixed_slots_problem(caches) is None
    layout = model.cache_layout
    rings = [SlidingWindowCache(2, layout.num_kv_heads, window, layout.head_dim) for _ in caches]
    idx = torch.randint(0, 61, (2, 40))
    plain = [model(idx[:, :9], caches=caches)]
    plain += [model(idx[:, t : t + 1], caches=caches) for t in range(9, 40)]
    ring = [model(idx[:, :9], caches=rings)]
    ring += [model(idx[:, t : t + 1], caches=rings) for t in range(9, 40)]
    assert max_error(torch.cat(plain, dim=1), model(idx)) < 1e-5
    assert max_error(torch.cat(plain, dim=1), torch.cat(ring, dim=1)) < 1e-5
    shorter = model.make_caches(2, window + 1)  # one more position than the window
    assert all(isinstance(cache, SlidingWindowCache) for cache in shorter)
    assert shorter[0].k.shape[2] == window and fixed_slots_problem(shorter) is not None


def test_a_window_as_long_as_the_caches_generates_the_tokens_of_no_window():
    model = small(window=64, position="rotary")
    unwindowed = small(position="rotary")
    unwindowed.load_state_dict(model.state_dict())
    prompts = [
        torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)
    ]
    ours = model.generate(prompts, 12, temperature=0)
    assert all(map(torch.equal, ours, unwindowed.generate(prompts, 12, temperature=0)))


def test_a_window_as_long_as_the_caches_decodes_through_the_static_step():
    """Its plain caches have the fixed slots generate's captured step continues (on
    CUDA, where GPT declares graph_decoding): the step's greedy tokens, uncaptured on the
    CPU, are plain decoding's."""
    model = small(window=64, position="rotary")
    prompt = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(2))
    caches = model.make_caches(1, 64)
    got = []
    with torch.no_grad():
        logits = model.prefill(prompt, caches)
        step = StaticDecodeStep(model, caches)
        for _ in range(12):
            got.append(int(logits.argmax(dim=-1)))
            logits = step(torch.tensor([[got[-1]]]))
    full = model.generate(prompt, 12, temperature=0, cuda_graph=False)[0].tolist()
    with torch.no_grad():
        assert_same_greedy(got, full[7:], lambda i: model(torch.tensor([full[: 7 + i]]))[0, -1])


def test_decoding_layout_fuses_every_attention_and_keeps_the_logits():
    model = small(n_kv_head=2)
    idx = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        before = model(idx)
        fast = model.decoding_layout()
        assert all(block.self_attn.qkv_proj is not None for block in fast.blocks)
        assert max_error(fast(idx), before) < 1e-5
        assert fast.cache_layout.dtype == torch.float32


def test_gpt2_loads_from_a_transformers_directory(tmp_path):
    hf = tiny_hf_gpt2(n_inner=80)
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path)
    assert not ours.training
    assert (ours.config.d_model, ours.config.max_len, ours.config.d_ff) == (48, 64, 80)
    idx = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        assert max_error(ours(idx), hf(idx).logits) < 1e-4
        half = GPT.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert half.tok_emb.weight.dtype == torch.bfloat16
    same = GPT.from_hf(hf.state_dict(), ours.config)
    assert all(map(torch.equal, same.state_dict().values(), ours.state_dict().values()))


def test_gpt2_float64_weights_load_exactly_and_an_untied_head_is_refused(tmp_path):
    hf = tiny_hf_gpt2().double()
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path, dtype=torch.float64)  # (went through float32)
    assert torch.equal(ours.tok_emb.weight, hf.transformer.wte.weight)
    idx = torch.randint(0, 101, (1, 12))
    with torch.no_grad():
        assert max_error(ours(idx), hf(idx).logits) < 1e-12
    weights = {**hf.state_dict(), "lm_head.weight": torch.randn_like(hf.lm_head.weight)}
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        GPT.from_hf(weights, ours.config)  # (was used silently with the embedding's head)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, "model_type 'llama' is not GPT-2's"),
        ({"n_embd": None}, r"lacks \['n_embd'\]"),
        ({"activation_function": "mish"}, "activation_function 'mish' \\(one of"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"scale_attn_weights": False}, "scale_attn_weights=False"),
    ],
)
def test_gpt2_configs_gpt_cannot_compute_are_refused(changes, message):
    d = {"model_type": "gpt2", "vocab_size": 50, "n_embd": 16, "n_layer": 1, "n_head": 2}
    d |= {"n_positions": 32, "activation_function": "gelu_new"}
    config = GPTConfig.from_hf_config(d)
    assert (config.d_model, config.activation, config.position) == (16, "gelu_tanh", "learned")
    d = {key: value for key, value in (d | changes).items() if value is not None}
    with pytest.raises(ValueError, match=message):
        GPTConfig.from_hf_config(d)
