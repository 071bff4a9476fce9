"""Llama, Mistral, Qwen2 and Qwen3 against transformers' own models with random weights:
logits, greedy generation, cached decoding, left padding, every CPU backend, bfloat16,
rotary scaling (linear, dynamic, llama3, yarn) and partial rotary, and loading errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mhsa
from helpers import cpu_backends, max_error
from mhsa.models import Llama, LlamaConfig
from mhsa.models.llama import HF_NAMES
from mhsa.nn.positional import RotaryEmbedding, rope_frequencies
from optional import needs

VOCAB, LENGTH, STOPS, QK_GAIN = 101, 40, [2, 5], 6.0
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    bos_token_id=1,
    eos_token_id=STOPS,
    rms_norm_eps=1e-6,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {  # name -> (transformers class, config changes); sequences reach 40 > 16 or 32
    "llama3": ("LlamaForCausalLM", {"rope_parameters": {"rope_theta": 500.0, **LLAMA3}}),
    "linear": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "dynamic": (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16},
    ),
    "yarn": (
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-bias": (
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True, "num_hidden_layers": 3},
    ),
    "mistral": ("MistralForCausalLM", {"sliding_window": 7, "num_hidden_layers": 3}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen2-window": (
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,
            "num_hidden_layers": 3,
        },
    ),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 24, "num_key_value_heads": 1}),
}


def pair(case: str, dtype: torch.dtype = torch.float32):
    """(transformers model, ours) with the same random weights, eager attention there."""
    transformers = needs("transformers")
    name, changes = CASES[case]
    config_class = getattr(transformers, name.replace("ForCausalLM", "Config"))
    hf_config = config_class(**{**TINY, **changes}, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, name)(hf_config).eval()
    with torch.no_grad():  # random norms and biases, so that loading them wrong shows,
        for key, p in hf.named_parameters():  # and sharp attention, so that positions do
            if "norm" in key or key.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
            if key.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_GAIN)
    hf = hf.to(dtype)
    ours = Llama.from_hf(hf.state_dict(), LlamaConfig.from_hf_config(hf.config.to_dict()))
    return hf, ours


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(case):
    hf, ours = pair(case)
    idx = tokens(2, LENGTH)
    with torch.no_grad():
        expected = hf(idx).logits
    assert max_error(ours(idx), expected) < 1e-5
    prompt = idx[:, :12]
    with torch.no_grad():
        want = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=26,
            do_sample=False,
            pad_token_id=STOPS[0],
        )
    assert torch.equal(ours.generate(prompt, 26, temperature=0), want)  # stops: the config's
    if ours.config.rope_scaling is not None:  # the scaling matters at these lengths
        plain = replace(ours.config, rope_scaling=None)
        unscaled = Llama.from_hf(hf.state_dict(), plain)(idx)
        assert max_error(unscaled, expected) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "dynamic"])
def test_cached_decoding_equals_full_recompute(case):
    """(Dynamic NTK is left out: its frequencies follow the longest position of each call,
    so cached keys keep older ones, in transformers as here.)"""
    _, ours = pair(case)
    idx = tokens(2, LENGTH)
    full = ours(idx)
    caches = ours.make_caches(2, LENGTH)
    steps = [ours(idx[:, :9], caches=caches)]
    steps += [ours(idx[:, t : t + 1], caches=caches) for t in range(9, 30)]
    steps += [ours(idx[:, 30:], caches=caches)]  # a multi-token step after decoding
    assert max_error(torch.cat(steps, dim=1), full) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_left_padded_batch_equals_each_sequence_alone(case):
    _, ours = pair(case)
    prompts = [tokens(1, n, seed=n)[0] for n in (5, 12, 1)]
    together = ours.generate(prompts, 8, temperature=0, eos_token=[])
    for prompt, got in zip(prompts, together, strict=True):
        alone = ours.generate(prompt.view(1, -1), 8, temperature=0, eos_token=[])[0]
        assert torch.equal(got, alone)
    width = 12
    start = torch.tensor([width - p.numel() for p in prompts])
    padded = torch.zeros(3, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, start[b] :] = p
    logits = ours(padded, start=start)
    for b, p in enumerate(prompts):
        assert max_error(logits[b, start[b] :], ours(p.view(1, -1))[0]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama3", "mistral", "qwen2-window", "qwen3"])
def test_every_cpu_backend_gives_the_same_greedy_tokens(case):
    _, ours = pair(case)
    prompts = [tokens(1, n, seed=n)[0] for n in (9, 3)]
    results = {}
    for backend in cpu_backends():
        with mhsa.use_backend(backend):
            results[backend] = ours.generate(prompts, 20, temperature=0, eos_token=[])
    assert len(results) >= 2, results.keys()
    first = next(iter(results.values()))
    for backend, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True)), backend


def test_bfloat16_weights_err_no_more_than_transformers_in_bfloat16():
    hf32, ours32 = pair("qwen3")
    hf16, ours16 = pair("qwen3", torch.bfloat16)
    assert ours16.embed.weight.dtype == torch.bfloat16
    idx = tokens(2, LENGTH)
    with torch.no_grad():
        exact = hf32(idx).logits
        theirs = max_error(hf16(idx).logits, exact)
    assert max_error(ours32(idx), exact) < 1e-5
    assert max_error(ours16(idx), exact) <= 2 * theirs + 1e-2
    assert ours16.generate(idx[:, :5], 4, temperature=0).dtype == torch.long


def test_from_pretrained_reads_config_and_safetensors(tmp_path):
    hf, _ = pair("qwen2")  # tied: no lm_head in the file
    hf.save_pretrained(tmp_path)
    ours = Llama.from_pretrained(tmp_path)
    idx = tokens(1, 20)
    with torch.no_grad():
        assert max_error(ours(idx), hf(idx).logits) < 1e-5
    assert ours.lm_head is None and ours.config.eos_token == tuple(STOPS)


def test_from_pretrained_stops_at_generation_config_end_tokens_too(tmp_path):
    """An instruct model's end-of-turn ids often sit in generation_config.json only:
    transformers' generate stops at them, and so does ours (they were ignored)."""
    hf, _ = pair("qwen2")
    with torch.no_grad():
        hf.model.norm.weight.zero_()  # every logit 0: greedy picks token 0
    hf.generation_config.eos_token_id = [STOPS[0], 0]
    hf.save_pretrained(tmp_path)
    ours = Llama.from_pretrained(tmp_path)
    assert ours.config.eos_token == tuple(dict.fromkeys([*STOPS, 0]))
    prompt = tokens(1, 5)
    theirs = hf.generate(prompt, max_new_tokens=6, do_sample=False)
    assert theirs.shape[1] == 6 and theirs[0, -1] == 0  # (stopped after one token)
    assert ours.generate(prompt, 6, temperature=0).shape[1] == 6


