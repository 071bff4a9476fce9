"""Every decoder family of mhsa.models loaded with its own from_pretrained from a
directory that transformers' save_pretrained wrote (safetensors, as the Hub ships them),
against the transformers model that wrote it: logits on the same tokens.

The directory, not the model's state_dict(), is the point: transformers 5 writes some
weights in another layout than its models hold in memory (DeepSeek-V3's routed experts
one tensor per expert and projection, model.layers.N.mlp.experts.E.gate_proj.weight,
where DeepseekV3ForCausalLM holds experts.gate_up_proj), and leaves a tied head out.

The families: Llama, Qwen2, Qwen3 and Mistral (mhsa.models.Llama), Gemma 2 and Gemma 3
(Gemma3), Llama 4 (Llama4), DeepSeek-V3 and MiniCPM3 (DeepSeek).

The matrix: each family in float32 in one file with its usual head; in shards of a few
kilobytes with the head tied the other way (tied where the family usually unties, and
untied where it ties); and in bfloat16, loaded as stored (bfloat16 parameters, logits
within twice transformers' own bfloat16 error of the float32 answer) and upcast (float32
logits equal to those of transformers' own float32 reading of the files).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from helpers import max_error
from mhsa.models import DeepSeek, Gemma3, Llama, Llama4
from optional import needs

VOCAB, LENGTH = 97, 21  # past Mistral's and Gemma's windows and Llama 4's chunk
TOL = 1e-4  # float32 logits of a few units: a few roundings
SHARD = "20KB"  # a tiny model in about ten shards
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LATENT = dict(  # DeepSeek-V3 and MiniCPM3: every head expanded from the latent
    num_key_value_heads=4,
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=10,
    v_head_dim=12,
)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5)
# family -> (transformers' config class, its causal LM class, ours, config changes);
# tie_word_embeddings is set by the test
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", Llama, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", Llama, {"rope_theta": 1e6}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", Llama, {"head_dim": 20}),
    "mistral": ("MistralConfig", "MistralForCausalLM", Llama, {"sliding_window": 6}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        Gemma3,
        # caps low enough to bite on these small scores and logits
        {**GEMMA, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        Gemma3,
        {**GEMMA, "num_hidden_layers": 4, "sliding_window_pattern": 2},
    ),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        Llama4,
        dict(
            intermediate_size=16,  # each expert's
            intermediate_size_mlp=72,
            num_hidden_layers=4,
            head_dim=12,
            attention_chunk_size=8,
            no_rope_layer_interval=2,
            interleave_moe_layer_step=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        DeepSeek,
        dict(
            LATENT,
            q_lora_rank=20,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,  # layer 0 dense, layers 1 and 2 experts
            num_mtp_layers=0,
        ),
    ),
    "minicpm3": (
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        DeepSeek,
        dict(LATENT, q_lora_rank=None, scale_emb=12, scale_depth=1.4, dim_model_base=16),
    ),
}
USUALLY_TIED = {"gemma2", "gemma3", "minicpm3"}
LAYOUTS = ("float32", "sharded", "bfloat16")


def write(family: str, layout: str, folder):
    """transformers' model of `family` with random weights (norms, routers and score
    biases spread out, so that a weight loaded in the wrong place shows), written to
    `folder` by save_pretrained in `layout`; returns it in eval mode."""
    transformers = needs("transformers")
    config_name, model_name, _, changes = FAMILIES[family]
    tied = (family in USUALLY_TIED) != (layout == "sharded")
    config = getattr(transformers, config_name)(
        **{**SMALL, **changes}, tie_word_embeddings=tied, attn_implementation="eager"
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.3)
            elif name.endswith(("mlp.gate.weight", "router.weight")) or "experts" in name:
                tensor.normal_(0, 0.3)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.1)
    if layout == "bfloat16":
        model = model.to(torch.bfloat16)
    options = {"max_shard_size": SHARD} if layout == "sharded" else {}
    model.save_pretrained(folder, **options)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))


def stored_names(folder) -> set[str]:
    """The names of every tensor in the folder's safetensors files, from their headers."""
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_pretrained_reads_what_save_pretrained_wrote(family, layout, tmp_path):
    theirs = write(family, layout, tmp_path)
    ours_class, tied = FAMILIES[family][2], theirs.config.tie_word_embeddings
    # what the files hold: the layouts this test is about
    names = stored_names(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"].startswith(family[:5])
    assert ("lm_head.weight" in names) != tied
    if layout == "sharded":
        shards = list(tmp_path.glob("*.safetensors"))
        assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    if family == "deepseek_v3":
        assert "model.layers.1.mlp.experts.7.up_proj.weight" in names
    idx = tokens()
    with torch.no_grad():
        if layout != "bfloat16":
            ours = ours_class.from_pretrained(tmp_path)
            assert (ours.lm_head is None) == tied
            assert max_error(ours(idx), theirs(idx).logits) < TOL
            return
        # bfloat16: as stored, and upcast; the oracle is transformers' own float32
        # reading of the same files (rotary frequencies made afresh, not rounded)
        model_class = getattr(needs("transformers"), FAMILIES[family][1])
        options = {"dtype": torch.float32, "attn_implementation": "eager"}
        oracle = model_class.from_pretrained(tmp_path, **options).eval()(idx).logits
        ours = ours_class.from_pretrained(tmp_path)
        assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
        error, their_error = max_error(ours(idx), oracle), max_error(theirs(idx).logits, oracle)
        assert error <= 2 * their_error + 0.02 * oracle.abs().max().item()
        upcast = ours_class.from_pretrained(tmp_path, dtype=torch.float32)
        assert max_error(upcast(idx), oracle) < TOL
