"""The context boundary: a prompt plus max_tokens that exactly fills the context is
served in full; one token more is refused, on both endpoints' paths and with the
default max_tokens (the byte GPT has no stop token, so it writes every token asked)."""

from __future__ import annotations

import pytest
from live_server import request

CONTEXT = 48


def _complete(server, prompt: str, **options) -> tuple[int, dict]:
    body = {"prompt": prompt, "temperature": 0, **options}
    status, answer, _ = request(server.port, "POST", "/v1/completions", body)
    return status, answer


@pytest.mark.parametrize("prompt_len", [1, 17, CONTEXT - 1])
def test_prompt_plus_max_tokens_filling_the_context_is_served_in_full(start_server, prompt_len):
    server = start_server(context_length=CONTEXT)
    status, answer = _complete(server, "a" * prompt_len, max_tokens=CONTEXT - prompt_len)
    assert status == 200, answer
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        prompt_len,
        CONTEXT - prompt_len,
    )
    assert usage["total_tokens"] == CONTEXT


@pytest.mark.parametrize("prompt_len", [1, 17, CONTEXT - 1])
def test_one_token_past_the_context_is_refused(start_server, prompt_len):
    server = start_server(context_length=CONTEXT)
    status, answer = _complete(server, "a" * prompt_len, max_tokens=CONTEXT - prompt_len + 1)
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["param"] == "prompt"


def test_a_prompt_of_the_whole_context_is_refused_and_one_less_gets_one_token(
    start_server,
):
    server = start_server(context_length=CONTEXT)
    status, answer = _complete(server, "a" * CONTEXT)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    status, answer = _complete(server, "a" * (CONTEXT - 1))  # the default: what still fits
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 1