def test_from_pretrained_follows_the_shard_index(tmp_path):
    """Mistral's repos hold consolidated.safetensors (its own names) beside the shards
    the index names: only the shards are the model, as for transformers."""
    from safetensors.torch import save_file

    hf, _ = pair("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    idx = tokens(1, 20)
    with torch.no_grad():
        assert max_error(Llama.from_pretrained(tmp_path)(idx), hf(idx).logits) < 1e-5
    next(tmp_path.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="index.json names model-00001-of-.*, not in"):
        Llama.from_pretrained(tmp_path)


ROPE_CASES = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 3.0},
    LLAMA3,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
]


@pytest.mark.parametrize("scaling", ROPE_CASES, ids=lambda s: s and s["rope_type"])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_with_scaling_and_partial_rotary_equals_transformers(scaling, partial):
    """Against StableLM's rotary in transformers (it rotates the first partial_rotary_factor
    of each head): frequencies, attention factor and rotated q at positions beyond the
    original context (dynamic: beyond max_position_embeddings)."""
    stablelm = needs("transformers.models.stablelm.modeling_stablelm")
    transformers = needs("transformers")
    rope = {
        "rope_type": "default",
        **(scaling or {}),
        "rope_theta": 1000.0,
        "partial_rotary_factor": partial,
    }
    config = transformers.StableLmConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=20, rope_parameters=rope
    )
    theirs = stablelm.StableLmRotaryEmbedding(config)
    rotary_dim = int(32 * partial)
    ours = RotaryEmbedding(
        32, 1000.0, rotary_dim=rotary_dim, scaling=scaling, max_position_embeddings=20
    )
    q = torch.randn(1, 2, 50, 32)
    positions = torch.arange(50).view(1, -1)
    cos, sin = theirs(q, positions)  # (dynamic: updates their frequencies to 50 positions)
    rot, rest = q[..., :rotary_dim], q[..., rotary_dim:]
    want = torch.cat([stablelm.apply_rotary_pos_emb(rot, rot, cos, sin)[0], rest], dim=-1)
    assert max_error(ours(q, positions=positions[0]), want) < 1e-5
    assert ours.attention_factor == pytest.approx(theirs.attention_scaling)
    inv_freq, _ = rope_frequencies(
        rotary_dim, 1000.0, scaling, max_position_embeddings=20, seq_len=50
    )
    assert max_error(inv_freq, theirs.inv_freq) < 1e-9


