"""DeepSeek-V3 and MiniCPM3 (mhsa.models.deepseek) against transformers'
DeepseekV3ForCausalLM and MiniCPM3ForCausalLM with tiny random float32 configs: logits,
greedy tokens, latent-cached decoding (contiguous and paged) equal to recomputing,
cache bytes per token, and the checked weight loading (routed experts fused, as
transformers holds them, or one tensor per expert, as its save_pretrained writes them;
tests/models/test_save_pretrained_matrix.py loads such directories)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import max_error
from mhsa.cache import PagedKVCache
from mhsa.models import DeepSeek, DeepSeekConfig
from optional import needs

VOCAB = 97
SHARED = dict(  # sizes shared by both tiny configs; no width is a power of two
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=10,
    v_head_dim=12,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)
DEEPSEEK = dict(
    q_lora_rank=20,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,  # layer 0 dense, layers 1 and 2 experts
    rope_interleave=True,
    num_mtp_layers=0,
    # YaRN with mscale_all_dim (as DeepSeek-V3 ships): positions past 32 are scaled
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
MINICPM = dict(q_lora_rank=None, scale_emb=12, scale_depth=1.4, dim_model_base=16)


def reference(kind: str):
    """transformers' model of `kind` with random weights (routers and their score
    biases spread out, so that routing differs between tokens), in eval mode."""
    transformers = needs("transformers")
    torch.manual_seed(0)
    if kind == "deepseek_v3":
        config = transformers.DeepseekV3Config(**SHARED, **DEEPSEEK)
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.MiniCPM3Config(**SHARED, **MINICPM)
        model = transformers.MiniCPM3ForCausalLM(config)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                tensor.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.1)
    return model.eval(), config


@pytest.fixture(scope="module", params=["deepseek_v3", "minicpm3"])
def pair(request):
    theirs, config = reference(request.param)
    ours = DeepSeek.from_hf(theirs.state_dict(), DeepSeekConfig.from_hf_config(config.to_dict()))
    return theirs, ours


def test_logits_match_transformers(pair):
    theirs, ours = pair
    idx = torch.randint(0, VOCAB, (2, 45))  # past YaRN's original 32 positions
    with torch.no_grad():
        want, got = theirs(idx).logits, ours(idx)
    assert max_error(got, want) < 1e-5
    assert max_error(ours(idx, last=True)[:, -1], want[:, -1]) < 1e-5


def test_greedy_tokens_match_transformers(pair):
    theirs, ours = pair
    idx = torch.randint(0, VOCAB, (2, 7))
    want = theirs.generate(idx, max_new_tokens=10, do_sample=False)
    got = ours.generate(idx, 10, temperature=0.0)
    assert want.shape == (2, 17)
    assert torch.equal(got, want)


def test_cached_decoding_equals_full_recompute(pair):
    _, ours = pair
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (4, 9)]
    cached = ours.generate(prompts, 8, temperature=0.0, use_cache=True)
    full = ours.generate(prompts, 8, temperature=0.0, use_cache=False)
    alone = [ours.generate(p[None], 8, temperature=0.0)[0] for p in prompts]
    for a, b, c in zip(cached, full, alone, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantised_models_decode_absorbed_as_the_full_forward(mode):
    """The absorbed decoding step read kv_b_proj.weight, which a quantised layer has
    not: the first step raised AttributeError."""
    from mhsa.nn.quantized import quantize_linears

    torch.manual_seed(0)
    sizes = dict(vocab_size=96, n_layer=2, n_head=4, d_model=64, d_ff=64, kv_lora_rank=32)
    sizes.update(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    model = quantize_linears(DeepSeek(DeepSeekConfig(**sizes)).eval(), mode)
    idx = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)[:, -1]
        caches = model.make_caches(1, 8)
        model.prefill(idx[:, :6], caches)
        step = model.step(idx[:, 6:], caches)
    assert max_error(step, full) < 0.05 * full.abs().max()
    assert model.layers[0].attn.cache_bytes_per_token() == 40 * 4  # (float32 activations)
    assert type(model.layers[0].attn.kv_b_proj) is torch.nn.Linear  # (read whole each step)
    # quantised by hand all the same, it is read through nn.quantized.dense_weight
    from mhsa.nn.quantized import Int4Linear, Int8Linear

    make = Int8Linear if mode == "int8" else Int4Linear
    for layer in model.layers:
        layer.attn.kv_b_proj = make.from_float(layer.attn.kv_b_proj.weight.detach())
    with torch.no_grad():
        full = model(idx)[:, -1]
        caches = model.make_caches(1, 8)
        model.prefill(idx[:, :6], caches)
        assert max_error(model.step(idx[:, 6:], caches), full) < 0.05 * full.abs().max()


@torch.no_grad()
def test_paged_cache_from_the_layout_equals_full_recompute(pair):
    _, ours = pair
    idx = torch.randint(0, VOCAB, (2, 14))
    layout = ours.cache_layout
    assert (layout.num_kv_heads, layout.value_dim) == (1, 0)
    pool = PagedKVCache(
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        value_dim=layout.value_dim,
        num_blocks=16,
        block_size=4,
    )
    ids = [pool.add_sequence(idx[b, :9].tolist()) for b in range(2)]
    outs = [ours(idx[:, :9], caches=pool.batch(ids, 9))]
    for t in range(9, 14):
        outs.append(ours(idx[:, t : t + 1], caches=pool.batch(ids, 1)))
    assert max_error(torch.cat(outs, dim=1), ours(idx)) < 1e-5


def test_cache_bytes_per_token_match_the_formula(pair):
    _, ours = pair
    c = ours.config
    formula = c.n_layer * (c.kv_lora_rank + c.qk_rope_head_dim) * 4  # float32
    caches = ours.make_caches(2, 10)
    held = sum(cache.k.nbytes + cache.v.nbytes for cache in caches) / (2 * 10)
    assert ours.cache_bytes_per_token() == held == formula


def test_configs_read_from_transformers():
    _, config = reference("minicpm3")
    ours = DeepSeekConfig.from_hf_config(config.to_dict())
    assert ours.residual_scale == pytest.approx(1.4 / math.sqrt(3))
    assert (ours.scale_emb, ours.logits_scale, ours.tie_embeddings) == (12.0, 3.0, True)
    _, config = reference("deepseek_v3")
    ours = DeepSeekConfig.from_hf_config(config.to_dict())
    assert ours.moe(1) and not ours.moe(0) and ours.rope_interleave
    assert ours.scale == pytest.approx(18**-0.5 * (0.1 * math.log(4.0) + 1) ** 2)


def test_weight_loading_is_checked():
    theirs, config = reference("deepseek_v3")
    ours = DeepSeekConfig.from_hf_config(config.to_dict())
    state = theirs.state_dict()
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    missing = {k: v for k, v in state.items() if k != name}
    unexpected = {**state, "model.layers.0.mlp.extra.weight": torch.zeros(1)}
    shaped = {**state, name: state[name][:, :-1]}
    for broken, words in (
        (missing, "1 tensor missing"),
        (unexpected, "1 unexpected tensor"),
        (shaped, "has shape"),
    ):
        with pytest.raises(ValueError, match=words) as error:
            DeepSeek.from_hf(broken, ours)
        assert "\n" not in str(error.value)
    # DeepSeek-V3's multi-token-prediction layer (past n_layer) is not ours: ignored
    mtp = {**state, "model.layers.3.eh_proj.weight": torch.zeros(2, 2)}
    assert isinstance(DeepSeek.from_hf(mtp, ours), DeepSeek)


def per_expert(state: dict, layers=(1, 2)) -> dict:
    """transformers' fused routed experts (experts.gate_up_proj (E, 2F, d), down_proj
    (E, d, F)) in `layers` as save_pretrained writes them: one tensor per expert and
    projection, experts.{e}.gate_proj.weight (F, d), up_proj (F, d), down_proj (d, F)."""
    out = dict(state)
    for i in layers:
        at = f"model.layers.{i}.mlp.experts."
        gate_up, down = out.pop(at + "gate_up_proj"), out.pop(at + "down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2)
            out[f"{at}{e}.gate_proj.weight"] = gate.clone()
            out[f"{at}{e}.up_proj.weight"] = up.clone()
            out[f"{at}{e}.down_proj.weight"] = down[e].clone()
    return out


def test_experts_load_stored_per_expert_or_fused():
    """Both layouts, even mixed (layer 1 per expert, layer 2 fused), give the fused
    load's parameters; the stacked ones are new tensors, not views of the file's."""
    theirs, config = reference("deepseek_v3")
    ours = DeepSeekConfig.from_hf_config(config.to_dict())
    state = theirs.state_dict()
    fused = DeepSeek.from_hf(state, ours).state_dict()
    for stored in (per_expert(state), per_expert(state, layers=(1,))):
        loaded = DeepSeek.from_hf(stored, ours).state_dict()
        assert loaded.keys() == fused.keys()
        assert all(torch.equal(loaded[k], fused[k]) for k in fused)
    halves = DeepSeek.from_hf(per_expert(state), ours, dtype=torch.bfloat16)
    assert halves.layers[1].ff.experts_gate_up.dtype == torch.bfloat16


def test_experts_stored_per_expert_are_checked():
    """A missing, extra, misshapen or integer expert tensor: one line naming it (and the
    parameter it stacks into) before anything is stacked."""
    theirs, config = reference("deepseek_v3")
    ours = DeepSeekConfig.from_hf_config(config.to_dict())
    state = per_expert(theirs.state_dict())
    at = "model.layers.2.mlp.experts."
    name = at + "5.up_proj.weight"
    missing = {k: v for k, v in state.items() if k != name}
    extra = {**state, at + "8.down_proj.weight": state[at + "0.down_proj.weight"]}
    shaped = {**state, name: state[name][:-1]}
    integer = {**state, name: state[name].to(torch.int8)}
    for broken, words in (
        (missing, f"1 tensor missing: '{name}' (for layers.2.ff.experts_gate_up)"),
        (extra, f"1 unexpected tensor: '{at}8.down_proj.weight'"),
        (shaped, f"tensor '{name}' has shape (15, 48), but this config implies (16, 48)"),
        (integer, f"tensor '{name}' is stored as torch.int8"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)) as error:
            DeepSeek.from_hf(broken, ours)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_lora_rank", 0),
        ("qk_rope_head_dim", 0),
        ("v_head_dim", -1),
        ("q_lora_rank", 0),
        ("logits_scale", float("nan")),
    ],
)
def test_bad_config_sizes_are_rejected(field, value):
    with pytest.raises(ValueError, match=field) as error:
        DeepSeekConfig(**{field: value})
    assert "\n" not in str(error.value)


def test_moe_layers_need_a_shared_expert_dense_ones_do_not():
    """It once failed building the model, naming MoEFeedForward's num_shared."""
    with pytest.raises(ValueError, match="n_shared_experts must be an int >= 1"):
        DeepSeekConfig(n_routed_experts=4, moe_d_ff=8, n_group=1, topk_group=1, n_shared_experts=0)
    DeepSeekConfig(n_routed_experts=0, n_shared_experts=0)  # (all dense: not used)


