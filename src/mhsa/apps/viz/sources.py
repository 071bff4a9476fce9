"""What the explorer records for each kind of model: its attention modules, how to run
it on one input, and the labels of the queries and keys.

    gpt_source(model, text)        a GPT checkpoint's self-attention, byte tokens
    chat_source(chat, text)        a chat model's (SmolLM2) self-attention, its tokens
    minilm_source(encoder, text)   MiniLM's (BERT) self-attention, WordPiece tokens
    whisper_source(model, wav)     Whisper's decoder cross-attention: text tokens
                                   against audio frames (20 ms each)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...nn import MultiHeadAttention
from .maps import mapped_attention

FRAME_SECONDS = 0.02  # one Whisper encoder frame: 2 mel hops of 10 ms


@dataclass
class Source:
    """One input's attention to record.

    layers: (name, module) per attention layer, in the order they run; run(): the
    forward pass (each module sees batch 1); queries (L labels) and keys (S labels,
    None: the queries, i.e. self-attention). key_limit: how many keys to show (the
    rest, e.g. Whisper's padding of its 30 s window, is left out of the maps); note:
    one line for the page about the input."""

    title: str
    layers: list[tuple[str, MultiHeadAttention]]
    run: Callable[[], object]
    queries: list[str]
    keys: list[str] | None = None
    key_limit: int | None = None
    note: str = ""

    @property
    def num_heads(self) -> int:
        return self.layers[0][1].num_heads

    @property
    def self_attention(self) -> bool:
        return self.keys is None


def _attention_layers(model: torch.nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    return [(f"layer {i}", m) for i, m in enumerate(mapped_attention(model))]


def _visible(text: str) -> str:
    """A token's text with line breaks and tabs spelled out, a blank one's spaces as
    open boxes, never empty."""
    text = text.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    if text and not text.strip():
        text = text.replace(" ", "\u2423")
    return text or "\u2205"


def _device(model) -> torch.device:
    """Where model's weights are: its inputs go there."""
    return next(model.parameters()).device


def _check_text(text: str) -> None:
    if not text:
        raise ValueError("--text must not be empty: pass the text whose attention to show")


def gpt_source(model, text: str, name: str = "GPT") -> Source:
    """A GPT (mhsa.models.GPT) on text's UTF-8 bytes (the `mhsa train gpt` tokenizer)."""
    from ...data.text import ByteTokenizer

    tokens = ByteTokenizer().encode(text)
    if not 0 < tokens.numel() <= model.config.max_len:
        raise ValueError(f"--text must be 1..{model.config.max_len} bytes, got {tokens.numel()}")
    labels = [_visible(chr(t)) if t < 128 else f"\\x{t:02x}" for t in tokens.tolist()]
    return Source(
        name,
        _attention_layers(model),
        lambda: model(tokens.view(1, -1).to(_device(model))),
        labels,
        note=f"{len(labels)} bytes",
    )


def chat_source(chat, text: str) -> Source:
    """A chat model (mhsa.apps.chat.ChatModel) on text's tokens, as its tokenizer encodes them
    (no chat template)."""
    _check_text(text)
    ids = chat.tokenizer.encode(text)
    limit = chat.model.config.max_len
    if not 0 < len(ids) <= limit:
        raise ValueError(f"--text must be 1..{limit} tokens for {chat.name}, got {len(ids)}")
    labels = [_visible(chat.tokenizer.decode([i], skip_special_tokens=False)) for i in ids]
    tokens = torch.tensor([ids], device=_device(chat.model))
    return Source(
        chat.name,
        _attention_layers(chat.model),
        lambda: chat.model(tokens),
        labels,
        note=f"{len(ids)} tokens",
    )


def minilm_source(encoder, text: str) -> Source:
    """A sentence encoder (mhsa.apps.embed.SentenceEncoder: BERT) on text's WordPiece tokens,
    [CLS] and [SEP] included; the tokenizer truncates past the model's max length."""
    _check_text(text)
    ids, mask = encoder.tokenize([text])
    labels = [encoder.tokenizer.id_to_token(i) for i in ids[0].tolist()]
    truncated = encoder.tokenizer.encode(text).overflowing
    note = f"{len(labels)} tokens" + (" (truncated)" if truncated else "")
    return Source(
        "all-MiniLM-L6-v2",
        _attention_layers(encoder.model),
        lambda: encoder.model(ids.to(_device(encoder.model)), mask.to(_device(encoder.model))),
        labels,
        note=note,
    )


def whisper_source(model, audio: str | Path, text: str | None = None) -> Source:
    """Whisper's decoder cross-attention for a WAV file's first 30 s: the prompt and the
    text tokens (text, or the model's greedy transcript) against the audio frames
    (20 ms each; the silence padding the window to 30 s is left out of the maps)."""
    from ...data.whisper_audio import N_SAMPLES, SAMPLE_RATE, log_mel_spectrogram
    from ..transcribe import load_audio

    if text is not None:
        _check_text(text)
    waveform = load_audio(audio)[:N_SAMPLES]
    if waveform.numel() == 0:
        raise ValueError(f"{audio}: the recording is empty")
    with torch.no_grad():
        mel = log_mel_spectrogram(waveform)[None].to(_device(model))
        memory = model.encode(mel)
        if text is None:
            ids = model.generate(mel)[0]
        else:
            ids = model.tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids
    config = model.config
    tokens = list(config.prompt) + [i for i in ids if i < config.eot_id]
    limit = config.n_text_ctx
    if len(tokens) > limit:
        raise ValueError(f"--text is {len(tokens)} tokens with the prompt; Whisper takes {limit}")
    tokenizer = model.tokenizer
    labels = [
        _visible(tokenizer.decode([i]) if i < config.eot_id else tokenizer.id_to_token(i))
        for i in tokens
    ]
    frames = min(config.n_audio_ctx, math.ceil(waveform.numel() / SAMPLE_RATE / FRAME_SECONDS))
    keys = [f"{j * FRAME_SECONDS:.2f}s" for j in range(config.n_audio_ctx)]
    layers = [
        (f"decoder {i} cross", layer.cross_attn) for i, layer in enumerate(model.decoder.layers)
    ]
    ids_tensor = torch.tensor([tokens], device=_device(model))
    seconds = waveform.numel() / SAMPLE_RATE
    return Source(
        f"Whisper: {Path(audio).name}",
        layers,
        lambda: model.logits(ids_tensor, memory),
        labels,
        keys=keys,
        key_limit=frames,
        note=f"{len(tokens)} text tokens against {frames} audio frames ({seconds:.2f} s)",
    )
