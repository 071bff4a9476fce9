"""A completion prompt longer than the context is refused (400 naming the context
length) without tokenising all of it: a 4 MB prompt took seconds to tokenise, holding
the GIL and stalling every other request. A text longer than the context times the
longest token is refused unread; a shorter one is encoded by growing prefixes, each cut
where the tokenizer splits anyway, until one alone is too long. A spy tokenizer counts
the characters encoded; /health answers while a long prompt is handled."""

from __future__ import annotations

import threading

import pytest
from live_server import request, tiny_gpt

from mhsa.apps.serve.models import ByteStream, ServedModel, make_engine


class Spy:
    """An encoder of byte tokens that records the length of each text it encodes; the
    first call waits (up to 30 s) for hold to be set, when hold is given."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.sizes: list[int] = []
        self.hold, self.entered = hold, threading.Event()

    def __call__(self, text: str) -> list[int]:
        self.sizes.append(len(text))
        self.entered.set()
        if self.hold is not None and len(self.sizes) == 1:
            self.hold.wait(timeout=30)
        return list(text.encode())


def _served(encode) -> ServedModel:
    """tiny_gpt over byte tokens, context 64 (8 blocks of 16, half for one request)."""
    engine = make_engine(tiny_gpt(), num_blocks=8, block_size=16, max_share=0.5)
    return ServedModel("tiny", engine, encode, ByteStream, 256)


def _refused(server, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    status, answer, _ = request(server.port, "POST", "/v1/completions", body, timeout=30)
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert "64 tokens" in answer["error"]["message"], answer
    return answer


def test_a_prompt_far_over_the_context_is_refused_unread(start_server):
    spy = Spy()
    server = start_server(served=_served(spy))
    assert server.served.context_length == 64
    _refused(server, "a " * 1_000_000)  # 2 MB, under the 4 MiB body limit
    assert sum(spy.sizes) == 0, spy.sizes  # (today: one call with all 2,000,000)


def test_a_long_prompt_is_refused_after_encoding_a_prefix_and_health_answers_meanwhile(
    start_server,
):
    hold = threading.Event()
    spy = Spy(hold)
    server = start_server(served=_served(spy))
    prompt = "ab " * 600  # 1800 characters: under 64 tokens x 32, over 64 tokens
    answers = []
    sender = threading.Thread(target=lambda: answers.append(_refused(server, prompt)))
    sender.start()
    try:
        assert spy.entered.wait(timeout=30), "the prompt was never encoded"
        assert request(server.port, "GET", "/health", timeout=10)[0] == 200  # meanwhile
    finally:
        hold.set()
        sender.join(timeout=60)
    assert answers, "the request was not answered"
    assert sum(spy.sizes) < len(prompt) / 2, spy.sizes  # (today: [1800])


def test_a_prompt_that_fits_is_encoded_whole_and_served(start_server):
    spy = Spy()
    server = start_server(served=_served(spy))
    body = {"model": "tiny", "prompt": "ab " * 20, "max_tokens": 2}
    status, answer, _ = request(server.port, "POST", "/v1/completions", body, timeout=30)
    assert status == 200 and answer["usage"]["prompt_tokens"] == 60
    assert spy.sizes == [60]


def _words(text: str) -> list[int]:
    """A tokenizer of whole words: one token a word, whatever its length."""
    return [len(word) for word in text.split(" ")]


class Recording:
    def __init__(self, encode) -> None:
        self.encode, self.texts = encode, []

    def __call__(self, text: str) -> list[int]:
        self.texts.append(text)
        return self.encode(text)


def test_a_long_text_that_fits_is_encoded_whole_after_its_prefixes():
    from mhsa.apps.serve.text import PromptEncoder

    encode = Recording(_words)
    prompt = " ".join(["nineteen-characters"] * 60)  # 1199 characters, 60 tokens
    encoder = PromptEncoder(encode, ByteStream, 256)
    assert encoder(prompt, 64) == _words(prompt)
    *prefixes, whole = encode.texts
    assert whole == prompt and prefixes
    for prefix in prefixes:  # each cut before a space that begins a word
        cut = len(prefix)
        assert prompt.startswith(prefix) and prompt[cut] == " " and prompt[cut - 1] != " "


def test_a_long_text_over_the_context_is_refused_from_a_prefix():
    from mhsa.apps.serve.text import PromptEncoder, PromptTooLong

    encode = Recording(_words)
    prompt = " ".join(["word"] * 5000)  # 5000 tokens in 24,999 characters
    # a token may stand for 1000 characters: the text may fit as far as characters tell
    encoder = PromptEncoder(encode, lambda: _Piece(1000), 1)
    with pytest.raises(PromptTooLong) as caught:
        encoder(prompt, 64)
    assert caught.value.at_least >= 64
    assert max(len(t) for t in encode.texts) < 2000  # of 24,999


def test_the_char_bound_refuses_without_encoding():
    from mhsa.apps.serve.text import PromptEncoder, PromptTooLong

    encode = Recording(_words)
    encoder = PromptEncoder(encode, ByteStream, 256)
    with pytest.raises(PromptTooLong) as caught:
        encoder("x" * 10_000, 64)
    assert encode.texts == [] and caught.value.at_least >= 64


class _Piece:
    """A stream whose every token reads as `length` characters."""

    def __init__(self, length: int) -> None:
        self.length = length

    def push(self, token: int) -> str:
        return "x" * self.length

    def flush(self) -> str:
        return ""


def test_longest_token_bounds_the_characters_of_any_token():
    from mhsa.apps.serve.text import MARGIN, longest_token

    assert longest_token(lambda: _Piece(100), 3) >= 100
    assert longest_token(ByteStream, 256) >= 3  # (a lone byte >= 0x80 reads as U+FFFD)
    assert MARGIN > 0


def _chat_served(encode) -> ServedModel:
    """_served's model with a chat template (the messages' contents, joined) that it
    renders and encodes apart, as ServedModel.from_chat does."""
    served = _served(encode)

    def render(messages: list[dict]) -> str:
        return "".join(message["content"] for message in messages)

    served.chat = lambda messages: encode(render(messages))  # (the one-call form)
    served.render_chat, served.chat_encode = render, encode
    return served


def test_a_chat_rendering_over_the_context_is_refused_before_it_is_encoded(start_server):
    spy = Spy()
    server = start_server(served=_chat_served(spy))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a " * 450_000}]}
    status, answer, _ = request(server.port, "POST", "/v1/chat/completions", body, timeout=30)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert answer["error"]["param"] == "messages"
    assert sum(spy.sizes) == 0, spy.sizes  # (before: the whole 900,000 characters)
    body["messages"][0]["content"] = "ab " * 5
    status, answer, _ = request(server.port, "POST", "/v1/chat/completions", body, timeout=30)
    assert status == 200 and answer["usage"]["prompt_tokens"] == 15, answer
