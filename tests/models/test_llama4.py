"""Llama 4 (text) against transformers' Llama4ForCausalLM with random weights: chunked
rope layers with QK L2-norm, global NoPE layers with temperature tuning, dense and
mixture-of-experts feed-forwards; logits, greedy tokens, cached decoding, left padding."""

from __future__ import annotations

import pytest
import torch

from helpers import max_error
from mhsa.core.masks import Chunked
from mhsa.models.llama4 import Llama4, Llama4Config
from optional import needs

VOCAB, LENGTH, CHUNK, STOPS = 101, 40, 8, [2, 5]
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,  # each expert's
    intermediate_size_mlp=96,  # the dense layers'
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    attention_chunk_size=CHUNK,
    no_rope_layer_interval=2,  # layers 1 and 3 global NoPE, 0 and 2 chunked rope
    interleave_moe_layer_step=2,  # layers 1 and 3 MoE, 0 and 2 dense
    num_local_experts=4,
    num_experts_per_tok=2,
    floor_scale=4,  # the temperature grows within these 40 tokens
    attn_scale=0.5,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=STOPS,
    pad_token_id=0,
)


def pair(**changes):
    """(transformers' Llama4ForCausalLM, ours) with the same random weights."""
    transformers = needs("transformers")
    config = transformers.Llama4TextConfig(**{**TINY, **changes}, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():  # random norms, sharp attention: loading errors show
        for key, p in hf.named_parameters():
            if "norm" in key:
                p.add_(0.2 * torch.randn_like(p))
            if key.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
            if "experts" in key or "router" in key:
                p.normal_(0.0, 0.08)
            if key == "lm_head.weight":  # logits of a few units
                p.mul_(4.0)
    ours = Llama4.from_hf(hf.state_dict(), Llama4Config.from_hf_config(hf.config.to_dict()))
    return hf, ours


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_logits_and_greedy_tokens_equal_transformers():
    hf, ours = pair()
    c = ours.config
    assert c.nope_layers == (1, 3) and c.moe_layers == (1, 3) and c.chunk_size == CHUNK
    idx = tokens(2, LENGTH)
    with torch.no_grad():
        expected = hf(idx).logits
        got = ours(idx)
    assert max_error(got, expected) < 1e-5
    prompt = idx[:, :13]
    with torch.no_grad():
        want = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=STOPS[0],
        )
    assert torch.equal(ours.generate(prompt, 24, temperature=0), want)


def test_without_qk_norm_temperature_moe_or_chunks():
    """The 128E-style switches: no QK-norm, no temperature tuning, MoE off; and no
    chunks (every layer global)."""
    hf, ours = pair(
        use_qk_norm=False,
        attn_temperature_tuning=False,
        moe_layers=[],
        num_hidden_layers=3,
        attention_chunk_size=None,
    )
    assert ours.config.moe_layers == () and not ours.config.qk_norm
    assert ours.config.chunk_size is None
    idx = tokens(1, 27)
    with torch.no_grad():
        assert max_error(ours(idx), hf(idx).logits) < 1e-5
    # without chunks, speculative decoding runs over a paged cache (was an AttributeError)
    from mhsa.models.speculative import PromptLookup

    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    plain = ours.generate(prompt, 8, temperature=0)
    assert torch.equal(ours.generate(prompt, 8, temperature=0, speculate=PromptLookup()), plain)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_yarn_scaling_equals_transformers_with_and_without_the_qk_norm(qk_norm):
    """transformers norms q and k after rotating them, which takes YaRN's attention
    factor back out: ours (norm first) applied it, logits 0.07 to 1.9 off."""
    yarn = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}
    hf, ours = pair(
        rope_parameters={**yarn, "original_max_position_embeddings": 16}, use_qk_norm=qk_norm
    )
    idx = tokens(1, LENGTH)
    with torch.no_grad():  # (float32 rounding of the norm's place: 1.1e-5)
        assert max_error(ours(idx), hf(idx).logits) < 5e-5


def test_a_multimodal_checkpoint_gives_its_text_model(tmp_path):
    """The Hub's Llama 4 (Scout, Maverick) are Llama4ForConditionalGeneration: their
    text model, language_model.*, once failed with 45 tensors missing and 71 unexpected."""
    transformers = needs("transformers")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    vision.update(intermediate_size=48, image_size=28, patch_size=14, vision_output_dim=64)
    vision.update(projector_input_dim=64, projector_output_dim=64)
    config = transformers.Llama4Config(
        text_config=TINY, vision_config=vision, attn_implementation="eager"
    )
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if "norm" in key or "experts" in key or "router" in key:
                p.add_(0.2 * torch.randn_like(p))
    hf.generation_config.eos_token_id = [*STOPS, 7]  # (the text config's ids are elsewhere)
    hf.save_pretrained(tmp_path)
    ours = Llama4.from_pretrained(tmp_path)
    assert ours.config.eos_token == (*STOPS, 7)
    idx = tokens(2, 21)
    with torch.no_grad():
        assert max_error(ours(idx), hf(input_ids=idx).logits) < 1e-5


