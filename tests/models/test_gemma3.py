"""Gemma 3 (text) against transformers' Gemma3ForCausalLM with random weights: logits on
every CPU backend, greedy tokens, cached decoding with ring-buffer caches for the local
layers, what those caches hold, the switches that make it Gemma 3, config reading and
loading errors.

The tiny config has 7 layers (local x5, global, local: the 5:1 pattern and one more), a
window of 8 under sequences of 20-40 tokens, its own local rotary base and linear
scaling on the global layers, head_dim * heads != hidden and query_pre_attn_scalar !=
head_dim, so that each of them shows if it is wrong.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import mhsa
from helpers import cpu_backends, max_error
from mhsa.cache import KVCache, SlidingWindowCache
from mhsa.models import Gemma3, Gemma3Config
from optional import needs

VOCAB, WINDOW, LENGTH, STOP = 101, 8, 40, 2
LOCAL, GLOBAL = "sliding_attention", "full_attention"
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # 4 x 24 != 64, as in the real models
    query_pre_attn_scalar=32,  # not head_dim
    sliding_window=WINDOW,
    max_position_embeddings=64,
    rope_parameters={
        GLOBAL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        LOCAL: {"rope_type": "default", "rope_theta": 100.0},
    },
    eos_token_id=STOP,
    pad_token_id=STOP,
)
TOL = 1e-5


def make_hf(transformers, **changes):
    """A random-weight Gemma3ForCausalLM in float32, eager attention, its norms away from
    their zero init so that loading any of them wrong shows. (Embeddings of std 0.2 keep
    logits within about 10: 1e-5 is then a few float32 roundings of them, the amount by
    which transformers' own sdpa and eager attention differ here.)"""
    config = transformers.Gemma3TextConfig(**{**TINY, **changes}, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def models():
    """(transformers' model, ours loaded from its state dict)."""
    hf = make_hf(needs("transformers"))
    ours = Gemma3.from_hf(hf.state_dict(), Gemma3Config.from_hf_config(hf.config.to_dict()))
    return hf, ours


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def test_config_reads_the_pattern_bases_and_scale(models):
    hf, ours = models
    c = ours.config
    assert hf.config.layer_types == [LOCAL] * 5 + [GLOBAL, LOCAL]
    assert c.window_layers == (0, 1, 2, 3, 4, 6) and c.sliding_window == WINDOW
    assert [c.windowed(i) for i in range(7)] == [
        hf_layer.self_attn.is_sliding for hf_layer in hf.model.layers
    ]
    assert (c.rope_theta, c.rope_local_theta) == (10000.0, 100.0)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0} and c.rope_local_scaling is None
    assert c.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    assert c.tie_embeddings and ours.lm_head is None and c.eos_token == (STOP,)
    # Gemma3Config's own default: five local layers, then a global one
    assert Gemma3Config(n_layer=12).window_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)


def test_logits_equal_transformers_on_every_cpu_backend(models):
    hf, ours = models
    idx = tokens(2, LENGTH)
    with torch.no_grad():
        expected = hf(idx).logits
    assert expected.abs().max() > 1.0  # logits of a real size, not near zero
    for backend in cpu_backends():
        with mhsa.use_backend(backend):
            assert max_error(ours(idx), expected) < TOL, backend


def test_greedy_tokens_equal_transformers_generate(models):
    hf, ours = models
    prompt = tokens(2, 20, seed=3)  # longer than the window
    with torch.no_grad():
        want = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            do_sample=False,
        )
    assert want.shape[1] == 32  # no early stop: all 12 tokens compared
    assert torch.equal(ours.generate(prompt, 12, temperature=0), want)


def test_cached_decoding_equals_full_recompute(models):
    _, ours = models
    idx = tokens(2, LENGTH)
    full = ours(idx)
    caches = ours.make_caches(2, LENGTH)
    steps = [ours(idx[:, :11], caches=caches)]  # a prefill longer than the window
    steps += [ours(idx[:, t : t + 1], caches=caches) for t in range(11, 30)]
    steps += [ours(idx[:, 30:], caches=caches)]  # a multi-token step after decoding
    assert max_error(torch.cat(steps, dim=1), full) < TOL
    # left-padded prompts decoded together equal each decoded alone
    prompts = [tokens(1, n, seed=n)[0] for n in (5, 13, 20)]
    together = ours.generate(prompts, 10, temperature=0, eos_token=[])
    for prompt, got in zip(prompts, together, strict=True):
        assert torch.equal(
            got, ours.generate(prompt.view(1, -1), 10, temperature=0, eos_token=[])[0]
        )
    uncached = ours.generate(prompts, 10, temperature=0, eos_token=[], use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(together, uncached, strict=True))


