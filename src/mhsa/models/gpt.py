"""GPT: a decoder-only Transformer with causal attention and a KV cache for generation.

    tokens (B, T) -> token embedding (+ learned or sinusoidal positions)
                  -> n_layer pre-norm blocks (causal self-attention, feed-forward)
                  -> final layer norm -> logits (B, T, vocab) with the tied embedding

Rotary, ALiBi and T5 relative-bias positions act inside attention instead (ALiBi and
the T5 bias as score functions the engine evaluates per tile; one T5 table is shared
by every layer, as in T5). With `window` set, each token attends only the last
`window` positions (itself included). GPT is a DecoderLM (models/decoder_lm.py): its
caches, cache layout and decoding layout are the Llama family's; GPT-2 weights load by
the families' names (`GPT.from_pretrained(dir)`, `GPT.from_hf(state_dict,
GPTConfig.from_hf_config(d))`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..cache import KVCache
from ..core.masks import SlidingWindow
from ..core.validate import check_dropout, int_at_least
from ..formats.weights import NameTable, Rule, Weights, as_source, load_weights
from ..nn import encoder_layers
from ..nn.differential import DiffAttention
from ..nn.latent import LatentAttention
from ..nn.moba import MoBA
from ..nn.positional import (
    ALiBiPosition,
    LearnedPositionalEmbedding,
    RelativeBiasPosition,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from .config import HF_ACTIVATIONS, CausalLMConfig
from .decoder_lm import DecoderLM
from .decoding import check_sampling, check_token_ids, sample
from .init import normal_init
from .packing import packed_row, refuse_packed_with

POSITIONS = ("learned", "sinusoidal", "rotary", "alibi", "t5")
# the self-attention of every layer (see _attention_layer)
ATTENTIONS = ("standard", "diff", "moba", "latent")
SCORE_POSITIONS = ("alibi", "t5")  # score functions: not yet across processes
# GPTConfig's sizes <- their names in transformers' GPT2Config (config.json)
GPT2_SIZES = {
    "vocab_size": "vocab_size",
    "n_layer": "n_layer",
    "n_head": "n_head",
    "d_model": "n_embd",
    "max_len": "n_positions",
}
__all__ = ["GPT", "GPT2_NAMES", "GPTConfig", "check_sampling", "check_token_ids", "sample"]


@dataclass
class GPTConfig(CausalLMConfig):
    max_len: int = 256
    dropout: float = 0.0
    position: str = "learned"
    window: int | None = None
    d_ff: int | None = None  # None: 4 * d_model
    activation: str = "gelu_tanh"
    bias: bool = True
    norm_eps: float = 1e-5
    attention: str = "standard"  # one of ATTENTIONS
    moba_block: int = 32  # attention="moba": positions per block
    moba_top_k: int = 2  # attention="moba": earlier blocks each query block attends

    def __post_init__(self) -> None:
        super().__post_init__()
        int_at_least("max_len", self.max_len, 1)
        check_dropout(self.dropout, "dropout")
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")
        self._check_attention()

    def _check_attention(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        int_at_least("moba_block", self.moba_block, 1)
        int_at_least("moba_top_k", self.moba_top_k, 1)
        if self.attention == "diff" and (
            self.d_model % (2 * self.n_head) or self.n_kv_head not in (None, self.n_head)
        ):
            raise ValueError(
                "attention='diff' needs d_model a multiple of 2 * n_head and no grouped-query "
                f"heads, got d_model {self.d_model}, n_head {self.n_head}, "
                f"n_kv_head {self.n_kv_head}"
            )
        if self.attention == "latent" and self.n_kv_head not in (None, self.n_head):
            raise ValueError(
                "attention='latent' shares one latent key head across all heads: leave "
                f"n_kv_head unset, got {self.n_kv_head}"
            )
        if self.attention == "moba" and (
            self.window is not None or self.position in SCORE_POSITIONS
        ):
            raise ValueError(
                "attention='moba' is causal over its own block choice: no window, and "
                f"positions other than {SCORE_POSITIONS}"
            )

    @classmethod
    def from_hf_config(cls, d: dict) -> GPTConfig:
        """A transformers GPT-2 config.json dict -> the GPTConfig of its weights (learned
        positions, a tied head, no dropout: for inference). ValueError for another
        model_type, missing sizes, or attention GPT-2 options GPT lacks."""
        if d.get("model_type") != "gpt2":
            raise ValueError(f"model_type {d.get('model_type')!r} is not GPT-2's ('gpt2')")
        missing = [theirs for theirs in GPT2_SIZES.values() if theirs not in d]
        if missing:
            raise ValueError(f"the config dict lacks {missing}; pass the model's config.json")
        unlike = [
            k for k in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn") if d.get(k)
        ]
        if not d.get("scale_attn_weights", True):
            unlike.append("scale_attn_weights=False")
        if not d.get("tie_word_embeddings", True):
            unlike.append("tie_word_embeddings=False (a head of its own)")
        act = d.get("activation_function", "gelu_new")
        if act not in HF_ACTIVATIONS:
            unlike.append(f"activation_function {act!r} (one of {sorted(HF_ACTIVATIONS)})")
        if unlike:
            raise ValueError(
                f"GPT does not compute GPT-2's {'; '.join(unlike)}: this config.json is another "
                "model than GPT computes"
            )
        return cls(
            **{ours: d[theirs] for ours, theirs in GPT2_SIZES.items()},
            d_ff=d.get("n_inner"),
            activation=HF_ACTIVATIONS[act],
            norm_eps=d.get("layer_norm_epsilon", 1e-5),
        )


GPT2_NAMES = NameTable(  # our names <-> transformers' GPT2LMHeadModel ("transformer." optional)
    ("tok_emb.weight", "wte.weight"),
    ("pos_emb.embedding.weight", "wpe.weight"),
    Rule(
        (
            "blocks.{i}.self_attn.q_proj.{p}",
            "blocks.{i}.self_attn.k_proj.{p}",
            "blocks.{i}.self_attn.v_proj.{p}",
        ),
        "h.{i}.attn.c_attn.{p}",
        transpose=True,
    ),
    Rule("blocks.{i}.self_attn.out_proj.{p}", "h.{i}.attn.c_proj.{p}", transpose=True),
    Rule("blocks.{i}.feed_forward.linear1.{p}", "h.{i}.mlp.c_fc.{p}", transpose=True),
    Rule("blocks.{i}.feed_forward.linear2.{p}", "h.{i}.mlp.c_proj.{p}", transpose=True),
    ("blocks.{i}.attn_block.norm.{p}", "h.{i}.ln_1.{p}"),
    ("blocks.{i}.ff_block.norm.{p}", "h.{i}.ln_2.{p}"),
    ("ln_f.{p}", "ln_f.{p}"),
    ignore=("lm_head.weight", "h.{i}.attn.bias", "h.{i}.attn.masked_bias"),  # tied; buffers
    prefix="transformer.",
)


class GPT(DecoderLM):
    """A Decoder (mhsa.models.decoder) on DecoderLM, whose caches (make_caches: a
    SlidingWindowCache per layer when the window is shorter than them), cache_layout,
    decoding_layout and checked loading it shares; its own forward (learned or
    sinusoidal positions, dropout, sequence shards) over its own module names (tok_emb,
    blocks, ln_f), which its checkpoints keep. The head is the embedding (tied)."""

    config_class = GPTConfig
    hf_names = GPT2_NAMES
    embedding_name = "tok_emb"
    lm_head = None  # tied: the logits are ln_f(x) @ tok_emb.weight.T
    load_fix = "check that the GPTConfig (vocab_size, n_layer, d_model, max_len) matches it"
    packs = True  # forward takes packed rows (cu_seqlens, position_ids)

    @property
    def prefill_alignment(self) -> int:
        """MoBA chooses each query's key blocks among blocks of moba_block positions,
        so a call that starts mid-block sees that block cut: prefill calls start on them."""
        config = self.config
        return config.moba_block if config.attention == "moba" else 1

    @property
    def left_padding(self) -> bool:
        """MoBA's blocks count from each sequence's first token, which left padding
        would move: its prompts of different lengths decode one after another."""
        return self.config.attention != "moba"

    @property
    def graph_decoding(self) -> bool:
        """generate captures its step in a CUDA graph by default (mhsa.models.graph_step)
        for standard attention at learned, sinusoidal or rotary positions (a relative
        bias would see the static cache's slots, not the positions)."""
        config = self.config
        return config.attention == "standard" and config.position not in SCORE_POSITIONS

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # differential heads are two query/key heads of half the width each
        pairs = 2 if config.attention == "diff" else 1
        head_dim = config.d_model // config.n_head // pairs
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = {
            "learned": lambda: LearnedPositionalEmbedding(config.max_len, config.d_model),
            "sinusoidal": lambda: SinusoidalPositionalEncoding(config.d_model, config.max_len),
        }.get(config.position, lambda: None)()
        latent = config.attention == "latent"
        rotary_dim = _latent_widths(config)["qk_rope_head_dim"] if latent else head_dim
        self.attn_position = {
            "rotary": lambda: RotaryEmbedding(rotary_dim),
            "alibi": lambda: ALiBiPosition(pairs * config.n_head),
            "t5": lambda: RelativeBiasPosition(pairs * config.n_head, bidirectional=False),
        }.get(config.position, lambda: None)()
        self.drop = nn.Dropout(config.dropout)
        self.blocks = encoder_layers(
            config.n_layer,
            config.d_model,
            config.n_head,
            dim_feedforward=config.d_ff or 4 * config.d_model,
            dropout=config.dropout,
            activation=config.activation,
            norm_first=True,
            layer_norm_eps=config.norm_eps,
            num_kv_heads=config.n_kv_head,
            bias=config.bias,
        )
        for depth, block in enumerate(self.blocks):
            block.self_attn = _attention_layer(config, depth) or block.self_attn
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.apply(normal_init)

    def forward(
        self,
        idx: Tensor,
        *,
        caches: list[KVCache] | None = None,
        start: Tensor | None = None,
        positions: Tensor | None = None,
        last: bool = False,
        cu_seqlens: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab), or (B, 1, vocab) of the last
        position when last.

        caches: one per layer (see make_caches); the tokens continue what they hold.
        start: (B,) index of each sequence's first real token when left-padded
        (without caches; with caches the caches hold it).
        positions: (T,) global positions of idx's tokens when idx is one process's
        shard of longer sequences (context parallelism; attention then runs under
        mhsa.distributed.context_parallel). Not with ALiBi or T5 positions, caches or
        start.
        cu_seqlens (S+1,) and/or position_ids (T,) restarting at 0: idx (1, T) packs S
        sequences (mhsa.models.packing); each attends only itself, at its own positions,
        and gets the logits it gets alone. Not with caches, start or positions.
        """
        check_token_ids(idx, self.config.vocab_size)
        if self.config.attention == "moba" and (
            positions is not None or cu_seqlens is not None or position_ids is not None
        ):
            raise ValueError(
                "attention='moba' chooses blocks within one whole sequence: it takes no "
                "packed rows (cu_seqlens, position_ids) or sequence shards (positions)"
            )
        batch, length = idx.shape
        attn_position = self.attn_position
        window = self.config.window
        mask = None if window is None else SlidingWindow(window - 1, 0)
        causal = window is None
        if cu_seqlens is not None or position_ids is not None:
            if caches is not None or start is not None or positions is not None:
                refuse_packed_with("caches, start or positions")
            row = packed_row(idx, cu_seqlens, position_ids)
            mask = row.pattern(causal=True, window=None if window is None else (window - 1, 0))
            positions, padding, causal = row.positions, None, False
            if isinstance(attn_position, RotaryEmbedding):
                attn_position = attn_position.at(positions[0])
        elif positions is not None:
            if caches is not None or start is not None or self.config.position in SCORE_POSITIONS:
                raise ValueError(
                    "positions (a sequence shard) does not go with caches, "
                    "start or ALiBi/T5 positions"
                )
            positions = positions.to(idx.device)
            if attn_position is not None:
                attn_position = attn_position.at(positions)
            positions, padding = positions.expand(batch, length), None
        else:  # from the caches (which report their own padding), or each row's start
            positions, padding = self._positions(idx, caches, start)
            if caches is not None and isinstance(attn_position, RotaryEmbedding):
                attn_position = attn_position.at(positions)  # real-token positions
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = self.pos_emb(x, positions=positions)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(
                x,
                mask=mask,
                key_padding_mask=padding,
                causal=causal,
                position=attn_position,
                cache=None if caches is None else caches[i],
            )
        return self._head(self.ln_f(x[:, -1:] if last else x))

    def cache_window(self, layer: int) -> int | None:
        """Every layer attends the config's window (None: all)."""
        return self.config.window

    def _cache_widths(self) -> tuple[int, int, int | None]:
        """Latent attention caches one key head [latent | rotary key] and no values;
        differential attention 2 half-width heads for each of its heads."""
        config = self.config
        if config.attention == "latent":
            widths = _latent_widths(config)
            return 1, widths["kv_lora_rank"] + widths["qk_rope_head_dim"], 0
        pairs = 2 if config.attention == "diff" else 1
        return (
            pairs * (config.n_kv_head or config.n_head),
            config.d_model // config.n_head // pairs,
            None,
        )

    def default_stop_tokens(self) -> None:
        """None: a GPTConfig names no stop token."""
        return None

    def position_limit(self) -> int | None:
        """Learned positions end at max_len; rotary, ALiBi and T5 positions do not."""
        return self.config.max_len if self.pos_emb is not None else None

    @classmethod
    def from_hf(
        cls, state_dict: Weights, config: GPTConfig, *, dtype: torch.dtype | None = None
    ) -> GPT:
        """Build a GPT from weights named as in transformers' GPT2LMHeadModel (a state
        dict, or a TensorSource such as SafetensorsFiles), every name and shape checked
        first (GPT2_NAMES: Conv1D weights stored (in, out), c_attn fusing q, k and v),
        cast to `dtype` if given; in eval mode. from_pretrained(directory) reads a
        GPT-2 directory (config.json: GPTConfig.from_hf_config)."""
        return cls._load_gpt2(state_dict, config, dtype).eval()

    @classmethod
    def from_hf_gpt2(cls, state_dict: Weights, config: GPTConfig) -> GPT:
        """from_hf, in float32 and left in training mode (its older name)."""
        return cls._load_gpt2(state_dict, config, None)

    @classmethod
    def _load_gpt2(cls, state_dict: Weights, config: GPTConfig, dtype) -> GPT:
        if config.position != "learned" or config.n_kv_head not in (None, config.n_head):
            raise ValueError("GPT-2 weights need position='learned' and no grouped-query heads")
        source = as_source(state_dict)
        _check_tied(source)
        model = cls(config) if dtype is None else cls(config).to(dtype)  # loaded as stored
        return load_weights(model, source, cls.hf_names, fix=cls.load_fix)


def _check_tied(source) -> None:
    """GPT's head is its embedding: a stored lm_head.weight must be wte's."""
    stored = source.shapes()
    names = [name for name in ("transformer.wte.weight", "wte.weight") if name in stored]
    if not names or "lm_head.weight" not in stored:
        return  # (no wte: the loader names what is missing)
    embedding = names[0]
    if not torch.equal(source.read("lm_head.weight").cpu(), source.read(embedding).cpu()):
        raise ValueError(
            f"{source.name}: lm_head.weight differs from {embedding}: GPT ties its head to "
            "the embedding, and this checkpoint's head is its own"
        )


def _attention_layer(config: GPTConfig, depth: int) -> nn.Module | None:
    """Layer `depth`'s self-attention for config.attention; None keeps the layer's own
    MultiHeadAttention ("standard")."""
    if config.attention == "diff":
        return DiffAttention(
            config.d_model,
            config.n_head,
            depth=depth,
            qkv_bias=config.bias,
            proj_bias=config.bias,
            dropout=config.dropout,
        )
    if config.attention == "moba":
        return MoBA(
            config.d_model,
            config.n_head,
            block_size=config.moba_block,
            top_k=config.moba_top_k,
            num_kv_heads=config.n_kv_head,
            bias=config.bias,
        )
    if config.attention == "latent":
        widths = _latent_widths(config)
        return LatentAttention(
            config.d_model, config.n_head, **widths, dropout=config.dropout, bias=config.bias
        )
    return None  # "standard"


def _latent_widths(config: GPTConfig) -> dict[str, int]:
    """attention="latent": LatentAttention's widths, kv_lora_rank d_model / 2,
    qk_rope_head_dim half a head (even), the other query/key part and values a head."""
    head_dim = config.d_model // config.n_head
    return {
        "kv_lora_rank": config.d_model // 2,
        "qk_rope_head_dim": max(2, head_dim // 4 * 2),
        "qk_nope_head_dim": head_dim,
        "v_head_dim": head_dim,
    }
