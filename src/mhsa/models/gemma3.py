"""Gemma 3 (text): interleaved local and global attention, loadable from Hugging Face
checkpoints of Gemma3ForCausalLM (model_type gemma3_text).

    tokens (B, T) -> token embedding * sqrt(d_model)
                  -> n_layer blocks, five local ones then a global one, repeated:
                         x = x + post_norm(attn(pre_norm(x)))   QK-norm, rotary q and k,
                                                                grouped-query heads
                         x = x + post_ff_norm(ff(ff_norm(x)))   GeGLU
                  -> final RMSNorm -> tied output head -> logits (B, T, vocab)

A local layer lets a token see the last `sliding_window` tokens (itself included) and
rotates with its own base (rope_local_theta, transformers' rope_local_base_freq); a
global layer sees every earlier token and rotates with rope_theta and rope_scaling
(Gemma 3 4B and up: linear, factor 8). Every RMSNorm scales by (1 + weight), the
attention scale is query_pre_attn_scalar^-1/2, and optional softcaps squash attention
scores and final logits as in Gemma 2. Decoding keeps one cache per layer: a ring buffer
of the window for a local layer, the whole sequence for a global one (make_caches).

Gemma 2 (Gemma2ForCausalLM, model_type gemma2) is the same model without QK-norm, with
one rotary base for every layer, local and global layers alternating, and both softcaps
on: Gemma3 loads it too.

Gemma3 is a Llama (mhsa.models.llama) with its own layer, config and weight names: it
shares the loader, caches and decoding. Load with `Gemma3.from_pretrained(dir)` or
`Gemma3.from_hf(state_dict, Gemma3Config.from_hf_config(d))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.scores import Softcap
from ..formats.weights import NameTable
from ..nn import GatedFeedForward, RMSNorm
from .config import RopeSetting, hf_rope, hf_sizes, hf_stop_tokens
from .decoder_lm import LayerInputs, PreNormBlock
from .llama import (
    ATTENTION_AND_FF_NAMES,
    EMBED,
    HF_ACTIVATIONS,
    ROTARY_BUFFERS,
    Llama,
    LlamaConfig,
)

LAYER_TYPES = ("sliding_attention", "full_attention")
HF_DEFAULTS = {  # transformers' Gemma3TextConfig defaults, for keys a config.json lacks
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
GEMMA2_DEFAULTS = {  # transformers' Gemma2Config defaults where they differ from those
    "max_position_embeddings": 8192,
    "sliding_window_pattern": 2,  # local, global, local, ...
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}


def _check_positive(name: str, value: float | None, *, optional: bool = True) -> None:
    """Raise unless value is a finite number > 0 (or None, when optional)."""
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or not math.isfinite(value)
    ):
        maybe = " or None" if optional else ""
        raise ValueError(f"{name} must be a finite number > 0{maybe}, got {value!r}")


@dataclass
class Gemma3Config(LlamaConfig):
    """LlamaConfig's fields (rope_theta and rope_scaling: the global layers') with
    Gemma 3's defaults, and its own. window_layers None: the 5:1 pattern, layer i local
    unless (i + 1) % 6 == 0."""

    sliding_window: int | None = 512  # None: every layer global
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0  # local layers' base (rope_local_base_freq)
    rope_local_scaling: dict | None = None  # local layers' scaling (none in Gemma 3)
    query_pre_attn_scalar: float | None = None  # scale = its ** -0.5; None: head_dim
    attn_softcap: float | None = None  # cap * tanh(score / cap) on attention scores
    final_softcap: float | None = None  # and on the logits
    qk_norm: bool = True
    activation: str = "gelu_tanh"
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.window_layers is None and self.sliding_window is not None:
            self.window_layers = tuple(i for i in range(self.n_layer) if (i + 1) % 6)
        super().__post_init__()
        _check_positive("rope_local_theta", self.rope_local_theta, optional=False)
        _check_positive("query_pre_attn_scalar", self.query_pre_attn_scalar)
        _check_positive("attn_softcap", self.attn_softcap)
        _check_positive("final_softcap", self.final_softcap)
        self.local_rotary_setting().check()

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_width) ** -0.5

    def local_rotary_setting(self) -> RopeSetting:
        """The local (sliding-window) layers' rotary embedding."""
        return RopeSetting(
            self.head_width,
            self.rope_local_theta,
            self.rope_local_scaling,
            self.max_len,
            self.rotary_width,
        )

    @classmethod
    def from_hf_config(cls, d: dict) -> Gemma3Config:
        """From a Hugging Face config.json dict of model_type gemma3_text (transformers
        5's rope_parameters per layer type, or 4's rope_theta, rope_local_base_freq,
        rope_scaling and sliding_window_pattern) or gemma2 (one rotary for all layers,
        no QK-norm); missing keys take transformers' defaults."""
        kind = d.get("model_type")
        if kind == "gemma3":
            raise ValueError(
                "model_type 'gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); "
                "Gemma3 loads the text model: pass a gemma3_text config (Gemma3ForCausalLM, "
                "e.g. gemma-3-1b)"
            )
        sizes = hf_sizes(d, "Gemma3", ("gemma3_text", "gemma2"))
        if d.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention=True (an embedding model) is not supported: "
                "Gemma3 is the causal language model"
            )
        gemma2 = kind == "gemma2"
        d = {**HF_DEFAULTS, **(GEMMA2_DEFAULTS if gemma2 else {}), **d}
        n_layer = d["num_hidden_layers"]
        every = d.get("sliding_window_pattern") or 6
        types = d.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(n_layer)
        ]
        if len(types) != n_layer or not set(types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must name {n_layer} layers, each one of {LAYER_TYPES}, got {types}"
            )
        rope = d.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5: one dict per layer type
            global_rope = dict(rope["full_attention"] or {})
            local_rope = dict(rope.get("sliding_attention") or {})
        else:  # transformers 4: the global scaling alone, the bases at the top
            global_rope, local_rope = dict(d.get("rope_scaling") or rope), {}
        max_len = d["max_position_embeddings"]
        theta, scaling = hf_rope(
            global_rope, d.get("rope_theta") or (1e4 if gemma2 else 1e6), max_len
        )
        local_theta, local_scaling = theta, scaling  # Gemma 2: one rotary for every layer
        if not gemma2:
            local_theta, local_scaling = hf_rope(
                local_rope, d.get("rope_local_base_freq") or 1e4, max_len
            )
        act = d["hidden_activation"]
        if act not in HF_ACTIVATIONS:
            raise ValueError(
                f"hidden_activation {act!r} is not supported; use one of {sorted(HF_ACTIVATIONS)}"
            )
        bias = bool(d.get("attention_bias", False))
        return cls(
            **sizes,
            head_dim=d["head_dim"],
            d_ff=d["intermediate_size"],
            max_len=max_len,
            norm_eps=d["rms_norm_eps"],
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            rope_local_scaling=local_scaling,
            query_pre_attn_scalar=d["query_pre_attn_scalar"],
            # Gemma 3 configs may name an attention softcap that transformers never applies
            attn_softcap=d.get("attn_logit_softcapping") if gemma2 else None,
            qk_norm=not gemma2,
            final_softcap=d.get("final_logit_softcapping"),
            attention_bias=bias,
            attention_out_bias=bias,
            sliding_window=d["sliding_window"],
            window_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
            activation=HF_ACTIVATIONS[act],
            tie_embeddings=bool(d["tie_word_embeddings"]),
            bos_token=d.get("bos_token_id"),
            eos_token=hf_stop_tokens(d),
        )


