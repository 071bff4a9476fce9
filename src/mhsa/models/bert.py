"""BERT: a bidirectional post-norm Transformer encoder, loadable from Hugging Face files.

token + position + token-type embeddings -> layer norm
  -> n_layer post-norm blocks (self-attention, GELU feed-forward of width d_ff)
  -> last hidden states (B, S, d_model); pooler: tanh(dense(first token))
MLM head: dense -> GELU -> layer norm -> tied word embeddings -> vocabulary logits
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.validate import check_dropout
from ..formats.tensor_sources import checkpoint_files
from ..formats.weights import (
    NameTable,
    Rule,
    SafetensorsFiles,
    Weights,
    as_source,
    load_weights,
)
from ..nn import encoder_layers
from .config import ModelConfig
from .decoding import check_token_ids
from .init import normal_init
from .packing import mean_token_loss, packed_row


@dataclass
class BertConfig(ModelConfig):
    """BERT's sizes in the models' one vocabulary (transformers' hidden_size is d_model,
    num_hidden_layers n_layer, num_attention_heads n_head, intermediate_size d_ff,
    max_position_embeddings max_len, layer_norm_eps norm_eps: from_hf_config reads them)."""

    # the names that `mhsa train bert` checkpoints of older versions saved
    renamed = {
        "hidden_size": "d_model",
        "num_layers": "n_layer",
        "num_heads": "n_head",
        "intermediate_size": "d_ff",
        "max_position": "max_len",
        "layer_norm_eps": "norm_eps",
    }

    vocab_size: int = 30522
    d_model: int = 384
    n_layer: int = 6
    n_head: int = 12
    d_ff: int = 1536
    max_len: int = 512  # positions (max_position_embeddings)
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    dropout: float = 0.1
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_dropout(self.dropout, "dropout")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id must be a token id of the vocabulary, got {self.pad_token_id}"
            )

    @classmethod
    def from_hf_config(cls, hf: dict) -> BertConfig:
        """From a Hugging Face BERT config.json (its dict)."""
        kind = hf.get("model_type", "bert")
        if kind != "bert":
            # RoBERTa-family files use BERT's weight names but start positions at
            # pad_token_id + 1: loaded as BERT they would run, every hidden state wrong
            raise ValueError(
                f"model_type {kind!r} is not BERT: Bert.from_pretrained reads BERT "
                "(model_type 'bert') folders only"
            )
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"only hidden_act 'gelu' is supported, got {hf['hidden_act']!r}")
        return cls(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layer=hf["num_hidden_layers"],
            n_head=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"],
            max_len=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            norm_eps=hf.get("layer_norm_eps", 1e-12),
            dropout=hf.get("hidden_dropout_prob", 0.1),
            pad_token_id=hf.get("pad_token_id") or 0,
        )


class Bert(nn.Module):
    embedding_name = "word_emb"  # the embedding the MLM head reads (tied)
    lm_head = None

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.d_model
        self.word_emb = nn.Embedding(config.vocab_size, hidden)
        self.pos_emb = nn.Embedding(config.max_len, hidden)
        self.type_emb = nn.Embedding(config.type_vocab_size, hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.drop = nn.Dropout(config.dropout)
        self.layers = encoder_layers(
            config.n_layer,
            hidden,
            config.n_head,
            dim_feedforward=config.d_ff,
            dropout=config.dropout,
            activation="gelu",
            layer_norm_eps=config.norm_eps,
        )
        self.pooler = nn.Linear(hidden, hidden)
        self.mlm_dense = nn.Linear(hidden, hidden)
        self.mlm_norm = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.apply(normal_init)
        # the optional parts (pooler, MLM head) a loaded file did not hold: untrained
        self.not_in_file: tuple[str, ...] = ()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        cu_seqlens: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """input_ids (B, S); attention_mask (B, S), 1/True = a real token -> (B, S, d_model).

        cu_seqlens (N+1,) and/or position_ids (S,) restarting at 0: input_ids (1, S)
        packs N sequences (mhsa.models.packing), each attending only itself, its
        positions from 0; an attention_mask then must be all ones (padding inside a
        pack is refused)."""
        check_token_ids(input_ids, self.config.vocab_size, "input_ids")
        if token_type_ids is not None:
            check_token_ids(token_type_ids, self.config.type_vocab_size, "token_type_ids")
        for name, given in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if given is not None and given.shape != input_ids.shape:
                raise ValueError(
                    f"{name} must have input_ids' shape {tuple(input_ids.shape)}, "
                    f"got {tuple(given.shape)}"
                )
        mask, padding = None, None
        if cu_seqlens is not None or position_ids is not None:
            row = packed_row(input_ids, cu_seqlens, position_ids, attention_mask)
            mask, positions = row.pattern(causal=False), row.positions
            longest = int(row.cu_seqlens.diff().max()) if row.cu_seqlens.numel() > 1 else 0
        else:  # (a static length: export traces this)
            longest = input_ids.shape[1]
            positions = torch.arange(longest, device=input_ids.device)
            padding = None if attention_mask is None else attention_mask.bool()
        if longest > self.config.max_len:
            raise ValueError(
                f"sequence of {longest} tokens exceeds max_len {self.config.max_len} (the "
                "model's positions, max_position_embeddings): pass at most that many tokens"
            )
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word_emb(input_ids) + self.pos_emb(positions) + self.type_emb(types)
        x = self.drop(self.emb_norm(x))
        for layer in self.layers:
            x = layer(x, mask=mask, key_padding_mask=padding)
        return x

    def pooled(self, hidden: Tensor) -> Tensor:
        """BERT's pooler: tanh(dense(hidden state of the first token)), (B, d_model)."""
        self._warn_if_untrained("pooler", "pooled()")
        return torch.tanh(self.pooler(hidden[:, 0]))

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """(B, S, d_model) -> (B, S, vocab) through the MLM head with tied embeddings."""
        self._warn_if_untrained("MLM head", "mlm_logits()")
        h = self.mlm_norm(F.gelu(self.mlm_dense(hidden)))
        return h @ self.word_emb.weight.T + self.mlm_bias

    def loss(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        labels: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Masked-language-model loss: labels (B, S) hold the original ids at the
        selected positions and -100 elsewhere (packing: see forward)."""
        hidden = self(input_ids, attention_mask, cu_seqlens=cu_seqlens, position_ids=position_ids)
        logits = self.mlm_logits(hidden)
        return mean_token_loss(logits.flatten(0, 1), labels.flatten())

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Bert:
        """Load a Hugging Face BERT folder: config.json and model.safetensors, or its
        shards (weights named as in transformers' BertModel, with or without a 'bert.'
        prefix)."""
        directory = Path(directory)
        if not (directory / "config.json").is_file() or not list(directory.glob("*.safetensors")):
            raise FileNotFoundError(
                f"{directory}: need a Hugging Face BERT folder with config.json and "
                "model.safetensors (or its shards)"
            )
        files = checkpoint_files(directory)
        config = BertConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
        config.dropout = 0.0
        model = cls(config)
        model.load_hf_weights(SafetensorsFiles(files))
        return model.eval()

    def load_hf_weights(self, weights: Weights) -> None:
        """Load weights named as in transformers' BertModel (a state dict or a
        TensorSource) into this model, every name and shape checked first (BERT_NAMES;
        the pooler and the MLM head are optional: a BertModel file has no MLM head)."""
        fix = "check that config.json (num_hidden_layers, hidden_size, vocab_size) matches it"
        source = as_source(weights)
        load_weights(self, source, BERT_NAMES, fix=fix)
        stored = {name.removeprefix(BERT_NAMES.prefix): name for name in source.shapes()}
        if "cls.predictions.decoder.weight" in stored:
            decoder = source.read(stored["cls.predictions.decoder.weight"]).cpu()
            embedding = self.word_emb.weight.detach().cpu()
            if not torch.equal(decoder.to(embedding.dtype), embedding):
                raise ValueError(
                    f"{source.name}: cls.predictions.decoder.weight differs from the word "
                    "embeddings: this MLM head is untied, and mlm_logits() reads only tied "
                    "heads; load it without the decoder (a BertModel file)"
                )
        parts = {"pooler": "pooler.dense.weight", "MLM head": "cls.predictions.bias"}
        self.not_in_file = tuple(part for part, name in parts.items() if name not in stored)

    def _warn_if_untrained(self, part: str, call: str) -> None:
        if part in self.not_in_file:
            warnings.warn(
                f"{call}: this BERT's weights file holds no {part}, so it runs on "
                "untrained initial weights",
                stacklevel=3,
            )


BERT_NAMES = NameTable(  # our names <-> transformers' BertModel ("bert." optional)
    ("word_emb.weight", "embeddings.word_embeddings.weight"),
    ("pos_emb.weight", "embeddings.position_embeddings.weight"),
    ("type_emb.weight", "embeddings.token_type_embeddings.weight"),
    ("emb_norm.{p}", "embeddings.LayerNorm.{p}"),
    ("layers.{i}.self_attn.q_proj.{p}", "encoder.layer.{i}.attention.self.query.{p}"),
    ("layers.{i}.self_attn.k_proj.{p}", "encoder.layer.{i}.attention.self.key.{p}"),
    ("layers.{i}.self_attn.v_proj.{p}", "encoder.layer.{i}.attention.self.value.{p}"),
    ("layers.{i}.self_attn.out_proj.{p}", "encoder.layer.{i}.attention.output.dense.{p}"),
    ("layers.{i}.attn_block.norm.{p}", "encoder.layer.{i}.attention.output.LayerNorm.{p}"),
    ("layers.{i}.feed_forward.linear1.{p}", "encoder.layer.{i}.intermediate.dense.{p}"),
    ("layers.{i}.feed_forward.linear2.{p}", "encoder.layer.{i}.output.dense.{p}"),
    ("layers.{i}.ff_block.norm.{p}", "encoder.layer.{i}.output.LayerNorm.{p}"),
    Rule("pooler.{p}", "pooler.dense.{p}", optional=True),
    # BertForMaskedLM's head, when the file has it (a BertModel file has not)
    Rule("mlm_dense.{p}", "cls.predictions.transform.dense.{p}", optional=True),
    Rule("mlm_norm.{p}", "cls.predictions.transform.LayerNorm.{p}", optional=True),
    Rule("mlm_bias", "cls.predictions.bias", optional=True),
    # positions 0..max-1 (a buffer); the head's decoder is the tied embedding and its bias
    ignore=("embeddings.position_ids", "cls.predictions.decoder.{p}", "cls.seq_relationship.{p}"),
    prefix="bert.",
)


def mean_pool(hidden: Tensor, attention_mask: Tensor, normalize: bool = True) -> Tensor:
    """Sentence embeddings: the mean of real tokens' hidden states (B, d_model), L2-normalised."""
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, dim=-1) if normalize else pooled
