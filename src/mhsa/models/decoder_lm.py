"""DecoderLM: what the decoder-only language models (GPT, Llama and its families,
Llama 4, DeepSeek) share, said once: embedding -> layers -> RMSNorm -> a head tied to
the embedding or not; positions from the caches or each row's start; caches per layer
(a ring buffer for a layer whose window is shorter than the caches); the decoding
layout; checked loading of transformers' weights and directories. A family gives its
layers, its rotary embedding and its weight names (hf_names); see models/llama.py for
the smallest one. GPT keeps its own forward (learned positions, dropout, sequence
shards) and module names, and shares the rest."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Self

from ..cache import KVCache, SlidingWindowCache
from ..core.masks import Pattern
from ..formats.tensor_sources import checkpoint_files
from ..formats.weights import NameTable, SafetensorsFiles, Weights, as_source, load_weights
from ..nn import MultiHeadAttention, RMSNorm
from ..nn.layout import decoding_layout
from .config import hf_stop_tokens
from .decoder import CacheLayout
from .decoding import CausalLMDecoding, check_token_ids
from .init import normal_init
from .packing import PackedRow, packed_row, refuse_packed_with

EMBED = "model.embed_tokens.weight"  # transformers' name of the embedding
LayerInputs = tuple[Pattern | None, Any]  # a layer's mask and its position (rotary, ...)


class PreNormBlock(nn.Module):
    """A decoder layer of attn_norm, attn, ff_norm and ff: x + attn(attn_norm(x)), then
    x + ff(ff_norm(x)). (B, T, d) -> same. A family with another residual form (sandwich
    norms, scaled residuals) overrides forward and calls attend."""

    @staticmethod
    def config_attention(config: Any, **options: Any) -> MultiHeadAttention:
        """attn from a transformers-style config: n_head query heads of head_width over
        d_model, n_kv_head key/value heads, attention_bias on the projections; options
        (out_bias, scale, score, qk_norm_eps) go to MultiHeadAttention."""
        return MultiHeadAttention(
            config.d_model,
            config.n_head,
            num_kv_heads=config.n_kv_head,
            head_dim=config.head_width,
            bias=config.attention_bias,
            **options,
        )

    def attend(
        self, x: Tensor, *, mask, key_padding_mask, position, cache, causal: bool = True
    ) -> Tensor:
        """attn over attn_norm(x) (B, T, d): the layer's mask, key padding (B, S) or
        None, position (rotary or a score), cache."""
        return self.attn(
            self.attn_norm(x),
            mask=mask,
            key_padding_mask=key_padding_mask,
            causal=causal,
            position=position,
            cache=cache,
        )

    def forward(self, x: Tensor, **where: Any) -> Tensor:
        """where: attend's keywords."""
        x = x + self.attend(x, **where)
        return x + self.ff(self.ff_norm(x))