GEMMA3_NAMES = NameTable(  # our names <-> transformers' Gemma3ForCausalLM
    ("embed.weight", EMBED),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.post_attn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.ff_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("layers.{i}.post_ff_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    *ATTENTION_AND_FF_NAMES,
    ignore=ROTARY_BUFFERS,
)


class Gemma3Block(PreNormBlock):
    """Sandwich-norm decoder layer: x + post_norm(attn(norm(x))), then
    x + post_ff_norm(ff(ff_norm(x))), every norm (1 + weight). (B, T, d) -> same."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        width, eps = config.d_model, config.norm_eps
        self.attn_norm, self.post_attn_norm, self.ff_norm, self.post_ff_norm = (
            RMSNorm(width, eps=eps, unit_offset=True) for _ in range(4)
        )
        cap = config.attn_softcap
        self.attn = self.config_attention(
            config,
            out_bias=config.attention_out_bias,
            scale=config.attention_scale,
            score=None if cap is None else Softcap(cap),
        )
        if config.qk_norm:  # each head's q and k, (1 + weight) as every Gemma norm
            self.attn.q_norm = RMSNorm(config.head_width, eps=eps, unit_offset=True)
            self.attn.k_norm = RMSNorm(config.head_width, eps=eps, unit_offset=True)
        self.ff = GatedFeedForward(
            width, config.d_ff, activation=config.activation, bias=config.mlp_bias
        )

    def forward(self, x: Tensor, **where) -> Tensor:
        """where: attend's keywords."""
        x = x + self.post_attn_norm(self.attend(x, **where))
        return x + self.post_ff_norm(self.ff(self.ff_norm(x)))


class Gemma3(Llama):
    """Gemma 3's text model (or Gemma 2's); a Decoder (prefill, step, make_caches: a
    SlidingWindowCache of the window for each local layer, a KVCache for each global
    one)."""

    config: Gemma3Config
    config_class = Gemma3Config
    block_class = Gemma3Block
    unit_offset_norm = True
    hf_names = GEMMA3_NAMES  # Gemma3.from_hf: transformers' Gemma3ForCausalLM weights
    packs = False  # (Llama's packed masks would serve; untested with Gemma's layers)

    def _init_rotary(self) -> None:
        """Two rotary embeddings: global layers' (rope_theta, rope_scaling) and local
        layers' (rope_local_theta, rope_local_scaling)."""
        super()._init_rotary()
        self.local_rotary = self.config.local_rotary_setting().embedding()

    def _layer_inputs(self, idx, positions, caches, start, row) -> list[LayerInputs]:
        """Llama's masks (the window on local layers); local layers rotate with
        local_rotary, global ones with rotary (cos and sin made once per kind)."""
        rotary = {True: self.local_rotary.at(positions), False: self.rotary.at(positions)}
        masks = super()._layer_inputs(idx, positions, caches, start, row)
        return [(mask, rotary[self.config.windowed(i)]) for i, (mask, _) in enumerate(masks)]

    def _embed(self, idx: Tensor) -> Tensor:
        scale = torch.tensor(self.config.d_model**0.5, dtype=self.embed.weight.dtype)
        return self.embed(idx) * scale  # sqrt(d) rounded to the weights' dtype first

    def _logits(self, x: Tensor) -> Tensor:
        logits = self._head(x)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