def test_chunked_layers_refuse_speculation_and_compile_and_hidden_act_defaults_to_silu():
    _, ours = pair(num_hidden_layers=2)
    from mhsa.models.speculative import PromptLookup

    with pytest.raises(ValueError, match="paged keys takes no Chunked pattern"):
        ours.generate(tokens(1, 10), 4, temperature=0, speculate=PromptLookup())
    # (torch.compile's data-dependent-guard error from inside the step, once)
    with pytest.raises(ValueError, match="compile=True .*Chunked layers need each query's"):
        ours.generate(tokens(1, 10), 4, temperature=0, compile=True)
    d = {**TINY, "model_type": "llama4_text"}  # (transformers' default, left out of the file)
    assert Llama4Config.from_hf_config(d).activation == "silu"


def test_each_part_matters():
    """Dropping the chunks, the temperature or the q/k permutation changes the logits:
    the tiny config exercises them all."""
    hf, ours = pair()
    idx = tokens(1, LENGTH)
    with torch.no_grad():
        expected = hf(idx).logits
        for change in ("chunk_size", "temperature_tuning"):
            config = Llama4Config(
                **{**vars(ours.config), change: None if "chunk" in change else False}
            )
            other = Llama4.from_hf(hf.state_dict(), config)
            assert max_error(other(idx), expected) > 1e-3, change
        ours.layers[0].attn.q_proj.weight.copy_(hf.model.layers[0].self_attn.q_proj.weight)
        ours.layers[0].attn.k_proj.weight.copy_(hf.model.layers[0].self_attn.k_proj.weight)
        assert max_error(ours(idx), expected) > 1e-3


def test_cached_decoding_and_left_padding_equal_the_full_forward():
    _, ours = pair()
    idx = tokens(2, 30, seed=3)
    with torch.no_grad():
        full = ours(idx)
        caches = ours.make_caches(2, 30)  # chunked layers: a ring of the last chunk
        assert [cache.k.shape[2] for cache in caches] == [CHUNK, 30, CHUNK, 30]
        steps = [ours(idx[:, :11], caches=caches)]
        steps += [ours(idx[:, i : i + 1], caches=caches) for i in range(11, 30)]
        assert max_error(torch.cat(steps, dim=1), full) < 1e-5
        # row 1 left-padded by 5: its real tokens get the logits they get alone
        padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), idx[1:, :25]], dim=1)
        batch = torch.cat([idx[:1], padded])
        start = torch.tensor([0, 5])
        alone = ours(idx[1:, :25])
        assert max_error(ours(batch, start=start)[1, 5:], alone[0]) < 1e-5
        caches = ours.make_caches(2, 34)
        logits = ours.prefill(batch, caches, start=start)
        assert max_error(logits[1], alone[0, -1]) < 1e-5
        step = ours.step(torch.tensor([[7], [7]]), caches)
        again = ours(torch.cat([idx[1:, :25], torch.tensor([[7]])], dim=1))
        assert max_error(step[1], again[0, -1]) < 1e-5


def test_uses_the_chunked_pattern():
    from mhsa.models.llama4 import chunk_pattern

    assert repr(chunk_pattern(8, None, 20)) == "Chunked(8)"
    assert repr(chunk_pattern(8, torch.tensor([3, 3]), 20)) == "Chunked(8, start=-3)"
    per_row = chunk_pattern(8, torch.tensor([0, 3]), 20).dense(20, 20)  # (2, 1, 20, 20)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    assert torch.equal(per_row[0, 0] & causal, Chunked(8).dense(20, 20))
    assert torch.equal(per_row[1, 0] & causal, Chunked(8, start=-3).dense(20, 20))


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        Llama4Config(chunk_size=0)
    with pytest.raises(ValueError, match=r"experts_per_token \(5\) must be <= num_experts \(4\)"):
        Llama4Config(num_experts=4, experts_per_token=5)
    with pytest.raises(ValueError, match="nope_layers must be layer indices in 0..3"):
        Llama4Config(n_layer=4, nope_layers=(4,))
    for scale in (float("nan"), "0.1", True):  # ("0.1": a TypeError from math.isfinite)
        with pytest.raises(ValueError, match="attn_scale must be a (finite )?number"):
            Llama4Config(attn_scale=scale)
    sizes = dict(vocab_size=64, hidden_size=32, num_attention_heads=4)
    sizes.update(intermediate_size=64, intermediate_size_mlp=64)
    mismatched = dict(
        **sizes,
        model_type="llama4_text",
        num_hidden_layers=2,
        no_rope_layers=[1, 0],
        attention_chunk_size=8,
        layer_types=["full_attention", "chunked_attention"],
    )
    with pytest.raises(ValueError, match="layer_types must make the rope layers"):
        Llama4Config.from_hf_config(mismatched)
    with pytest.raises(ValueError, match="model_type 'llama' is not supported by Llama4"):
        Llama4Config.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size_mlp'\]"):
        Llama4Config.from_hf_config({k: v for k, v in mismatched.items() if "mlp" not in k})
