"""Llama 4 (text): chunked local layers and global NoPE layers, loadable from
transformers' Llama4ForCausalLM weights.

    tokens (B, T) -> token embedding
                  -> n_layer pre-norm blocks, x = x + attn(rms_norm(x)), then
                     x = x + ffn(rms_norm(x)); two kinds of attention layer:
                       rope layers    rotary q and k, QK L2-norm, Chunked(chunk_size):
                                      a token sees its own chunk up to itself
                       NoPE layers    no rotary, every earlier token (global), queries
                                      scaled by 1 + attn_scale * log1p(floor((p + 1) /
                                      floor_scale)) (temperature tuning)
                     ffn: SwiGLU, or a mixture of experts (MoE layers): a shared expert
                     plus the top-k of num_experts routed experts, each fed the token
                     times its sigmoid router score
                  -> final RMSNorm -> logits (B, T, vocab)

Llama 4 rotates interleaved channel pairs (2i, 2i + 1); mhsa's rotary pairs (i, i + D/2),
so from_hf permutes each head's q and k rows once (q.k is unchanged by one permutation
of both). The QK-norm has no weight, so it commutes with the rotation once YaRN's
attention factor (which a norm after the rotation takes back out) is left at 1; it is
applied before it here (after it in transformers), equal up to rounding. The chunked layers'
caches keep only the last chunk_size keys (a ring buffer), the global layers' every
key. The mixture of
experts is written plainly (a loop over experts), for parity, not speed.

Positions count each sequence's real tokens (left padding excluded), for rotary, chunks
and the temperature alike: a left-padded row gets the logits it gets alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..core.masks import Chunked, Document, Pattern
from ..core.validate import int_at_least
from ..formats.tensor_sources import Within, as_source
from ..formats.weights import NameTable, Weights
from ..nn import GatedFeedForward, RMSNorm
from ..nn.feedforward import ACTIVATIONS
from ..nn.positional import AttentionPosition, rope_type
from .config import CausalLMConfig, RopeSetting, hf_rope, hf_sizes, hf_stop_tokens
from .decoder_lm import EMBED, DecoderLM, LayerInputs, PreNormBlock

MODEL_TYPES = ("llama4_text", "llama4")


@dataclass
class Llama4Config(CausalLMConfig):
    head_dim: int | None = None  # None: d_model // n_head
    d_ff: int = 128  # each expert's width (intermediate_size)
    d_ff_dense: int = 256  # the dense layers' width (intermediate_size_mlp)
    max_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None  # see mhsa.nn.positional.rope_frequencies
    attention_bias: bool = False
    chunk_size: int | None = 8192  # rope layers' chunk (attention_chunk_size); None: global
    nope_layers: tuple[int, ...] = ()  # layers without rotary: global attention
    qk_norm: bool = True  # an L2-norm (no weight) over q and k heads on rope layers
    temperature_tuning: bool = True  # on NoPE layers
    floor_scale: int = 8192
    attn_scale: float = 0.1
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 16
    experts_per_token: int = 1
    activation: str = "silu"
    tie_embeddings: bool = False
    bos_token: int | None = None
    eos_token: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("d_ff", "d_ff_dense", "max_len", "floor_scale", "num_experts"):
            int_at_least(name, getattr(self, name), 1)
        int_at_least("experts_per_token", self.experts_per_token, 1)
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be <= num_experts "
                f"({self.num_experts})"
            )
        if self.chunk_size is not None:
            int_at_least("chunk_size", self.chunk_size, 1, " (positions per chunk), or None")
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}), "
                "or set head_dim"
            )
        for name in ("nope_layers", "moe_layers"):
            layers = tuple(getattr(self, name))
            bad = [i for i in layers if not 0 <= i < self.n_layer]
            if bad:
                raise ValueError(
                    f"{name} must be layer indices in 0..{self.n_layer - 1}, got {bad}"
                )
            setattr(self, name, layers)
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}"
            )
        scale = self.attn_scale
        if (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not math.isfinite(scale)
        ):
            raise ValueError(f"attn_scale must be a finite number, got {scale!r}")
        self.eos_token = tuple(self.eos_token)
        self.rotary_setting().check()

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    def rotary_setting(self) -> RopeSetting:
        """The rope layers' rotary embedding. transformers norms q and k after rotating
        them, which takes YaRN's cos/sin attention factor back out: with the QK-norm,
        the factor is 1."""
        scaling = self.rope_scaling
        if self.qk_norm and rope_type(scaling) == "yarn":
            scaling = {**scaling, "attention_factor": 1.0}
        return RopeSetting(self.head_width, self.rope_theta, scaling, self.max_len)

    def rope(self, layer: int) -> bool:
        """Whether layer `layer` is a rope (chunked) layer, not a global NoPE one."""
        return layer not in self.nope_layers

    @classmethod
    def from_hf_config(cls, d: dict) -> Llama4Config:
        """From a Hugging Face config.json dict of a Llama4ForCausalLM (model_type
        llama4_text), or a Llama4 config's text_config."""
        d = d.get("text_config") or d
        sizes = hf_sizes(d, "Llama4", MODEL_TYPES, ("intermediate_size_mlp",))
        n_layer = d["num_hidden_layers"]
        interval = d.get("no_rope_layer_interval", 4)
        rope_flags = d.get("no_rope_layers") or [
            int((i + 1) % interval != 0) for i in range(n_layer)
        ]  # 1: rope
        chunk = d.get("attention_chunk_size")
        types = d.get("layer_types") or []
        chunked = [t == "chunked_attention" for t in types]
        if types and chunked != [bool(f) and chunk is not None for f in rope_flags]:
            raise ValueError(
                "layer_types must make the rope layers (no_rope_layers 1) the chunked "
                "ones, as transformers' default does; got " + ", ".join(types)
            )
        step = d.get("interleave_moe_layer_step", 1)
        moe = d.get("moe_layers")
        moe = list(range(step - 1, n_layer, step)) if moe is None else moe
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        max_len = d.get("max_position_embeddings", 2048)
        original = d.get("original_max_position_embeddings")
        theta, scaling = hf_rope(rope, d.get("rope_theta") or 500000.0, max_len, original)
        act = d.get("hidden_act", "silu")  # (transformers' default)
        return cls(
            **sizes,
            head_dim=d.get("head_dim"),
            d_ff=d["intermediate_size"],
            d_ff_dense=d["intermediate_size_mlp"],
            max_len=max_len,
            norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(d.get("attention_bias", False)),
            chunk_size=chunk,
            nope_layers=tuple(i for i, f in enumerate(rope_flags) if not f),
            qk_norm=bool(d.get("use_qk_norm", True)),
            temperature_tuning=bool(d.get("attn_temperature_tuning", True)),
            floor_scale=int(d.get("floor_scale", 8192)),
            attn_scale=float(d.get("attn_scale", 0.1)),
            moe_layers=tuple(moe),
            num_experts=d.get("num_local_experts", 16),
            experts_per_token=d.get("num_experts_per_tok", 1),
            activation={"swish": "silu"}.get(act, act),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token=d.get("bos_token_id"),
            eos_token=hf_stop_tokens(d),
        )


