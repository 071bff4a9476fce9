"""Whisper (Radford et al. 2022): speech recognition with an encoder-decoder Transformer.

    log-mel (B, 80, 3000) -> conv1d k3 + GELU -> conv1d k3 stride 2 + GELU -> (B, 1500, d)
        + sinusoidal positions -> pre-norm encoder blocks -> layer norm -> memory
    tokens (B, T) -> token embedding + learned positions -> pre-norm decoder blocks
        (causal self-attention, cross-attention to memory) -> layer norm
        -> logits (B, T, vocab) through the token embedding (tied)

Whisper's key projections have no bias; ours keep one, loaded as zeros. Weights load
from a CTranslate2 conversion (`Whisper.from_ctranslate2`). `generate` decodes
greedily with the self-attention KV cache and the cross-attention keys/values
projected once, suppressing the tokens CTranslate2 suppresses by default.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import DecoderCache
from ..core.validate import int_at_least
from ..formats import ctranslate2_header, read_ctranslate2
from ..formats.weights import NameTable, TensorDict, load_weights
from ..nn import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from ..nn.layout import decoding_layout
from ..nn.positional import LearnedPositionalEmbedding
from .config import ModelConfig
from .decoder import CacheLayout
from .decoding import compiled_once, greedy_search, static_caches

MULTILINGUAL_VOCAB = 51865  # multilingual Whisper vocabularies have this many tokens or more


@dataclass
class WhisperConfig(ModelConfig):
    """Sizes of Whisper tiny.en by default, and the special tokens decoding needs, in
    the models' vocabulary (OpenAI's n_vocab, n_audio_layer and n_text_layer are
    vocab_size, n_encoder_layer and n_decoder_layer; its context lengths keep their
    names)."""

    n_mels: int = 80
    n_audio_ctx: int = 1500  # encoder positions: mel frames / 2
    vocab_size: int = 51864
    n_text_ctx: int = 448  # decoder positions
    d_model: int = 384
    n_head: int = 6
    n_encoder_layer: int = 4  # audio (encoder) blocks
    n_decoder_layer: int = 4  # text (decoder) blocks
    eot_id: int = 50256  # <|endoftext|>; every id from here on is a special token
    prompt: tuple[int, ...] = (50257, 50362)  # <|startoftranscript|><|notimestamps|>
    suppress_ids: tuple[int, ...] = ()  # never generated
    suppress_ids_begin: tuple[int, ...] = ()  # not generated as the first token

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "n_mels",
            "n_audio_ctx",
            "vocab_size",
            "n_text_ctx",
            "d_model",
            "n_head",
            "n_encoder_layer",
            "n_decoder_layer",
        ):
            int_at_least(name, getattr(self, name), 1)
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if not self.prompt:
            raise ValueError("prompt must hold at least <|startoftranscript|>")


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """(length, channels) Whisper's audio positions: sines in the first half of the
    channels, cosines in the second, timescales geometric from 1 to max_timescale."""
    if channels % 2:
        raise ValueError(f"channels must be even, got {channels}")
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float64))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_timescales[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class Whisper(nn.Module):
    def __init__(self, config: WhisperConfig, tokenizer=None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer (GPT-2 byte-level BPE), for decode()
        d = config.d_model
        options = {
            "dim_feedforward": 4 * d,
            "dropout": 0.0,
            "activation": "gelu",
            "norm_first": True,
        }
        self.conv1 = nn.Conv1d(config.n_mels, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.register_buffer("audio_positions", whisper_sinusoids(config.n_audio_ctx, d))
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(d, config.n_head, **options),
            config.n_encoder_layer,
            nn.LayerNorm(d),
        )
        self.token_embedding = nn.Embedding(config.vocab_size, d)
        self.text_positions = LearnedPositionalEmbedding(config.n_text_ctx, d)
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(d, config.n_head, **options),
            config.n_decoder_layer,
            nn.LayerNorm(d),
        )

    def encode(self, mel: Tensor) -> Tensor:
        """mel (B, n_mels, 2 * n_audio_ctx) log-mel features -> memory (B, n_audio_ctx, d)."""
        want = (self.config.n_mels, 2 * self.config.n_audio_ctx)
        if mel.dim() != 3 or tuple(mel.shape[1:]) != want:
            raise ValueError(
                f"mel must be (batch, {want[0]}, {want[1]}), got {tuple(mel.shape)}; make it "
                "with mhsa.data.whisper_audio.log_mel_spectrogram (30 s windows) and add a "
                "batch dimension"
            )
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x))  # (B, d, n_audio_ctx)
        x = x.transpose(1, 2) + self.audio_positions
        return self.encoder(x)

    def logits(self, tokens: Tensor, memory: Tensor, cache: DecoderCache | None = None) -> Tensor:
        """tokens (B, T), memory (B, S, d) -> logits (B, T, vocab_size).

        With a cache, tokens continue the ones it holds (causal, aligned bottom-right)."""
        positions = None if cache is None else cache.next_positions(tokens.shape[1])
        x = self.text_positions(self.token_embedding(tokens), positions=positions)
        x = self.decoder(x, memory, causal=True, cache=cache)
        return x @ self.token_embedding.weight.T

    def forward(self, mel: Tensor, tokens: Tensor) -> Tensor:
        """mel (B, n_mels, frames), tokens (B, T) -> logits (B, T, vocab_size), teacher-forced."""
        return self.logits(tokens, self.encode(mel))

    def decoding_layout(self) -> Whisper:
        """For decoding on CPU: the decoder's self-attention q, k, v fused, its float32
        weights and the token embedding (the output head) stored transposed
        (mhsa.nn.layout; one-row matmuls read them faster); the encoder keeps its
        layout. Returns self. Inference only."""
        for layer in self.decoder.layers:
            layer.self_attn.fuse_projections()
        return decoding_layout(self, "token_embedding", part=self.decoder)

    def make_cache(self, batch: int, max_len: int, *, cache_memory: bool = True) -> DecoderCache:
        """An empty decoder cache for `batch` sequences of up to `max_len` tokens;
        cache_memory=False projects the cross-attention keys/values at every step."""
        config, param = self.config, self.token_embedding.weight
        return DecoderCache(
            config.n_decoder_layer,
            batch,
            config.n_head,
            max_len,
            config.d_model // config.n_head,
            dtype=param.dtype,
            device=param.device,
            cache_memory=cache_memory,
        )

    def suppress(self, logits: Tensor, first: bool) -> Tensor:
        """logits (B, vocab_size) with the suppressed tokens set to -inf (and the
        begin-suppressed ones too for the first generated token)."""
        ids = list(self.config.suppress_ids)
        if first:
            ids += self.config.suppress_ids_begin
        if not ids:
            return logits
        return logits.index_fill(-1, torch.tensor(ids, device=logits.device), -math.inf)

    @torch.no_grad()
    def generate(
        self,
        mel: Tensor,
        *,
        max_new_tokens: int | None = None,
        reuse_memory: bool = True,
        return_logits: bool = False,
        compile: bool = False,
    ) -> list[list[int]] | tuple[list[list[int]], Tensor]:
        """Greedy transcription of mel (B, n_mels, frames) after the config's prompt.

        Stops at <|endoftext|> or after max_new_tokens (default n_text_ctx // 2, as
        CTranslate2). reuse_memory=False projects the cross-attention keys/values
        again at every step instead of once (same result, slower; for tests).
        Returns each sequence's generated ids (prompt and <|endoftext|> excluded), and
        with return_logits also the raw logits of every step (B, steps, vocab_size).
        compile: the steps after the prompt through one compiled decoder step
        (mhsa.models.decoding.compiled_once) over StaticKVCaches.
        """
        config = self.config
        prompt_len = len(config.prompt)
        max_new = config.n_text_ctx // 2 if max_new_tokens is None else max_new_tokens
        if not 1 <= max_new <= config.n_text_ctx - prompt_len:
            raise ValueError(
                f"max_new_tokens must be in [1, {config.n_text_ctx - prompt_len}] (n_text_ctx "
                f"minus the prompt), got {max_new}"
            )
        decoder = WhisperTextDecoder(
            self, self.encode(mel), cache_memory=reuse_memory, compile=compile, record=return_logits
        )
        batch = decoder.memory.shape[0]
        cache = decoder.make_caches(batch, prompt_len + max_new)
        prompt = torch.tensor(config.prompt, device=decoder.memory.device).expand(batch, -1)
        ids = greedy_search(decoder, cache, prompt, config.eot_id, max_new)
        return (ids, torch.stack(decoder.seen, dim=1)) if return_logits else ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped), by the checkpoint's tokenizer.json."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; load it with Whisper.from_ctranslate2")
        return self.tokenizer.decode([i for i in ids if i < self.config.eot_id])

    @classmethod
    def from_ctranslate2(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> Whisper:
        """Load a CTranslate2 Whisper conversion: a folder with model.bin, config.json
        (suppressed tokens), vocabulary.txt (token strings, one per line by id: the ids
        CTranslate2 uses; or vocabulary.json, a list, as ctranslate2 >= 3 writes it) and
        tokenizer.json (read with the `tokenizers` package). Every tensor's name and shape
        is checked against the model first (CT2_NAMES)."""
        directory = Path(directory)
        vocabulary_file = _vocabulary_file(directory)
        for path in (
            directory / "model.bin",
            directory / "config.json",
            vocabulary_file,
            directory / "tokenizer.json",
        ):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path}: missing; pass the folder of a CTranslate2 Whisper conversion "
                    "(model.bin, config.json, vocabulary.txt or .json, tokenizer.json)"
                )
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise RuntimeError(
                "Whisper's text tokens need the tokenizers package: pip install tokenizers "
                "(or pip install -e '.[whisper]')"
            ) from error
        spec = ctranslate2_header(directory)[1]
        if spec != "WhisperSpec":
            raise ValueError(f"{directory}: holds a {spec} CTranslate2 model, not a WhisperSpec")
        tensors = read_ctranslate2(directory, dtype=dtype)
        extra = json.loads((directory / "config.json").read_text())
        vocabulary = _read_vocabulary(vocabulary_file)
        path = directory / "model.bin"
        try:
            vocabulary = vocabulary[: tensors["decoder/embeddings/weight"].shape[0]]
            config = _config_from_ctranslate2(tensors, vocabulary, extra, vocabulary_file)
        except KeyError as error:
            raise ValueError(
                f"{path}: 1 tensor missing: {error.args[0]!r} (the model's sizes are read off "
                "it): not a complete Whisper conversion; download or convert it again"
            ) from None
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        model = cls(config, tokenizer).to(dtype)
        fix = "a damaged or mismatched conversion; download or convert it again"
        load_weights(model, TensorDict(tensors, str(path)), CT2_NAMES, fix=fix)
        return model.to(device).eval()


def _vocabulary_file(directory: Path) -> Path:
    """vocabulary.txt, or vocabulary.json where only that exists (ctranslate2 >= 3)."""
    text, listed = directory / "vocabulary.txt", directory / "vocabulary.json"
    return listed if listed.is_file() and not text.is_file() else text


def _read_vocabulary(file: Path) -> list[str]:
    """The token strings by id: one a line (.txt) or a JSON list (.json)."""
    text = file.read_text(encoding="utf-8")
    return json.loads(text) if file.suffix == ".json" else text.split("\n")


def _config_from_ctranslate2(tensors, vocabulary, extra, vocabulary_file: Path) -> WhisperConfig:
    """The sizes read off the tensors' shapes (a missing one raises KeyError) and the
    special tokens' ids off the vocabulary."""
    num_heads = tensors["encoder/num_heads"]
    if num_heads.numel() != 1 or num_heads.is_floating_point():
        raise ValueError(f"encoder/num_heads must be one integer, got {num_heads.tolist()}")
    ids = {token: i for i, token in enumerate(vocabulary)}
    prompt = ["<|startoftranscript|>", "<|notimestamps|>"]
    # multilingual (transcribe English): by the vocabulary, as OpenAI's code and
    # CTranslate2 tell; an English-only model's config may list lang_ids all the same
    if len(vocabulary) >= MULTILINGUAL_VOCAB:
        prompt[1:1] = ["<|en|>", "<|transcribe|>"]
    missing = [token for token in ["<|endoftext|>", *prompt] if token not in ids]
    if missing:
        raise ValueError(f"{vocabulary_file} lacks the special tokens {missing}")
    return WhisperConfig(
        n_mels=tensors["encoder/conv1/weight"].shape[1],
        n_audio_ctx=tensors["encoder/position_encodings/encodings"].shape[0],
        vocab_size=len(vocabulary),
        n_text_ctx=tensors["decoder/position_encodings/encodings"].shape[0],
        d_model=tensors["encoder/conv1/weight"].shape[0],
        n_head=int(num_heads),
        n_encoder_layer=_count_layers(tensors, "encoder"),
        n_decoder_layer=_count_layers(tensors, "decoder"),
        eot_id=ids["<|endoftext|>"],
        prompt=tuple(ids[token] for token in prompt),
        suppress_ids=tuple(extra.get("suppress_ids") or ()),  # null in a new conversion
        suppress_ids_begin=tuple(extra.get("suppress_ids_begin") or ()),
    )