def test_partial_rotary_model_caches_and_config():
    d = {
        **TINY,
        "model_type": "llama",
        "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_theta": 500.0, **LLAMA3},
    }
    config = LlamaConfig.from_hf_config(d)
    assert config.rotary_dim == 8 and config.rope_scaling["rope_type"] == "llama3"
    torch.manual_seed(0)
    model = Llama(config).eval()
    idx = tokens(2, 30)
    caches = model.make_caches(2, 30)
    steps = [model(idx[:, :10], caches=caches)] + [
        model(idx[:, t : t + 1], caches=caches) for t in range(10, 30)
    ]
    assert max_error(torch.cat(steps, dim=1), model(idx)) < 1e-5
    unrotated = model.rotary(torch.ones(1, 1, 3, 16), offset=5)[..., 8:]
    assert torch.equal(unrotated, torch.ones(1, 1, 3, 8))


def test_from_hf_config_reads_transformers_4_layouts():
    """rope_theta at the top level and rope_scaling with "type" (older config.json)."""
    d = {
        **TINY,
        "model_type": "mistral",
        "rope_theta": 1e6,
        "sliding_window": None,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "eos_token_id": 2,
    }
    config = LlamaConfig.from_hf_config(d)
    assert config.rope_theta == 1e6 and config.rope_scaling == {"type": "linear", "factor": 4.0}
    assert config.sliding_window is None and config.eos_token == (2,)
    assert (
        HF_NAMES.stored_name("layers.1.attn.out_proj.weight")
        == "model.layers.1.self_attn.o_proj.weight"
    )
    assert HF_NAMES.stored_name("layers.0.ff.gate.weight") == "model.layers.0.mlp.gate_proj.weight"


def test_loading_errors_name_the_problem():
    transformers = needs("transformers")
    hf_config = transformers.LlamaConfig(**TINY)
    torch.manual_seed(0)
    sd = transformers.LlamaForCausalLM(hf_config).state_dict()
    d = hf_config.to_dict()
    config = LlamaConfig.from_hf_config(d)
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2' is not supported by Llama; "
        r"supported: llama, mistral, qwen2, qwen3",
    ):
        LlamaConfig.from_hf_config({**d, "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"1 tensor missing: 'model.norm.weight'"):
        Llama.from_hf({k: v for k, v in sd.items() if k != "model.norm.weight"}, config)
    with pytest.raises(ValueError, match=r"1 unexpected tensor: .*q_norm"):
        Llama.from_hf({**sd, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, config)
    bad = {**sd, "model.layers.1.mlp.up_proj.weight": torch.zeros(95, 64)}
    shape = r"up_proj.weight' has shape \(95, 64\), but this config implies \(96, 64\)"
    with pytest.raises(ValueError, match=shape + r" \(for layers.1.ff.up.weight\)"):
        Llama.from_hf(bad, config)
    with pytest.raises(ValueError, match=r"rope scaling type 'longrope' is not supported"):
        LlamaConfig.from_hf_config({**d, "rope_parameters": {"rope_type": "longrope"}})
    with pytest.raises(ValueError, match=r"'llama3' needs \['low_freq_factor'"):
        LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        )
    tied = LlamaConfig.from_hf_config({**d, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="not tied: set tie_embeddings=False"):
        Llama.from_hf(sd, tied)
    with pytest.raises(ValueError, match="n_kv_head must divide n_head"):
        LlamaConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="has no config.json"):
        Llama.from_pretrained("/nonexistent")