class L2Norm(nn.Module):
    """x / sqrt(mean(x^2) + eps) in float32, cast back: an RMSNorm without a weight
    (Llama 4's QK-norm). (..., D) -> same."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)


class Temperature(AttentionPosition):
    """Llama 4's attention temperature tuning on NoPE layers, as a position inside
    attention: the query at position p is scaled by 1 + attn_scale * log1p(floor((p + 1)
    / floor_scale)); keys are left as they are. positions: (B, L) of the new tokens."""

    def __init__(self, positions: Tensor, floor_scale: int, attn_scale: float) -> None:
        super().__init__()
        self.positions = positions
        steps = torch.floor((positions.float() + 1.0) / floor_scale)
        self.scale = (torch.log1p(steps) * attn_scale + 1.0)[:, None, :, None]  # (B, 1, L, 1)

    def rotate(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        return (q * self.scale).to(q.dtype), k


class MixtureOfExperts(nn.Module):
    """Llama 4's MoE feed-forward: shared(x) + sum over the top-k experts e of
    expert_e(x * sigmoid(router(x)_e)), SwiGLU experts. (B, T, d) -> same.

    gate_up (E, d, 2 * d_ff) and down (E, d_ff, d) are stored as transformers stores
    them (x @ weight)."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, activation: str):
        super().__init__()
        self.top_k, self.activation = top_k, activation
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, d_model, 2 * d_ff))
        self.down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.shared = GatedFeedForward(d_model, d_ff, activation=activation)
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        logits = self.router(flat)  # (N, E)
        top, chosen = logits.topk(self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)  # (N, k)
        out = self.shared(flat)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            routed = flat[rows] * scores[rows, slot, None]  # the input is scaled
            gate, up = (routed @ self.gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, rows, (ACTIVATIONS[self.activation](gate) * up) @ self.down[e])
        return out.view_as(x)