def test_local_layer_caches_hold_only_the_window(models):
    """Each local layer keeps `window` positions however long the sequence grows (the
    newest ones, in ring slots position % window); each global layer keeps them all.
    (Keys of later layers match to rounding: the layers below attended over keys in
    another order.)"""
    _, ours = models
    c, max_len, prefill, new = ours.config, 64, 20, 9
    caches = ours.make_caches(2, max_len)
    whole = [KVCache(2, 2, max_len, c.head_width) for _ in range(c.n_layer)]  # every position
    idx = tokens(2, prefill + new)
    for kept in (caches, whole):
        ours.prefill(idx[:, :prefill], kept)
        for t in range(prefill, prefill + new):
            ours.step(idx[:, t : t + 1], kept)
    length = prefill + new
    newest = torch.arange(length - WINDOW, length)
    for i, (cache, reference) in enumerate(zip(caches, whole, strict=True)):
        assert cache.length == length
        if c.windowed(i):
            assert isinstance(cache, SlidingWindowCache)
            assert cache.k.shape == cache.v.shape == (2, 2, WINDOW, 24)
            assert max_error(cache.k[:, :, newest % WINDOW], reference.k[:, :, newest]) < TOL
            assert max_error(cache.v[:, :, newest % WINDOW], reference.v[:, :, newest]) < TOL
        else:
            assert type(cache) is KVCache and cache.k.shape == (2, 2, max_len, 24)
    local_bytes = sum(
        x.nbytes for i, cache in enumerate(caches) if c.windowed(i) for x in (cache.k, cache.v)
    )
    assert local_bytes == 6 * 2 * (2 * 2 * WINDOW * 24 * 4)  # 6 local layers, k and v, float32


def test_bfloat16_errs_no_more_than_transformers_and_decoding_layout_is_exact(models):
    hf, ours = models
    idx = tokens(2, LENGTH)
    ours16 = Gemma3.from_hf(hf.state_dict(), ours.config, dtype=torch.bfloat16)
    with torch.no_grad():
        exact = hf(idx).logits
        theirs = max_error(copy.deepcopy(hf).to(torch.bfloat16)(idx).logits, exact)
        assert max_error(ours16(idx), exact) <= 2 * theirs + 1e-2
        fast = copy.deepcopy(ours).decoding_layout()  # fused, transposed weights (mhsa chat)
        assert max_error(fast(idx), ours(idx)) < TOL
    prompt = idx[:1, :20]
    assert torch.equal(
        fast.generate(prompt, 6, temperature=0), ours.generate(prompt, 6, temperature=0)
    )


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": None},  # every layer global
        {"window_layers": tuple(range(7))},  # no global layer
        {"rope_local_theta": 10000.0},  # the global base on local layers
        {"rope_scaling": None},  # the global layers unscaled
        {"query_pre_attn_scalar": None},  # the scale 1/sqrt(head_dim)
        {"norm_eps": 1e-1},
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_switch_matters(models, change):
    """The comparisons above cannot pass vacuously: a model without any one of Gemma 3's
    features, on the same weights, is far from transformers."""
    hf, ours = models
    changed = Gemma3.from_hf(hf.state_dict(), replace(ours.config, **change))
    idx = tokens(2, LENGTH)
    with torch.no_grad():
        assert max_error(changed(idx), hf(idx).logits) > 1e-2


def test_an_attention_softcap_in_a_gemma3_config_is_not_applied():
    """transformers' Gemma 3 keeps attn_logit_softcapping but never applies it (Gemma 2
    does): the logits are transformers'."""
    hf = make_hf(needs("transformers"), attn_logit_softcapping=2.0)
    ours = Gemma3.from_hf(hf.state_dict(), Gemma3Config.from_hf_config(hf.config.to_dict()))
    assert ours.config.attn_softcap is None
    idx = tokens(1, LENGTH)
    with torch.no_grad():
        assert max_error(ours(idx), hf(idx).logits) < TOL  # (was 0.72)


