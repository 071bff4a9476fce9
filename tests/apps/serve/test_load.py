"""`mhsa serve` under load: 16 clients stream 128 completions of mixed lengths at once
from a real server; each equals its prompt's greedy output computed alone, and the
cache pool is empty afterwards. The model is a tiny float64 GPT over ASCII bytes (128
tokens), so a batch's rounding cannot flip a greedy choice and text maps to tokens
one to one."""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading

import pytest
import torch

from mhsa.apps.serve.models import ServedModel
from mhsa.models.gpt import GPT, GPTConfig
from optional import needs

pytestmark = pytest.mark.slow  # real models, servers, browsers or several processes

CLIENTS, REQUESTS = 16, 128


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: a second thread only waits
    yield
    torch.set_num_threads(threads)


def _model() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, max_len=256, d_model=32, n_head=4, n_layer=2)
    return GPT(config).double().eval()


def _jobs(seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): prompts of 5..200 tokens, a quarter of them sharing a
    64-token start (the prefix cache), and 1..40 new tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(64)]
    jobs = []
    for i in range(REQUESTS):
        prompt = [rng.randrange(128) for _ in range(rng.randint(5, 200))]
        if i % 4 == 0:
            prompt = (shared + prompt)[: max(len(prompt), 65)]
        jobs.append((prompt, rng.randint(1, 40)))
    return jobs


def _stream(port: int, prompt: list[int], max_tokens: int) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of one streamed completion."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200, response.read()
    text, finish, usage, done = [], None, None, False
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            done = True
            break
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
        usage = chunk.get("usage") or usage
    connection.close()
    assert done, "the stream ended without data: [DONE]"
    return "".join(text), finish, usage


def test_sixteen_streaming_clients_get_each_greedy_output_and_the_pool_empties(one_thread):
    needs("starlette"), needs("uvicorn")
    from mhsa.apps.serve.server import Server

    model = _model()
    jobs = _jobs()
    # 128 blocks hold ~8 of the longest requests: the rest wait for room
    served = ServedModel.from_gpt(
        model, "tiny", num_blocks=128, block_size=16, max_batch=16, prefill_chunk=64
    )
    results: dict[int, tuple[str, str, dict]] = {}
    failures: list[BaseException] = []
    todo: queue.Queue[int] = queue.Queue()
    for i in range(REQUESTS):
        todo.put(i)

    def client(port: int) -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = _stream(port, *jobs[i])
            except BaseException as error:  # noqa: BLE001 - reported below
                failures.append(error)

    with Server(served, port=0) as server:
        threads = [threading.Thread(target=client, args=(server.port,)) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not any(thread.is_alive() for thread in threads), "a client hung"
        assert not failures, failures[:3]
        assert served.engine.cache.used_blocks == 0 and served.engine.idle
    assert sorted(results) == list(range(REQUESTS))
    cached = 0
    for i, (prompt, max_tokens) in enumerate(jobs):
        text, finish, usage = results[i]
        out = model.generate(torch.tensor([prompt]), max_tokens, temperature=0)
        alone = "".join(chr(t) for t in out[0, len(prompt) :].tolist())  # (ASCII: one to one)
        assert text == alone, f"request {i}: {text!r} != {alone!r}"
        assert finish == "length"
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), max_tokens)
        cached += usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0  # prompts that share a start shared its cached blocks