class DecoderLM(nn.Module, CausalLMDecoding):
    """A Decoder (mhsa.models.decoder): prefill, step, make_caches, cache_layout.
    Subclasses set config_class and hf_names, call _build from __init__ and define
    _layer_inputs (each layer's mask and position); _embed and _logits
    when their model scales the embedding or the logits; cache_window when a layer
    attends a window; _cache_widths when a layer caches other than its heads."""

    config_class: type
    hf_names: NameTable
    embedding_name = "embed"  # the token embedding's attribute (the tied head's weight)
    unit_offset_norm = False  # the final RMSNorm scales by (1 + weight) (Gemma)
    packs = False  # forward takes packed rows (cu_seqlens, position_ids)
    load_fix = "check that the config (layers, widths, tie_embeddings) matches it"

    def _build(self, config, layers: Iterable[nn.Module]) -> None:
        """Embedding, layers, final norm and head (None when tied), rotary, init."""
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps, unit_offset=self.unit_offset_norm)
        self.lm_head = None
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_rotary()
        self.apply(normal_init)

    def _init_rotary(self) -> None:
        """Make the rotary embedding(s) (again, after a load onto meta-built parameters):
        the config's rotary_setting()."""
        self.rotary = self.config.rotary_setting().embedding()

    def forward(
        self,
        idx: Tensor,
        *,
        caches: list[KVCache] | None = None,
        start: Tensor | None = None,
        last: bool = False,
        cu_seqlens: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab), or (B, 1, vocab) of the last
        position when last (what decoding needs: the output head can be a fifth of a
        prefill's work).

        caches: one per layer (make_caches, or a PagedKVCache's layers); the tokens
        continue what they hold. start: (B,) index of each sequence's first real token
        when left-padded (without caches; with caches the caches hold it). Positions
        count real tokens only, so a left-padded sequence gets the same logits as alone
        (except under dynamic NTK rope scaling, whose frequencies follow the call's
        longest position, as in transformers).
        cu_seqlens (S+1,) and/or position_ids (T,) restarting at 0, where the model
        packs: idx (1, T) holds S sequences (mhsa.models.packing); each attends only
        itself, at its own positions. Not with caches or start.
        """
        row = None
        if cu_seqlens is not None or position_ids is not None:
            if not self.packs:
                raise ValueError(
                    f"{type(self).__name__} takes no packed rows (cu_seqlens, "
                    "position_ids): pass one sequence a row, left-padded with start"
                )
            if caches is not None or start is not None:
                refuse_packed_with("caches or start")
            check_token_ids(idx, self.config.vocab_size)
            row = packed_row(idx, cu_seqlens, position_ids)
            positions, padding = row.positions[0], None
        else:
            check_token_ids(idx, self.config.vocab_size)
            positions, padding = self._positions(idx, caches, start)
        inputs = self._layer_inputs(idx, positions, caches, start, row)
        x = self._embed(idx)
        for i, layer in enumerate(self.layers):
            mask, position = inputs[i]
            x = layer(
                x,
                mask=mask,
                key_padding_mask=padding,
                position=position,
                cache=None if caches is None else caches[i],
                causal=row is None,  # a packed row's pattern is causal within each sequence
            )
        return self._logits(self.norm(x[:, -1:] if last else x))

    def _layer_inputs(
        self,
        idx: Tensor,
        positions: Tensor,
        caches: list[KVCache] | None,
        start: Tensor | None,
        row: PackedRow | None,
    ) -> list[LayerInputs]:
        """Each layer's (mask, position) for tokens idx (B, T) at positions (B, T)."""
        raise NotImplementedError

    def _embed(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) -> embeddings (B, T, d)."""
        return self.embed(idx)

    def _logits(self, x: Tensor) -> Tensor:
        """Final normed hidden states (B, T, d) -> logits (B, T, vocab)."""
        return self._head(x)

    def _positions(
        self, idx: Tensor, caches: list[KVCache] | None, start: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) token ids (checked by the caller) -> (positions (B, T) of its
        tokens, key padding (B, T) or None): from the caches when given (they hold the
        padding), else counted from each row's `start` (its first real token), so a
        left-padded row is positioned as alone."""
        batch, length = idx.shape
        if caches is not None:
            if len(caches) != self.config.n_layer:
                raise ValueError(
                    f"caches must hold one cache per layer ({self.config.n_layer}), got "
                    f"{len(caches)}; use model.make_caches(batch, max_len)"
                )
            if start is not None:
                raise ValueError(
                    "start is for calls without caches; with caches declare the padding "
                    "once: model.prefill(tokens, caches, start=start) or cache.set_padding(start)"
                )
            return caches[0].next_positions(length), None  # caches pad themselves
        index = torch.arange(length, device=idx.device).view(1, -1)
        begin = torch.zeros(batch, 1, dtype=torch.long, device=idx.device)
        begin = begin if start is None else start.view(-1, 1).to(idx.device)
        positions = (index - begin).clamp(min=0).expand(batch, length)
        return positions, None if start is None else index >= begin

    def _head(self, x: Tensor) -> Tensor:
        """Final hidden states (B, T, d) -> logits (B, T, vocab)."""
        if self.lm_head is None:
            return x @ getattr(self, self.embedding_name).weight.T
        return self.lm_head(x)

    def fuse_projections(self) -> Self:
        """For inference: every submodule that can (attention's q, k, v, a gated
        feed-forward's gate and up) computes its projections in one matmul (see
        MultiHeadAttention.fuse_projections); returns self."""
        fusable = [m for m in self.modules() if m is not self and hasattr(m, "fuse_projections")]
        for module in fusable:
            module.fuse_projections()
        return self

    def decoding_layout(self) -> Self:
        """For one-sequence decoding on CPU (mhsa chat): projections fused and float32
        weights stored transposed, the tied embedding too (mhsa.nn.layout; one-row
        matmuls read them faster, several rows slightly slower); returns self.
        Inference only."""
        tied = self.embedding_name if self.lm_head is None else None
        decoding_layout(self.fuse_projections(), tied)
        return self

    def cache_window(self, layer: int) -> int | None:
        """The keys layer `layer` ever needs, when bounded (a window); None: all."""
        return None

    def _cache_widths(self) -> tuple[int, int, int | None]:
        """What a layer caches per token: (key/value heads, key width, value width;
        None: the key's, 0: no values)."""
        c = self.config
        return c.n_kv_head or c.n_head, c.head_width, None

    @property
    def cache_layout(self) -> CacheLayout:
        """The per-token shape of this model's caches (a paged pool's size):
        _cache_widths in each of n_layer layers, in the embedding's dtype and device."""
        heads, width, value_dim = self._cache_widths()
        param = getattr(self, self.embedding_name).weight
        return CacheLayout(
            self.config.n_layer, heads, width, param.dtype, param.device, value_dim=value_dim
        )

    def make_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """Empty caches for every layer, each of max_len positions; a layer whose window
        is shorter keeps only that many keys (a SlidingWindowCache ring buffer: the
        same keys in the same order, while max_len holds them all)."""
        layout = self.cache_layout
        options = {"dtype": layout.dtype, "device": layout.device}
        shape = (layout.num_kv_heads, layout.head_dim, layout.value_dim)
        caches = []
        for i in range(layout.num_layers):
            window = self.cache_window(i)
            if window is not None and window < max_len:
                caches.append(SlidingWindowCache(batch, shape[0], window, *shape[1:], **options))
            else:
                caches.append(KVCache(batch, shape[0], max_len, *shape[1:], **options))
        return caches

    def default_stop_tokens(self) -> int | Sequence[int] | None:
        """The config's eos_token(s)."""
        return self.config.eos_token

    @classmethod
    def _load_hf(
        cls,
        state_dict: Weights,
        config,
        *,
        dtype: torch.dtype | None,
        ignore: Sequence[str] = (),
    ) -> Self:
        """Build on meta and load every weight, each name and shape checked first
        (hf_names; a miss is one line naming the file and tensor), taken as stored (no
        copy), cast to `dtype` if given, else to the embedding's. A tied model's
        lm_head.weight, when present, must be the embedding."""
        source = as_source(state_dict)
        with torch.device("meta"):
            model = cls(config)
        stored, ignore = source.shapes(), list(ignore)
        if config.tie_embeddings and "lm_head.weight" in stored:
            head = source.read("lm_head.weight").cpu()
            if EMBED in stored and not torch.equal(head, source.read(EMBED).cpu()):
                raise ValueError(
                    f"{source.name}: lm_head.weight differs from {EMBED}, so the "
                    "checkpoint is not tied: set tie_embeddings=False"
                )
            ignore.append("lm_head.weight")
        if dtype is None and EMBED in stored:
            dtype = source.read(EMBED).dtype
        load_weights(
            model,
            source,
            cls.hf_names,
            dtype=dtype,
            assign=True,
            expected_by="this config",
            fix=cls.load_fix,
            ignore=ignore,
        )
        with torch.device(model.embed.weight.device):
            model._init_rotary()  # its frequencies were made on meta
        return model

    @classmethod
    def from_hf(cls, state_dict: Weights, config, *, dtype: torch.dtype | None = None) -> Self:
        """Build one from weights named as in its transformers model (hf_names: e.g.
        model.embed_tokens, model.layers.N.self_attn.q_proj, ..., lm_head): a state dict
        or a TensorSource. Every name and shape is checked before any weight is used;
        the tensors are taken as they are (no copy), cast to `dtype` if given (float32,
        bfloat16, float16), else to the embedding's. A tied model's lm_head.weight, when
        present, must be the embedding. Names that extra_names_ignored gives are
        skipped."""
        ignore = cls.extra_names_ignored(as_source(state_dict).shapes(), config)
        return cls._load_hf(state_dict, config, dtype=dtype, ignore=ignore).eval()

    @classmethod
    def extra_names_ignored(cls, names: Iterable[str], config) -> list[str]:
        """Stored tensors the model does not use (none by default)."""
        return []

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu"
    ) -> Self:
        """Load a Hugging Face model directory: config.json and its *.safetensors files;
        the stop tokens of generation_config.json, where there is one, join config.json's
        (generate stops at any of them, as transformers)."""
        directory = Path(directory)
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"{directory} has no config.json; pass a Hugging Face model "
                "directory (config.json + *.safetensors)"
            )
        files = checkpoint_files(directory)
        config = cls.config_class.from_hf_config(
            json.loads((directory / "config.json").read_text())
        )
        generation = directory / "generation_config.json"
        if generation.is_file() and hasattr(config, "eos_token"):  # (instruct models list
            # their end-of-turn ids there; a multimodal config its text model's elsewhere)
            stops = hf_stop_tokens(json.loads(generation.read_text()))
            config.eos_token = tuple(dict.fromkeys((*config.eos_token, *stops)))
        return cls.from_hf(SafetensorsFiles(files, device=str(device)), config, dtype=dtype)
