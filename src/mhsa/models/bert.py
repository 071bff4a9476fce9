"""BERT: a bidirectional post-norm Transformer encoder, loadable from Hugging Face files.

token + position + token-type embeddings -> layer norm
  -> num_layers post-norm blocks (self-attention, GELU feed-forward)
  -> last hidden states (B, S, hidden); pooler: tanh(dense(first token))
MLM head: dense -> GELU -> layer norm -> tied word embeddings -> vocabulary logits
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import TransformerEncoderLayer
from .init import normal_init


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1
    pad_token_id: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> BertConfig:
        """From a Hugging Face BERT config.json."""
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"only hidden_act 'gelu' is supported, got {hf['hidden_act']!r}")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            dropout=hf.get("hidden_dropout_prob", 0.1), pad_token_id=hf.get("pad_token_id", 0),
        )  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


class Bert(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_emb = nn.Embedding(config.vocab_size, hidden)
        self.pos_emb = nn.Embedding(config.max_position, hidden)
        self.type_emb = nn.Embedding(config.type_vocab_size, hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            TransformerEncoderLayer(
                hidden,
                config.num_heads,
                dim_feedforward=config.intermediate_size,
                dropout=config.dropout,
                activation="gelu",
                layer_norm_eps=config.layer_norm_eps,
            )  # fmt: skip
            for _ in range(config.num_layers)
        )
        self.pooler = nn.Linear(hidden, hidden)
        self.mlm_dense = nn.Linear(hidden, hidden)
        self.mlm_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.apply(normal_init)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """input_ids (B, S); attention_mask (B, S), 1/True = a real token -> (B, S, hidden)."""
        length = input_ids.shape[1]
        if length > self.config.max_position:
            raise ValueError(f"sequence of {length} tokens exceeds max_position "
                             f"{self.config.max_position}")  # fmt: skip
        positions = torch.arange(length, device=input_ids.device)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word_emb(input_ids) + self.pos_emb(positions) + self.type_emb(types)
        x = self.drop(self.emb_norm(x))
        padding = None if attention_mask is None else attention_mask.bool()
        for layer in self.layers:
            x = layer(x, key_padding_mask=padding)
        return x

    def pooled(self, hidden: Tensor) -> Tensor:
        """BERT's pooler: tanh(dense(hidden state of the first token)), (B, hidden)."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """(B, S, hidden) -> (B, S, vocab) through the MLM head with tied embeddings."""
        h = self.mlm_norm(F.gelu(self.mlm_dense(hidden)))
        return h @ self.word_emb.weight.T + self.mlm_bias

    def loss(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> Tensor:
        """Masked-language-model loss: labels (B, S) hold the original ids at the
        selected positions and -100 elsewhere."""
        logits = self.mlm_logits(self(input_ids, attention_mask))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Bert:
        """Load a Hugging Face BERT folder: config.json and model.safetensors (weights
        named as in transformers' BertModel, with or without a 'bert.' prefix)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        for name in ("config.json", "model.safetensors"):
            if not (directory / name).is_file():
                raise FileNotFoundError(
                    f"{directory / name} not found: need a Hugging Face "
                    "BERT folder with config.json and model.safetensors"
                )
        config = BertConfig.from_hf(json.loads((directory / "config.json").read_text()))
        config.dropout = 0.0
        weights = {k.removeprefix("bert."): v for k, v in
                   load_file(directory / "model.safetensors").items()}  # fmt: skip
        model = cls(config)
        model.load_hf_weights(weights)
        return model.eval()

    @torch.no_grad()
    def load_hf_weights(self, sd: dict[str, Tensor]) -> None:
        """Copy weights named as in transformers' BertModel into this model."""

        def copy(module: nn.Module, prefix: str) -> None:
            module.weight.copy_(sd[prefix + ".weight"])
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(sd[prefix + ".bias"])

        copy(self.word_emb, "embeddings.word_embeddings")
        copy(self.pos_emb, "embeddings.position_embeddings")
        copy(self.type_emb, "embeddings.token_type_embeddings")
        copy(self.emb_norm, "embeddings.LayerNorm")
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            attn = layer.self_attn
            for proj, name in (
                (attn.q_proj, "query"),
                (attn.k_proj, "key"),
                (attn.v_proj, "value"),
            ):
                copy(proj, p + "attention.self." + name)
            copy(attn.out_proj, p + "attention.output.dense")
            copy(layer.attn_block.norm, p + "attention.output.LayerNorm")
            copy(layer.feed_forward.linear1, p + "intermediate.dense")
            copy(layer.feed_forward.linear2, p + "output.dense")
            copy(layer.ff_block.norm, p + "output.LayerNorm")
        if "pooler.dense.weight" in sd:
            copy(self.pooler, "pooler.dense")


def mean_pool(hidden: Tensor, attention_mask: Tensor, normalize: bool = True) -> Tensor:
    """Sentence embeddings: the mean of real tokens' hidden states (B, hidden), L2-normalised."""
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, dim=-1) if normalize else pooled
