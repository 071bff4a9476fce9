"""Requests that once got a 500 or an overflow message get a 400 naming the parameter, on a
live server: JSON nested 100k deep, a lone surrogate in a prompt or a message, and a seed
of 2**64 or more; a seed of 2**64 - 1 with two prompts is served (it once failed, and
left a request behind that failed other clients' steps); max_completion_tokens null
leaves max_tokens in force."""

from __future__ import annotations

import pytest
from live_server import chat_served, openai_client, request


def test_json_nested_100k_deep_is_a_400(start_server):
    server = start_server()
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        status, answer, _ = request(
            server.port, "POST", "/v1/completions", body, {"Content-Type": "application/json"}
        )
        assert status == 400 and answer["error"]["code"] == "invalid_json"
        assert "nests" in answer["error"]["message"]


def test_a_lone_surrogate_is_a_400_naming_the_parameter(start_server):
    server = start_server()
    body = b'{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 2}'
    status, answer, _ = request(
        server.port, "POST", "/v1/completions", body, {"Content-Type": "application/json"}
    )
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert "surrogate" in answer["error"]["message"]
    paired = b'{"model": "tiny", "prompt": "ab\\ud83d\\ude00cd", "max_tokens": 2}'  # (an emoji)
    assert (
        request(
            server.port, "POST", "/v1/completions", paired, {"Content-Type": "application/json"}
        )[0]
        == 200
    )


def test_a_lone_surrogate_in_a_message_is_a_400(start_server):
    server = start_server(served=chat_served("{{ messages[0].content }}"))
    body = b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}'
    status, answer, _ = request(
        server.port, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    assert status == 400 and answer["error"]["param"] == "messages[0].content"


@pytest.mark.parametrize("seed", [2**64, 2**200])
def test_a_seed_of_2_64_or_more_is_a_400(start_server, seed):
    openai = pytest.importorskip("openai")
    server = start_server()
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, seed=seed)
    assert caught.value.body["param"] == "seed"
    assert str(2**64 - 1) in caught.value.body["message"]
    answer = client.completions.create(
        model="tiny", prompt="hi", max_tokens=2, seed=2**64 - 1, temperature=1
    )
    assert answer.usage.completion_tokens == 2


def test_the_largest_seed_serves_two_prompts_and_the_next_requests(start_server):
    pytest.importorskip("openai")
    server = start_server()
    client = openai_client(server)
    answer = client.completions.create(
        model="tiny", prompt=["a", "b"], max_tokens=2, seed=2**64 - 1, temperature=1
    )
    assert [choice.finish_reason for choice in answer.choices] == ["length", "length"]
    for _ in range(3):
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage
    assert server.served.engine.cache.used_blocks == 0


def test_max_completion_tokens_null_leaves_max_tokens(start_server):
    server = start_server(served=chat_served("{{ messages[0].content }}"))
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, '
    body += b'"max_completion_tokens": null}'
    status, answer, _ = request(
        server.port, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    assert status == 200 and answer["usage"]["completion_tokens"] <= 3, answer
