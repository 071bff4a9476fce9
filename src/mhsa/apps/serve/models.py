"""The model a server serves: its engine, its tokenizer and how it renders a chat.

    served = ServedModel.from_chat(load_chat_model(), num_blocks=512)     a chat model
    served = ServedModel.from_gpt(gpt, "my-gpt", num_blocks=64)            a `mhsa train gpt`
                                                                           model (bytes)
Only a model with a chat template answers /v1/chat/completions; every model answers
/v1/completions."""

from __future__ import annotations

import codecs
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from ..chat import encode_prompt, prompt_text
from .engine import Engine


class TextStream(Protocol):
    """Text of tokens pushed one at a time (a multi-byte character waits for its end)."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


@dataclass
class ServedModel:
    """name (what clients pass as `model`), the engine, encode(text) -> ids, stream() ->
    a TextStream, chat(messages) -> prompt ids (None: the model has no chat template),
    and the vocabulary size (token ids in a prompt must be below it). Where chat is
    render_chat (messages -> text) then chat_encode (text -> ids), a server gives them
    separately, so that a long rendering is refused before it is tokenised whole."""

    name: str
    engine: Engine
    encode: Callable[[str], list[int]]
    stream: Callable[[], TextStream]
    vocab_size: int
    chat: Callable[[list[dict[str, Any]]], list[int]] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    render_chat: Callable[[list[dict[str, Any]]], str] | None = None
    chat_encode: Callable[[str], list[int]] | None = None

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @classmethod
    def from_chat(
        cls,
        chat_model: Any,
        *,
        name: str | None = None,
        **engine_options: Any,
    ) -> ServedModel:
        """Serve an mhsa.apps.chat.ChatModel (its Llama, tokenizer, template and stop tokens);
        engine_options go to make_engine."""
        tokenizer = chat_model.tokenizer
        engine = make_engine(chat_model.model, stop_ids=chat_model.stop_ids, **engine_options)

        def encode(text: str) -> list[int]:
            ids = tokenizer.encode(text, add_special_tokens=False)
            bos = getattr(tokenizer, "bos_token_id", None)
            if getattr(tokenizer, "add_bos_token", False) and bos is not None:
                ids = [bos, *ids]
            return ids

        return cls(
            name or chat_model.name.removesuffix(".gguf"),
            engine,
            encode,
            tokenizer.stream,
            chat_model.model.config.vocab_size,
            chat=chat_model.prompt_ids,
            render_chat=functools.partial(prompt_text, tokenizer),
            chat_encode=functools.partial(encode_prompt, tokenizer),
        )

    @classmethod
    def from_gpt(cls, model: nn.Module, name: str, **engine_options: Any) -> ServedModel:
        """Serve a GPT trained on UTF-8 bytes (`mhsa train gpt`): no chat template, no stop
        token; engine_options go to make_engine."""
        engine = make_engine(model, **engine_options)
        return cls(
            name,
            engine,
            lambda text: list(text.encode("utf-8")),
            ByteStream,
            model.config.vocab_size,
        )


def make_engine(
    model: nn.Module,
    *,
    num_blocks: int = 512,
    block_size: int = 16,
    context_length: int | None = None,
    max_batch: int = 16,
    prefill_chunk: int = 128,
    stop_ids: Any = (),
    admission: str = "reserve",
    max_share: float = 1.0,
    max_wait: float = 10.0,
    speculator: Any = None,
    draft_tokens: int = 4,
) -> Engine:
    """An Engine for model whose context (prompt + completion tokens of one request;
    default: the model's max_len, at most max_share of what the pool holds) always fits
    that share, so no request is refused for the pool's size; admission, max_share and
    max_wait: see mhsa.apps.serve.scheduler; speculator and draft_tokens: speculative
    decoding (mhsa.models.speculative)."""
    if isinstance(max_share, bool) or not isinstance(max_share, int | float):
        raise TypeError(f"max_share must be a number in (0, 1], got {max_share!r}")
    if not 0 < max_share <= 1:
        raise ValueError(f"max_share must be in (0, 1] (a share of the pool), got {max_share}")
    pool = max(1, int(max_share * num_blocks)) * block_size
    if context_length is None:
        context_length = min(model.config.max_len, pool)
    elif context_length > pool:
        share = "" if max_share == 1 else f" (max_share {max_share} of it)"
        raise ValueError(
            f"context_length {context_length} is more than the pool holds for one request"
            f"{share}: {pool} tokens of {num_blocks} blocks of {block_size}; raise "
            "num_blocks or max_share, or lower context_length"
        )
    return Engine(
        model,
        context_length=context_length,
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch=max_batch,
        prefill_chunk=prefill_chunk,
        stop_ids=stop_ids,
        admission=admission,
        max_share=max_share,
        max_wait=max_wait,
        speculator=speculator,
        draft_tokens=draft_tokens,
    )


class ByteStream:
    """UTF-8 text of byte tokens, one token at a time (ByteTokenizer's stream)."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(bytes([token]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