class Llama4Block(PreNormBlock):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + ffn(norm(x)). (B, T, d) -> same."""

    def __init__(self, config: Llama4Config, layer: int) -> None:
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.d_model, eps=c.norm_eps)
        self.attn = self.config_attention(c)
        if c.qk_norm and c.rope(layer):
            self.attn.q_norm, self.attn.k_norm = L2Norm(c.norm_eps), L2Norm(c.norm_eps)
        self.ff_norm = RMSNorm(c.d_model, eps=c.norm_eps)
        if layer in c.moe_layers:
            self.ff = MixtureOfExperts(
                c.d_model, c.d_ff, c.num_experts, c.experts_per_token, c.activation
            )
        else:
            self.ff = GatedFeedForward(c.d_model, c.d_ff_dense, activation=c.activation)


def chunk_pattern(size: int, begin: Tensor | None, kv_len: int, first: int = 0) -> Pattern:
    """The chunks of `size` over kv_len keys, key j being token first + j of its row
    and at position first + j - begin[b] (begin (B,): each row's left padding; None:
    0): Chunked when one begin serves every row, else the chunks per row as documents
    (causal then comes from the call)."""
    if begin is None or bool((begin == begin.flatten()[0]).all()):
        pad = 0 if begin is None else int(begin.flatten()[0])
        return Chunked(size, start=first - pad)
    index = torch.arange(first, first + kv_len, device=begin.device).view(1, -1)
    return Document((index - begin.view(-1, 1)).div(size, rounding_mode="floor"))


MULTIMODAL_TEXT = "language_model."  # the text model's names in Llama4ForConditionalGeneration
HF_NAMES = NameTable(  # our names <-> transformers' Llama4ForCausalLM
    ("embed.weight", EMBED),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ff_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.attn.q_proj.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attn.k_proj.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attn.v_proj.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attn.out_proj.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("layers.{i}.ff.gate.weight", "model.layers.{i}.feed_forward.gate_proj.weight"),
    ("layers.{i}.ff.up.weight", "model.layers.{i}.feed_forward.up_proj.weight"),
    ("layers.{i}.ff.down.weight", "model.layers.{i}.feed_forward.down_proj.weight"),
    ("layers.{i}.ff.router.weight", "model.layers.{i}.feed_forward.router.weight"),
    ("layers.{i}.ff.gate_up", "model.layers.{i}.feed_forward.experts.gate_up_proj"),
    ("layers.{i}.ff.down", "model.layers.{i}.feed_forward.experts.down_proj"),
    (
        "layers.{i}.ff.shared.gate.weight",
        "model.layers.{i}.feed_forward.shared_expert.gate_proj.weight",
    ),
    (
        "layers.{i}.ff.shared.up.weight",
        "model.layers.{i}.feed_forward.shared_expert.up_proj.weight",
    ),
    (
        "layers.{i}.ff.shared.down.weight",
        "model.layers.{i}.feed_forward.shared_expert.down_proj.weight",
    ),
    ignore=("model.rotary_emb.inv_freq",),
)


class Llama4(DecoderLM):
    """A Decoder (mhsa.models.decoder): prefill, step, make_caches, cache_layout."""

    config_class = Llama4Config
    hf_names = HF_NAMES
    load_fix = "check that the config (layers, moe_layers, tie_embeddings) matches it"

    def __init__(self, config: Llama4Config) -> None:
        super().__init__()
        self._build(config, (Llama4Block(config, i) for i in range(config.n_layer)))

    def _layer_inputs(self, idx, positions, caches, start, row) -> list[LayerInputs]:
        """Rope layers: the chunks (over the keys their caches keep) and the rotary cos
        and sin; NoPE layers: no mask, the temperature (or nothing)."""
        c = self.config
        length = idx.shape[1]
        if caches is not None and caches[0].paged_step is not None:
            begin, kv_len, first = None, length, 0  # each sequence's keys from position 0
        elif caches is not None:
            begin = caches[0].start
            local = caches[next((i for i in range(c.n_layer) if c.rope(i)), 0)]
            first = local.kept_from()  # chunked layers' caches keep the last chunk only
            kv_len = local.length + length - first
        else:
            begin = None if start is None else start.view(-1).to(idx.device)
            kv_len, first = length, 0
        rotary = self.rotary.at(positions)  # cos and sin made once for every rope layer
        temperature = None
        if c.temperature_tuning:
            temperature = Temperature(positions, c.floor_scale, c.attn_scale)
        chunks = None
        if c.chunk_size is not None:
            chunks = chunk_pattern(c.chunk_size, begin, kv_len, first)
        return [(chunks, rotary) if c.rope(i) else (None, temperature) for i in range(c.n_layer)]

    @property
    def static_cache_problem(self) -> str | None:
        """Chunked layers: a static cache places the query after all its slots, not at
        its position, which the chunks need (graph_step.static_step_problem)."""
        if self.config.chunk_size is None:
            return None
        return (
            "Llama 4's Chunked layers need each query's position, which a static cache "
            "does not keep"
        )

    def paged_cache_problem(self) -> str | None:
        """Chunked layers: attention over paged keys takes no Chunked pattern."""
        if self.config.chunk_size is None:
            return None
        return (
            "attention over paged keys takes no Chunked pattern: decode Llama 4's chunked "
            "layers without speculate"
        )

    def cache_window(self, layer: int) -> int | None:
        """Chunked layers keep only the last chunk_size keys (what a chunk may need)."""
        return self.config.chunk_size if self.config.rope(layer) else None

    @classmethod
    def from_hf(
        cls, state_dict: Weights, config: Llama4Config, *, dtype: torch.dtype | None = None
    ) -> Llama4:
        """Build from weights named as in transformers' Llama4ForCausalLM (every name
        and shape checked first, HF_NAMES); each head's q and k rows are permuted from
        interleaved rotary pairs to mhsa's halves. dtype: cast to it (default: the
        embedding's). A multimodal checkpoint (Llama4ForConditionalGeneration, as the
        Hub's Scout and Maverick) gives its text model, language_model.*."""
        source = as_source(state_dict)
        if any(name.startswith(MULTIMODAL_TEXT) for name in source.shapes()):
            source = Within(source, MULTIMODAL_TEXT)
        model = cls._load_hf(source, config, dtype=dtype)
        for block in model.layers:
            for proj, heads in ((block.attn.q_proj, config.n_head), (block.attn.k_proj, None)):
                heads = heads or config.n_kv_head or config.n_head
                for name in ("weight", "bias"):
                    param = getattr(proj, name)
                    if param is not None:
                        setattr(proj, name, nn.Parameter(_halves(param.data, heads)))
        return model.eval()


def _halves(rows: Tensor, heads: int) -> Tensor:
    """(heads * D, ...) rows of a projection with rotary pairs (2i, 2i + 1) -> pairs
    (i, i + D/2): each head's even rows, then its odd rows."""
    per_head = rows.reshape(heads, -1, 2, *rows.shape[1:])  # (H, D/2, 2, ...)
    return per_head.transpose(1, 2).reshape(rows.shape)
