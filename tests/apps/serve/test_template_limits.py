"""Chat templates off the event loop and within limits, on a live server: a template that
multiplies a string by 10**10, pads with a method, doubles a string with ~ or loops 10**10
times gets a 400 naming the limit, and /health answers within 1 s while the loop runs (the
rendering is in a worker thread)."""

from __future__ import annotations

import threading

import pytest
from live_server import chat_served, openai_client, request

from mhsa.apps.serve.limits import Limits

PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
BOMBS = {
    "string": "{{ 'a' * 10**10 }}" + PLAIN,
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    + PLAIN,
    "output": "{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}{% endfor %}",
    # (sizes asked of a method or built by ~ concatenation: 50 MB, 16 MB here, GBs in a bomb)
    "method": "{{ ('a'.ljust(50000000)) | length }}" + PLAIN,
    "concatenation": "{% set ns = namespace(s='a') %}{% for i in range(24) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}" + PLAIN,
}


def test_a_plain_template_renders(start_server):
    server = start_server(served=chat_served(PLAIN))
    answer = openai_client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.usage.prompt_tokens == len("user: hi\nassistant:")


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_template_bomb_gets_400_and_health_answers_meanwhile(start_server, bomb):
    openai = pytest.importorskip("openai")
    limits = Limits(template_seconds=2.0, template_chars=100_000)
    server = start_server(served=chat_served(BOMBS[bomb]), limits=limits)
    client = openai_client(server)
    outcome = {}

    def send() -> None:
        try:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        except openai.BadRequestError as error:
            outcome["error"] = error.body
        finally:
            outcome["done"] = True

    sender = threading.Thread(target=send)
    sender.start()
    polls = 0
    while not outcome.get("done") or polls == 0:
        status, _, _ = request(server.port, "GET", "/health", timeout=1)
        assert status == 200
        polls += 1
    sender.join()
    error = outcome["error"]
    assert error["code"] == "template_limit_exceeded" and error["param"] == "messages"
    option = "--template-seconds" if bomb == "loops" else "--template-chars"
    assert option in error["message"]
    status, _, _ = request(server.port, "GET", "/health", timeout=1)
    assert status == 200
