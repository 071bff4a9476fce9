"""Helpers of the live-server tests: a tiny float32 GPT of byte tokens (a server over it
starts in well under a second) and small HTTP helpers (conftest.py has the fixture)."""

from __future__ import annotations

import http.client
import json

import torch

from mhsa.models.gpt import GPT, GPTConfig
from optional import needs


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, max_len=512, d_model=32, n_head=4, n_layer=2)
    return GPT(config).eval()


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> tuple[int, dict, dict]:
    """(status, JSON answer, headers) of one request; a dict body is sent as JSON."""
    headers = dict(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request(method, path, body, headers)
    response = connection.getresponse()
    status, data = response.status, response.read()
    connection.close()
    try:
        answer = json.loads(data)
    except ValueError:
        answer = {"text": data.decode(errors="replace")}
    return status, answer, dict(response.getheaders())


def openai_client(server, api_key: str = "unused"):
    openai = needs("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def chat_served(template: str):
    """A ServedModel of tiny_gpt whose chat renders template (bytes in, bytes out)."""
    from mhsa.apps.serve.models import ByteStream, ServedModel, make_engine
    from mhsa.formats.chat_template import render_chat

    engine = make_engine(tiny_gpt(), num_blocks=32, block_size=16)

    def chat(messages: list[dict]) -> list[int]:
        return list(render_chat(template, messages).encode())

    return ServedModel("tiny", engine, lambda t: list(t.encode()), ByteStream, 256, chat=chat)