def _count_layers(tensors: dict[str, Tensor], stack: str) -> int:
    pattern = re.compile(rf"{stack}/layer_(\d+)/")
    return len({match[1] for name in tensors if (match := pattern.match(name))})


def _norm(ours: str, theirs: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """A layer norm's rules: CTranslate2 names its weight gamma and its bias beta."""
    return (f"{ours}.weight", f"{theirs}/gamma"), (f"{ours}.bias", f"{theirs}/beta")


def _qkv(ours: str, parts: str) -> tuple[str, ...]:
    return tuple(f"{ours}.{x}_proj.{{p}}" for x in parts)


CT2_NAMES = NameTable(  # our names <-> a CTranslate2 WhisperSpec's; q|k|v and k|v fused
    ("audio_positions", "encoder/position_encodings/encodings"),
    ("conv1.{p}", "encoder/conv1/{p}"),
    ("conv2.{p}", "encoder/conv2/{p}"),
    *_norm("encoder.layers.{i}.attn_block.norm", "encoder/layer_{i}/self_attention/layer_norm"),
    (_qkv("encoder.layers.{i}.self_attn", "qkv"), "encoder/layer_{i}/self_attention/linear_0/{p}"),
    ("encoder.layers.{i}.self_attn.out_proj.{p}", "encoder/layer_{i}/self_attention/linear_1/{p}"),
    *_norm("encoder.layers.{i}.ff_block.norm", "encoder/layer_{i}/ffn/layer_norm"),
    ("encoder.layers.{i}.feed_forward.linear1.{p}", "encoder/layer_{i}/ffn/linear_0/{p}"),
    ("encoder.layers.{i}.feed_forward.linear2.{p}", "encoder/layer_{i}/ffn/linear_1/{p}"),
    *_norm("encoder.norm", "encoder/layer_norm"),
    ("token_embedding.weight", "decoder/embeddings/weight"),
    ("text_positions.embedding.weight", "decoder/position_encodings/encodings"),
    *_norm("decoder.layers.{i}.self_block.norm", "decoder/layer_{i}/self_attention/layer_norm"),
    (_qkv("decoder.layers.{i}.self_attn", "qkv"), "decoder/layer_{i}/self_attention/linear_0/{p}"),
    ("decoder.layers.{i}.self_attn.out_proj.{p}", "decoder/layer_{i}/self_attention/linear_1/{p}"),
    *_norm("decoder.layers.{i}.cross_block.norm", "decoder/layer_{i}/attention/layer_norm"),
    ("decoder.layers.{i}.cross_attn.q_proj.{p}", "decoder/layer_{i}/attention/linear_0/{p}"),
    (_qkv("decoder.layers.{i}.cross_attn", "kv"), "decoder/layer_{i}/attention/linear_1/{p}"),
    ("decoder.layers.{i}.cross_attn.out_proj.{p}", "decoder/layer_{i}/attention/linear_2/{p}"),
    *_norm("decoder.layers.{i}.ff_block.norm", "decoder/layer_{i}/ffn/layer_norm"),
    ("decoder.layers.{i}.feed_forward.linear1.{p}", "decoder/layer_{i}/ffn/linear_0/{p}"),
    ("decoder.layers.{i}.feed_forward.linear2.{p}", "decoder/layer_{i}/ffn/linear_1/{p}"),
    *_norm("decoder.norm", "decoder/layer_norm"),
    # flags and head counts (encoder/num_heads...); the output head is the tied embedding
    ignore=("encoder/{any}", "decoder/{any}", "decoder/projection/weight"),
)


class WhisperTextDecoder:
    """Whisper's text decoder over one encoder output, memory (B, S, d): a Decoder
    (mhsa.models.decoder) whose logits have the suppressed tokens at -inf (the
    begin-suppressed ones too after the prompt). cache_memory=False projects the
    cross-attention keys/values at every step; compile runs the steps after the prompt
    through one compiled decoder step over StaticKVCaches; record keeps every call's
    raw logits (B, vocab_size) in `seen`."""

    def __init__(
        self,
        model: Whisper,
        memory: Tensor,
        *,
        cache_memory: bool = True,
        compile: bool = False,
        record: bool = False,
    ) -> None:
        self.model, self.memory = model, memory
        self.cache_memory, self.compile, self.record = cache_memory, compile, record
        self.seen: list[Tensor] = []
        self._compiled = None

    @property
    def cache_layout(self) -> CacheLayout:
        config, param = self.model.config, self.model.token_embedding.weight
        return CacheLayout(
            config.n_decoder_layer,
            config.n_head,
            config.d_model // config.n_head,
            param.dtype,
            param.device,
        )

    def make_caches(self, batch: int, max_len: int) -> DecoderCache:
        return self.model.make_cache(batch, max_len, cache_memory=self.cache_memory)

    def prefill(
        self, tokens: Tensor, caches: DecoderCache | None, *, start: Tensor | None = None
    ) -> Tensor:
        """The prompt tokens (B, T) -> logits (B, vocab_size); prompts are never padded."""
        if start is not None:
            raise ValueError("Whisper's prompts are never left-padded: pass start=None")
        logits = self.model.logits(tokens, self.memory, caches)[:, -1]
        if self.compile and caches is not None:  # the prompt is in: the steps run compiled
            model, memory = self.model, self.memory
            steps = caches.to_static(static_caches(caches.self_attn))
            self._compiled = compiled_once(model, _logits_step, lambda t: (model, t, memory, steps))
        return self._seen(logits, first=True)

    def step(self, tokens: Tensor, caches: DecoderCache) -> Tensor:
        """tokens (B, 1) -> logits (B, vocab_size)."""
        if self._compiled is not None:
            logits = self._compiled(tokens)[:, -1]
        else:
            logits = self.model.logits(tokens, self.memory, caches)[:, -1]
        return self._seen(logits, first=False)

    def _seen(self, logits: Tensor, first: bool) -> Tensor:
        if self.record:
            self.seen.append(logits)
        return self.model.suppress(logits, first=first)


def _logits_step(model: Whisper, tokens: Tensor, memory: Tensor, cache: DecoderCache) -> Tensor:
    return model.logits(tokens, memory, cache)
