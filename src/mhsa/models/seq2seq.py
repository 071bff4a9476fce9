"""The encoder-decoder Transformer of "Attention Is All You Need", for translation.

    source ids (B, S) -> embedding * sqrt(d) + sinusoidal positions -> post-norm
      encoder -> memory (B, S, d)
    target ids (B, T) -> embedding * sqrt(d) + sinusoidal positions -> post-norm
      decoder (causal self-attention, cross-attention to memory) -> logits (B, T, V)
      through the target embedding (tied), as in the paper

Training is teacher-forced. `translate` decodes greedily or with beam search; the
decoder keeps a KV cache for its self-attention, and cross-attention keys/values
are projected from the memory once per source sentence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..cache import DecoderCache
from ..core.validate import check_dropout
from ..nn import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from ..nn.positional import SinusoidalPositionalEncoding
from .beam_search import beam_search
from .config import ModelConfig
from .decoder import CacheLayout
from .decoding import greedy_search
from .init import normal_init
from .packing import IGNORE, mean_token_loss


@dataclass
class Seq2SeqConfig(ModelConfig):
    src_vocab: int
    tgt_vocab: int
    d_model: int = 128
    n_head: int = 4
    n_encoder_layer: int = 3
    n_decoder_layer: int = 3
    d_ff: int | None = None  # default 4 * d_model
    dropout: float = 0.1
    max_len: int = 64
    share_embeddings: bool = True  # one table for source and target (same vocabulary)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_dropout(self.dropout, "dropout")
        vocab = min(self.src_vocab, self.tgt_vocab)  # (pad serves both sides)
        for name in ("pad_id", "bos_id", "eos_id"):  # (eos 99 of 11: translate never stopped)
            value = getattr(self, name)
            if not 0 <= value < (vocab if name == "pad_id" else self.tgt_vocab):
                raise ValueError(f"{name} must be a token id of the vocabulary, got {value}")
        if self.share_embeddings and self.src_vocab != self.tgt_vocab:
            raise ValueError(
                f"share_embeddings needs src_vocab == tgt_vocab, got {self.src_vocab} and "
                f"{self.tgt_vocab}; use one vocabulary or share_embeddings=False"
            )


class Seq2Seq(nn.Module):
    embedding_name = "tgt_embed"  # the embedding the output head reads (tied)
    lm_head = None

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.tgt_embed = nn.Embedding(config.tgt_vocab, d)
        self.src_embed = (
            self.tgt_embed if config.share_embeddings else nn.Embedding(config.src_vocab, d)
        )
        self.positions = SinusoidalPositionalEncoding(d, config.max_len)
        self.dropout = nn.Dropout(config.dropout)
        options = {"dim_feedforward": config.d_ff or 4 * d, "dropout": config.dropout}
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(d, config.n_head, **options), config.n_encoder_layer
        )
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(d, config.n_head, **options), config.n_decoder_layer
        )
        self.apply(normal_init)

    def _embed(self, table: nn.Embedding, ids: Tensor, positions: Tensor | None = None) -> Tensor:
        x = table(ids) * math.sqrt(self.config.d_model)
        return self.dropout(self.positions(x, positions=positions))

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) ids -> (memory (B, S, d), key padding (B, S), True = real token)."""
        _check_ids("src", src, self.config.src_vocab, self.config.max_len)
        padding = src != self.config.pad_id
        return self.encoder(self._embed(self.src_embed, src), key_padding_mask=padding), padding

    def run_decoder(
        self, tgt: Tensor, memory: Tensor, padding: Tensor, cache: DecoderCache | None = None
    ) -> Tensor:
        """tgt (B, T) ids (only the new ones with a cache) -> logits (B, T, tgt_vocab)."""
        positions = None if cache is None else cache.next_positions(tgt.shape[1])
        x = self._embed(self.tgt_embed, tgt, positions)
        h = self.decoder(x, memory, causal=True, memory_key_padding_mask=padding, cache=cache)
        return h @ self.tgt_embed.weight.T

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher forcing: src (B, S), tgt (B, T) decoder inputs -> logits (B, T, V)."""
        _check_ids("tgt", tgt, self.config.tgt_vocab, self.config.max_len)
        return self.run_decoder(tgt, *self.encode(src))

    def loss(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        """Cross-entropy of tgt_out (B, T) given src and tgt_in, padding ignored (0 for
        a batch of padding alone, where F.cross_entropy gives nan)."""
        logits = self(src, tgt_in)
        targets = tgt_out.masked_fill(tgt_out == self.config.pad_id, IGNORE)
        return mean_token_loss(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def translate(
        self,
        src: Tensor,
        *,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        max_new_tokens: int | None = None,
        cache_memory: bool = True,
    ) -> list[list[int]]:
        """src (B, S) ids -> B lists of target ids (no <bos>, no <eos>). beam_size 1
        is greedy. cache_memory=False recomputes cross-attention keys/values at every
        step (same result, slower: for checking the cache)."""
        config = self.config
        max_new = config.max_len - 1 if max_new_tokens is None else max_new_tokens
        if not 0 < max_new < config.max_len:
            raise ValueError(f"max_new_tokens must be in [1, {config.max_len - 1}], got {max_new}")
        memory, padding = self.encode(src)
        decoder = Seq2SeqDecoder(
            self,
            memory.repeat_interleave(beam_size, dim=0),
            padding.repeat_interleave(beam_size, dim=0),
            cache_memory,
        )
        cache = decoder.make_caches(src.shape[0] * beam_size, max_new + 1)
        start = torch.full((src.shape[0], 1), config.bos_id, device=src.device)
        if beam_size == 1:
            return greedy_search(decoder, cache, start, config.eos_id, max_new)
        return beam_search(decoder, cache, start, config.eos_id, max_new, beam_size, length_penalty)


class Seq2SeqDecoder:
    """The decoder over one encoded batch, memory (B, S, d) with its key padding
    (B, S): a Decoder (mhsa.models.decoder). cache_memory=False projects the
    cross-attention keys/values at every step."""

    def __init__(
        self, model: Seq2Seq, memory: Tensor, padding: Tensor, cache_memory: bool = True
    ) -> None:
        self.model, self.memory, self.padding = model, memory, padding
        self.cache_memory = cache_memory

    @property
    def cache_layout(self) -> CacheLayout:
        config = self.model.config
        return CacheLayout(
            config.n_decoder_layer,
            config.n_head,
            config.d_model // config.n_head,
            self.memory.dtype,
            self.memory.device,
        )

    def make_caches(self, batch: int, max_len: int) -> DecoderCache:
        layout = self.cache_layout
        return DecoderCache(
            layout.num_layers,
            batch,
            layout.num_kv_heads,
            max_len,
            layout.head_dim,
            dtype=layout.dtype,
            device=layout.device,
            cache_memory=self.cache_memory,
        )

    def prefill(
        self, tokens: Tensor, caches: DecoderCache | None, *, start: Tensor | None = None
    ) -> Tensor:
        """Target tokens (B, T) -> logits (B, tgt_vocab) of the last; never left-padded."""
        if start is not None:
            raise ValueError("target prefixes are never left-padded: pass start=None")
        return self.model.run_decoder(tokens, self.memory, self.padding, caches)[:, -1]

    def step(self, tokens: Tensor, caches: DecoderCache) -> Tensor:
        """tokens (B, 1) -> logits (B, tgt_vocab)."""
        return self.model.run_decoder(tokens, self.memory, self.padding, caches)[:, -1]


def _check_ids(name: str, ids: Tensor, vocab: int, max_len: int) -> None:
    if ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(
            f"{name} must be (batch, length) int64 ids, got {ids.dtype} {tuple(ids.shape)}"
        )
    if ids.shape[1] > max_len:
        raise ValueError(f"{name} has {ids.shape[1]} tokens, more than max_len {max_len}")
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{name} ids must be in [0, {vocab}), got [{ids.min()}, {ids.max()}]")