def test_unsupported_configs_are_rejected():
    with pytest.raises(ValueError, match="model_type"):
        DeepSeekConfig.from_hf_config({"model_type": "llama"})
    d = {"model_type": "minicpm3", **SHARED, "num_key_value_heads": 2}
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DeepSeekConfig.from_hf_config(d)
    with pytest.raises(ValueError, match="n_group"):
        DeepSeek(DeepSeekConfig(n_routed_experts=6, moe_d_ff=8, n_group=4))


def test_the_serving_engine_runs_it_over_a_paged_pool():
    """mhsa serve's engine (paged latent caches from cache_layout, chunked prefill,
    continuous batching) gives each request the tokens it gets alone."""
    from mhsa.apps.serve import Engine

    torch.manual_seed(0)
    config = DeepSeekConfig(
        vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        d_model=32,
        d_ff=48,
        max_len=256,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        q_lora_rank=12,
        n_routed_experts=4,
        moe_d_ff=8,
        num_experts_per_tok=2,
        n_group=2,
        first_k_dense_replace=1,
    )
    model = DeepSeek(config).double().eval()
    engine = Engine(model, context_length=256, num_blocks=32, block_size=8, prefill_chunk=16)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (5, 40, 3)]
    counts = [6, 4, 9]
    for prompt, count, output in zip(prompts, counts, engine.run(prompts, counts), strict=True):
        alone = model.generate(torch.tensor([prompt]), count, temperature=0.0)
        assert output == alone[0, len(prompt) :].tolist()
    assert engine.cache.used_blocks == 0
    # speculative decoding: a one-sequence pool of latent caches (cache_layout's value
    # width 0), prompt lookup drafts verified in one pass, plain greedy's tokens
    from mhsa.models.speculative import PromptLookup

    prompt = torch.tensor(prompts[0] * 4)
    plain = model.generate([prompt], 12, temperature=0.0, eos_token=[])[0]
    fast = model.generate([prompt], 12, temperature=0.0, eos_token=[], speculate=PromptLookup())
    assert torch.equal(fast[0], plain)
