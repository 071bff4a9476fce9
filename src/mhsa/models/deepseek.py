"""DeepSeek-V3 and MiniCPM3: decoders built on multi-head latent attention (MLA),
loadable from transformers' DeepseekV3ForCausalLM / MiniCPM3ForCausalLM weights.

    tokens (B, T) -> token embedding (* scale_emb: MiniCPM3)
                  -> n_layer pre-norm blocks:
                         x = x + attn(rms_norm(x)) * residual_scale    latent attention
                         x = x + ffn(rms_norm(x)) * residual_scale     SwiGLU, or routed +
                                                                       shared experts
                  -> final RMSNorm (/ logits_scale: MiniCPM3) -> logits (B, T, vocab)

Attention is mhsa.nn.LatentAttention: its cache keeps one latent and one rotary key per
token and layer (kv_lora_rank + qk_rope_head_dim values: 576 at DeepSeek's sizes), and
decoding attends in latent space. DeepSeek-V3's feed-forward is a mixture of experts
(mhsa.nn.moe, written plainly) after its first first_k_dense_replace dense layers; its
routed experts load fused (transformers' model in memory) or one tensor per expert and
projection (save_pretrained's files and the Hub's; HF_NAMES holds both layouts).
MiniCPM3 scales the embedding (scale_emb), each residual branch (scale_depth /
sqrt(n_layer)) and the final hidden state (hidden_size / dim_model_base).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import Tensor

from ..core.checks import int_at_least
from ..formats.weights import NameTable
from ..nn import GatedFeedForward, LatentAttention, MoEFeedForward, RMSNorm
from ..nn.positional import rope_type
from .config import CausalLMConfig, RopeSetting, hf_rope, hf_sizes, hf_stop_tokens
from .decoder_lm import EMBED, DecoderLM, LayerInputs, PreNormBlock

MODEL_TYPES = ("deepseek_v3", "minicpm3")


@dataclass
class DeepSeekConfig(CausalLMConfig):
    d_ff: int = 688  # dense feed-forward width (intermediate_size)
    max_len: int = 2048  # max_position_embeddings (what yarn scaling refers to)
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # see mhsa.nn.positional.rope_frequencies
    kv_lora_rank: int = 64
    q_lora_rank: int | None = None  # None: q projected directly
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    rope_interleave: bool = False  # DeepSeek-V3: rotary channels in interleaved pairs
    attention_bias: bool = False
    # mixture of experts (DeepSeek-V3); n_routed_experts 0: every layer dense
    n_routed_experts: int = 0
    moe_d_ff: int = 0  # each expert's width (moe_intermediate_size)
    n_shared_experts: int = 1
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0  # the first k layers stay dense
    # MiniCPM3's scalings (1.0: none)
    scale_emb: float = 1.0
    residual_scale: float = 1.0  # scale_depth / sqrt(n_layer)
    logits_scale: float = 1.0  # the final hidden state is divided by it
    mlp_bias: bool = False
    tie_embeddings: bool = False
    bos_token: int | None = None
    eos_token: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        widths = ("d_ff", "max_len", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
        for name in (*widths, "v_head_dim"):
            int_at_least(name, getattr(self, name), 1)
        if self.q_lora_rank is not None:
            int_at_least("q_lora_rank", self.q_lora_rank, 1, " or None")
        int_at_least("n_routed_experts", self.n_routed_experts, 0)
        int_at_least("first_k_dense_replace", self.first_k_dense_replace, 0)
        if self.n_routed_experts:
            int_at_least("moe_d_ff", self.moe_d_ff, 1)
            hint = " (a MoE layer here runs at least one shared expert)"
            int_at_least("n_shared_experts", self.n_shared_experts, 1, hint)
        for name in ("scale_emb", "residual_scale", "logits_scale", "routed_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self.eos_token = tuple(self.eos_token)
        self.rotary_setting().check()

    @property
    def scale(self) -> float:
        """The attention scale: (dn + dr) ** -0.5, times mscale(factor, mscale_all_dim)^2
        under YaRN scaling that sets mscale_all_dim (as transformers)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope = self.rope_scaling or {}
        factor, m_all = rope.get("factor") or 1.0, rope.get("mscale_all_dim")
        if rope_type(rope) != "default" and m_all and factor > 1:
            scale *= (0.1 * m_all * math.log(factor) + 1.0) ** 2
        return scale

    def rotary_setting(self) -> RopeSetting:
        """The rotary embedding of the qk_rope_head_dim part of each head."""
        return RopeSetting(self.qk_rope_head_dim, self.rope_theta, self.rope_scaling, self.max_len)

    def latent_widths(self) -> dict[str, int]:
        """LatentAttention's widths (kv_lora_rank, the rotary and other query/key parts
        of a head, a value head)."""
        names = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        return {name: getattr(self, name) for name in names}

    def routing(self) -> dict:
        """MoEFeedForward's routing keywords (top_k, groups, weights' scaling)."""
        return {
            "top_k": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
        }

    def moe(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is a mixture of experts."""
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @classmethod
    def from_hf_config(cls, d: dict) -> DeepSeekConfig:
        """From a Hugging Face config dict of model_type deepseek_v3 or minicpm3
        (transformers 5's rope_parameters, or rope_theta and rope_scaling)."""
        needed = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
        sizes = hf_sizes(d, "DeepSeek", MODEL_TYPES, needed)
        kind, n_layer, n_head = d["model_type"], sizes["n_layer"], sizes["n_head"]
        hidden = sizes["d_model"]
        if d.get("num_key_value_heads") not in (None, n_head):
            raise ValueError(
                f"num_key_value_heads ({d['num_key_value_heads']}) must equal "
                f"num_attention_heads ({n_head}): latent attention expands every head"
            )
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        max_len = d.get("max_position_embeddings", 2048)
        original = d.get("original_max_position_embeddings")
        theta, scaling = hf_rope(rope, d.get("rope_theta") or 10000.0, max_len, original)
        minicpm = kind == "minicpm3"
        options = {}
        if minicpm:
            depth, base = d.get("scale_depth", 1.4), d.get("dim_model_base", 256)
            options = {
                "scale_emb": float(d.get("scale_emb", 12)),
                "residual_scale": 1.0 if depth is None else depth / math.sqrt(n_layer),
                "logits_scale": 1.0 if base is None else hidden / base,
                "mlp_bias": bool(d.get("mlp_bias", False)),
            }
        else:
            options = {
                "n_routed_experts": d.get("n_routed_experts", 256),
                "moe_d_ff": d.get("moe_intermediate_size", 2048),
                "n_shared_experts": d.get("n_shared_experts", 1),
                "num_experts_per_tok": d.get("num_experts_per_tok", 8),
                "n_group": d.get("n_group", 8),
                "topk_group": d.get("topk_group", 4),
                "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
                "routed_scaling_factor": float(d.get("routed_scaling_factor", 2.5)),
                "first_k_dense_replace": d.get("first_k_dense_replace", 3),
                "rope_interleave": bool(d.get("rope_interleave", True)),
            }
        return cls(
            **sizes,
            d_ff=d["intermediate_size"],
            max_len=max_len,
            norm_eps=d.get("rms_norm_eps", 1e-5 if minicpm else 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            kv_lora_rank=d["kv_lora_rank"],
            q_lora_rank=d.get("q_lora_rank"),
            qk_rope_head_dim=d["qk_rope_head_dim"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            v_head_dim=d.get("v_head_dim") or hidden // n_head,
            attention_bias=bool(d.get("attention_bias", False)),
            tie_embeddings=bool(d.get("tie_word_embeddings", minicpm)),
            bos_token=d.get("bos_token_id"),
            eos_token=hf_stop_tokens(d),
            **options,
        )


_LAYER, _ATTN, _MLP = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
_EXPERT = _MLP + "experts.{e}."
HF_NAMES = NameTable(  # our names <-> transformers' (DeepseekV3ForCausalLM, MiniCPM3ForCausalLM)
    ("embed.weight", EMBED),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", _LAYER + "input_layernorm.weight"),
    ("layers.{i}.ff_norm.weight", _LAYER + "post_attention_layernorm.weight"),
    ("layers.{i}.attn.q_proj.{p}", _ATTN + "q_proj.{p}"),
    ("layers.{i}.attn.q_a_proj.{p}", _ATTN + "q_a_proj.{p}"),
    ("layers.{i}.attn.q_a_norm.weight", _ATTN + "q_a_layernorm.weight"),
    ("layers.{i}.attn.q_b_proj.{p}", _ATTN + "q_b_proj.{p}"),
    ("layers.{i}.attn.kv_a_proj.{p}", _ATTN + "kv_a_proj_with_mqa.{p}"),
    ("layers.{i}.attn.kv_norm.weight", _ATTN + "kv_a_layernorm.weight"),
    ("layers.{i}.attn.kv_b_proj.{p}", _ATTN + "kv_b_proj.{p}"),
    ("layers.{i}.attn.out_proj.{p}", _ATTN + "o_proj.{p}"),
    ("layers.{i}.ff.gate.{p}", _MLP + "gate_proj.{p}"),
    ("layers.{i}.ff.up.{p}", _MLP + "up_proj.{p}"),
    ("layers.{i}.ff.down.{p}", _MLP + "down_proj.{p}"),
    ("layers.{i}.ff.router", _MLP + "gate.weight"),
    ("layers.{i}.ff.score_bias", _MLP + "gate.e_score_correction_bias"),
    # the routed experts fused (transformers' model in memory), or one tensor per expert
    # and projection (save_pretrained's files and the Hub's): either layout loads
    ("layers.{i}.ff.experts_gate_up", _MLP + "experts.gate_up_proj"),
    ("layers.{i}.ff.experts_gate_up", (_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight")),
    ("layers.{i}.ff.experts_down", _MLP + "experts.down_proj"),
    ("layers.{i}.ff.experts_down", _EXPERT + "down_proj.weight"),
    ("layers.{i}.ff.shared.gate.{p}", _MLP + "shared_experts.gate_proj.{p}"),
    ("layers.{i}.ff.shared.up.{p}", _MLP + "shared_experts.up_proj.{p}"),
    ("layers.{i}.ff.shared.down.{p}", _MLP + "shared_experts.down_proj.{p}"),
    ignore=("model.rotary_emb.inv_freq",),
)


class DeepSeekBlock(PreNormBlock):
    """Pre-norm decoder layer: x + attn(norm(x)) * s, then x + ffn(norm(x)) * s."""

    def __init__(self, config: DeepSeekConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.residual_scale = c.residual_scale
        self.attn_norm = RMSNorm(c.d_model, eps=c.norm_eps)
        self.attn = LatentAttention(
            c.d_model,
            c.n_head,
            **c.latent_widths(),
            q_lora_rank=c.q_lora_rank,
            bias=c.attention_bias,
            rope_interleave=c.rope_interleave,
            scale=c.scale,
        )
        self.ff_norm = RMSNorm(c.d_model, eps=c.norm_eps)
        if c.moe(layer):
            self.ff = MoEFeedForward(
                c.d_model,
                c.moe_d_ff,
                c.n_routed_experts,
                num_shared=c.n_shared_experts,
                **c.routing(),
            )
        else:
            self.ff = GatedFeedForward(c.d_model, c.d_ff, activation="silu", bias=c.mlp_bias)

    def forward(self, x: Tensor, **where) -> Tensor:
        """where: attend's keywords."""
        x = x + self.attend(x, **where) * self.residual_scale
        return x + self.ff(self.ff_norm(x)) * self.residual_scale


class DeepSeek(DecoderLM):
    """A Decoder (mhsa.models.decoder): prefill, step, make_caches, cache_layout; its
    caches hold one latent key head a token (cache_layout)."""

    config_class = DeepSeekConfig
    hf_names = HF_NAMES
    load_fix = (
        "check that the config (layers, q_lora_rank, ranks and head widths, "
        "experts, first_k_dense_replace, tie_embeddings) matches it"
    )

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self._build(config, (DeepSeekBlock(config, i) for i in range(config.n_layer)))

    def _layer_inputs(self, idx, positions, caches, start, row) -> list[LayerInputs]:
        """No mask (causal only); one rotary cos and sin for all layers."""
        rotary = self.rotary.at(positions)
        return [(None, rotary)] * len(self.layers)

    def _embed(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        return x if self.config.scale_emb == 1.0 else x * self.config.scale_emb

    def _logits(self, x: Tensor) -> Tensor:
        scale = self.config.logits_scale
        return self._head(x if scale == 1.0 else x / scale)

    def cache_bytes_per_token(self) -> int:
        """Bytes the caches hold per token, all layers: n_layer * (kv_lora_rank +
        qk_rope_head_dim) * the element size."""
        return sum(layer.attn.cache_bytes_per_token() for layer in self.layers)

    def _cache_widths(self) -> tuple[int, int, int | None]:
        """Per token and layer: one key head [latent | rotary key] and no values."""
        return 1, self.config.kv_lora_rank + self.config.qk_rope_head_dim, 0

    @classmethod
    def extra_names_ignored(cls, names: Iterable[str], config: DeepSeekConfig) -> list[str]:
        """DeepSeek-V3's multi-token-prediction layer(s), past n_layer."""
        extra = f"model.layers.{config.n_layer}."
        return [name for name in names if name.startswith(extra)]