def test_from_hf_config_reads_transformers_4_layout():
    """config.json of transformers 4: the bases at the top (rope_theta,
    rope_local_base_freq), the global scaling in rope_scaling, sliding_window_pattern."""
    transformers = needs("transformers")
    old = {
        **{k: v for k, v in TINY.items() if k != "rope_parameters"},
        "model_type": "gemma3_text",
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 3,
    }
    config = Gemma3Config.from_hf_config(old)
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.window_layers == (0, 1, 3, 4, 6)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    assert Gemma3Config.from_hf_config(theirs.to_dict()) == config  # as transformers reads it


def test_from_pretrained_reads_config_and_safetensors(models, tmp_path):
    hf, _ = models
    hf.save_pretrained(tmp_path)
    ours = Gemma3.from_pretrained(tmp_path)
    idx = tokens(1, 20)
    with torch.no_grad():
        assert max_error(ours(idx), hf(idx).logits) < TOL


def one_line_error(call, *args, **kwargs) -> str:
    """The message of the ValueError call(*args, **kwargs) raises, checked one line."""
    with pytest.raises(ValueError) as error:
        call(*args, **kwargs)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_loading_errors_name_the_tensor(models):
    hf, ours = models
    sd, config = hf.state_dict(), ours.config
    post = "model.layers.3.post_feedforward_layernorm.weight"
    missing = one_line_error(Gemma3.from_hf, {k: v for k, v in sd.items() if k != post}, config)
    assert f"1 tensor missing: '{post}'" in missing
    extra = one_line_error(
        Gemma3.from_hf, {**sd, "model.layers.0.mlp.gate.weight": sd[post]}, config
    )
    assert "1 unexpected tensor: 'model.layers.0.mlp.gate.weight'" in extra
    bad = {**sd, "model.layers.6.self_attn.k_norm.weight": torch.zeros(16)}
    shape = one_line_error(Gemma3.from_hf, bad, config)
    assert "k_norm.weight' has shape (16,), but this config implies (24,)" in shape
    assert "(for layers.6.attn.k_norm.weight)" in shape
    no_qk_norm = one_line_error(Gemma3.from_hf, sd, replace(config, qk_norm=False))
    assert "14 unexpected tensors: 'model.layers.0.self_attn.q_norm.weight'" in no_qk_norm


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sliding_window": 0}, "sliding_window must be"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a finite number > 0"),
        ({"rope_local_theta": -1.0}, "rope_local_theta must be a finite number > 0"),
        ({"final_softcap": float("inf")}, "final_softcap must be a finite number > 0"),
        ({"window_layers": (7,)}, r"window_layers must be layer indices in 0..6, got \[7\]"),
        ({"rope_local_scaling": {"rope_type": "longrope"}}, "'longrope' is not supported"),
        ({"rope_local_scaling": {"rope_type": "linear"}}, r"'linear' needs \['factor'\]"),
    ],
)
def test_bad_configs_raise_one_line_errors(change, message):
    assert_match(one_line_error(Gemma3Config, **{"n_layer": 7, **change}), message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma3"}, "multimodal Gemma 3 .*pass a gemma3_text config"),
        ({"model_type": "gemma"}, "model_type 'gemma' is not supported by Gemma3"),
        ({"layer_types": [LOCAL] * 6}, "layer_types must name 7 layers"),
        ({"layer_types": [LOCAL] * 6 + ["chunked_attention"]}, "each one of"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"hidden_activation": "relu2"}, "hidden_activation 'relu2' is not supported"),
        ({"num_attention_heads": None}, None),
    ],
)
def test_bad_hf_configs_raise_one_line_errors(change, message):
    d = {**TINY, "model_type": "gemma3_text", **change}
    if message is None:  # a key the model cannot do without
        d = {k: v for k, v in d.items() if k != "num_attention_heads"}
        message = r"lacks \['num_attention_heads'\]"
    assert_match(one_line_error(Gemma3Config.from_hf_config, d), message)


def assert_match(text: str, pattern: str) -> None:
    import re

    assert re.search(pattern, text), (pattern, text)
