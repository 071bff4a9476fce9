"""Llama: the decoder-only family behind most open chat models (Llama 2/3, Mistral,
Qwen2, Qwen3), loadable from Hugging Face checkpoints.

    tokens (B, T) -> token embedding
                  -> n_layer pre-norm blocks:
                         x = x + attn(rms_norm(x))   rotary q and k, grouped-query heads,
                                                     optional QK-norm and sliding window
                         x = x + ffn(rms_norm(x))    SwiGLU: down(silu(gate(x)) * up(x))
                  -> final RMSNorm -> logits (B, T, vocab) (tied or separate output head)

The variants differ in small switches: Qwen2 adds biases to q, k and v; Qwen3 normalises
each head's q and k (RMSNorm) before the rotation; Mistral lets a token see only the last
`sliding_window` tokens (itself included). Rotary scaling (linear, dynamic NTK, llama3,
yarn) and partial rotary come from mhsa.nn.positional. Load with `Llama.from_pretrained(dir)`
(config.json + safetensors) or `Llama.from_hf(state_dict, LlamaConfig.from_hf_config(d))`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..core.masks import SlidingWindow
from ..core.validate import int_at_least
from ..formats.weights import NameTable
from ..nn import GatedFeedForward, RMSNorm
from .config import (
    HF_ACTIVATIONS,
    CausalLMConfig,
    RopeSetting,
    hf_rope,
    hf_sizes,
    hf_stop_tokens,
)
from .decoder_lm import EMBED, DecoderLM, LayerInputs, PreNormBlock

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class LlamaConfig(CausalLMConfig):
    head_dim: int | None = None  # None: d_model // n_head
    d_ff: int = 688
    max_len: int = 2048  # max_position_embeddings: what dynamic / yarn scaling refer to
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # None: head_dim; less rotates only the first channels
    rope_scaling: dict | None = None  # see mhsa.nn.positional.rope_frequencies
    attention_bias: bool = False  # q, k, v projections (Qwen2: True)
    attention_out_bias: bool = False  # output projection
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3)
    sliding_window: int | None = None  # a token sees the last W tokens, itself included
    window_layers: tuple[int, ...] | None = None  # layers with the window; None: all
    activation: str = "silu"  # silu: SwiGLU; gelu_tanh: GeGLU
    mlp_bias: bool = False
    tie_embeddings: bool = False
    bos_token: int | None = None
    eos_token: tuple[int, ...] = field(default_factory=tuple)  # stop tokens for generate

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("d_ff", "max_len"):
            int_at_least(name, getattr(self, name), 1)
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head "
                f"({self.n_head}), or set head_dim"
            )
        if self.sliding_window is not None:
            int_at_least("sliding_window", self.sliding_window, 1)
        bad = [i for i in self.window_layers or () if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(
                f"window_layers must be layer indices in 0..{self.n_layer - 1}, got {bad}"
            )
        if self.activation not in set(HF_ACTIVATIONS.values()):
            raise ValueError(
                f"activation must be one of {sorted(set(HF_ACTIVATIONS.values()))}, "
                f"got {self.activation!r}"
            )
        self.eos_token = tuple(self.eos_token)
        self.window_layers = None if self.window_layers is None else tuple(self.window_layers)
        self.rotary_setting().check()

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def rotary_width(self) -> int:
        return self.rotary_dim or self.head_width

    def rotary_setting(self) -> RopeSetting:
        """The rotary embedding of every layer (of the global ones in Gemma 3)."""
        return RopeSetting(
            self.head_width, self.rope_theta, self.rope_scaling, self.max_len, self.rotary_width
        )

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.window_layers is None or layer in self.window_layers

    @classmethod
    def from_hf_config(cls, d: dict) -> LlamaConfig:
        """From a Hugging Face config.json dict of model_type llama, mistral, qwen2 or
        qwen3 (transformers 4 or 5 layouts: rope_theta at the top or in rope_parameters,
        rope_scaling or rope_parameters for the scaling)."""
        sizes = hf_sizes(d, "Llama", MODEL_TYPES)
        kind, n_layer, n_head = d["model_type"], sizes["n_layer"], sizes["n_head"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_head
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        partial = rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
        max_len = d.get("max_position_embeddings", 2048)
        original = d.get("original_max_position_embeddings")
        theta, scaling = hf_rope(rope, d.get("rope_theta") or 10000.0, max_len, original)
        window, window_layers = d.get("sliding_window"), None
        if kind in ("qwen2", "qwen3"):  # the window only where layer_types says so
            window = window if d.get("use_sliding_window") else None
            first = d.get("max_window_layers", n_layer)
            types = d.get("layer_types") or [
                "sliding_attention" if i >= first else "full" for i in range(n_layer)
            ]
            window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if kind == "llama":
            window = None
        act = d.get("hidden_act", "silu")
        if act not in HF_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported; use one of {sorted(HF_ACTIVATIONS)}"
            )
        bias = d.get("attention_bias", False) if kind in ("llama", "qwen3") else kind == "qwen2"
        return cls(
            **sizes,
            head_dim=head_dim,
            d_ff=d["intermediate_size"],
            max_len=max_len,
            norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rotary_dim=int(head_dim * partial),
            rope_scaling=scaling,
            attention_bias=bias,
            attention_out_bias=bias and kind != "qwen2",
            qk_norm=kind == "qwen3",
            sliding_window=window,
            window_layers=window_layers,
            activation=HF_ACTIVATIONS[act],
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token=d.get("bos_token_id"),
            eos_token=hf_stop_tokens(d),
        )


ATTENTION_AND_FF_NAMES = (  # the same in transformers' Llama, Qwen and Gemma layers
    ("layers.{i}.attn.q_proj.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attn.k_proj.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attn.v_proj.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attn.out_proj.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.ff.gate.{p}", "model.layers.{i}.mlp.gate_proj.{p}"),
    ("layers.{i}.ff.up.{p}", "model.layers.{i}.mlp.up_proj.{p}"),
    ("layers.{i}.ff.down.{p}", "model.layers.{i}.mlp.down_proj.{p}"),
)
ROTARY_BUFFERS = ("model.rotary_emb.inv_freq", "model.layers.{i}.self_attn.rotary_emb.inv_freq")
HF_NAMES = NameTable(  # our names <-> transformers' (Llama, Mistral, Qwen2, Qwen3)
    ("embed.weight", EMBED),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ff_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *ATTENTION_AND_FF_NAMES,
    ignore=ROTARY_BUFFERS,
)


class LlamaBlock(PreNormBlock):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + ffn(norm(x)). (B, T, d) -> same."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = self.config_attention(
            config,
            out_bias=config.attention_out_bias,
            qk_norm_eps=config.norm_eps if config.qk_norm else None,
        )
        self.ff_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.ff = GatedFeedForward(
            config.d_model, config.d_ff, activation=config.activation, bias=config.mlp_bias
        )


class Llama(DecoderLM):
    """A Decoder (mhsa.models.decoder): prefill, step, make_caches, cache_layout.

    A family built on it (Gemma 3) names its config class, layer class, final norm's
    form and weight-name table in the class attributes below."""

    config_class: type[LlamaConfig] = LlamaConfig
    block_class: type[nn.Module] = LlamaBlock  # (config) -> one layer
    hf_names = HF_NAMES
    load_fix = "check that the config (layers, attention_bias, qk_norm, tie_embeddings) matches it"
    packs = True

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self._build(config, (self.block_class(config) for _ in range(config.n_layer)))

    def _layer_inputs(self, idx, positions, caches, start, row) -> list[LayerInputs]:
        """A windowed layer's SlidingWindow (a packed row's pattern per window), the
        rotary cos and sin made once for all layers."""
        rotary = self.rotary.at(positions)
        window = self.config.sliding_window
        packed = {}  # a packed row's pattern per window span (None: without)
        inputs = []
        for i in range(len(self.layers)):
            mask = SlidingWindow(window - 1, 0) if self.config.windowed(i) else None
            if row is not None:
                span = (window - 1, 0) if mask else None
                if span not in packed:
                    packed[span] = row.pattern(causal=True, window=span)
                mask = packed[span]
            inputs.append((mask, rotary))
        return inputs

    @property
    def graph_decoding(self) -> bool:
        """generate captures its step in a CUDA graph by default (mhsa.models.graph_step)
        for the Llama family's own layers; a family with other layers (Gemma 3) opts in
        itself."""
        return self.block_class is LlamaBlock

    def cache_window(self, layer: int) -> int | None:
        """Windowed layers keep only their window."""
        return self.config.sliding_window if self.config.windowed(layer) else None
