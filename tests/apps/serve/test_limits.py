"""The limits of `mhsa serve` against a live server on 127.0.0.1: the number of prompts
in one request, the body size (413 before the body is read whole, /health answering
throughout), the queue (429 with Retry-After) and the tokens of one request (a share of
the pool)."""

from __future__ import annotations

import socket
import threading

import pytest
from live_server import openai_client, request, tiny_gpt

from mhsa.apps.serve.limits import Limits


def test_a_request_with_too_many_prompts_gets_a_400_naming_the_limit(start_server):
    openai = pytest.importorskip("openai")
    server = start_server()
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=["hi"] * 1500, max_tokens=1)
    error = caught.value.body
    assert error["code"] == "too_many_prompts" and error["param"] == "prompt"
    assert "1500" in error["message"] and "--max-prompts" in error["message"]
    assert server.served.engine.idle  # nothing was queued
    answer = client.completions.create(model="tiny", prompt=["hi"] * 64, max_tokens=1)
    assert len(answer.choices) == 64


def _health_within_one_second(port: int, stop: threading.Event, failures: list) -> None:
    while not stop.is_set():
        try:
            status, _, _ = request(port, "GET", "/health", timeout=1)
            assert status == 200
        except Exception as error:  # noqa: BLE001 - reported by the test
            failures.append(error)
            return


def _send_big_body(port: int, size: int, declare: bool) -> int:
    """POST size bytes of JSON (with a Content-Length, or chunked) while reading the
    answer; the status the server answers."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    length = f"Content-Length: {size}\r\n" if declare else "Transfer-Encoding: chunked\r\n"
    sock.sendall(
        (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\n{length}\r\n"
        ).encode()
    )
    piece = b'{"prompt": "' + b"a" * (2**20 - 12)

    def send() -> None:
        try:
            for _ in range(size // len(piece)):
                data = piece if declare else b"%x\r\n%s\r\n" % (len(piece), piece)
                sock.sendall(data)
        except OSError:
            pass  # the server answered and closed: what the test wants

    sender = threading.Thread(target=send)
    sender.start()
    reply = b""
    while b"\r\n" not in reply:
        data = sock.recv(4096)
        if not data:
            break
        reply += data
    sock.close()
    sender.join(timeout=30)
    return int(reply.split(b" ")[1])


@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "chunked"])
def test_a_20_mb_body_gets_413_and_health_answers_throughout(start_server, declare):
    server = start_server()
    stop, failures = threading.Event(), []
    poller = threading.Thread(target=_health_within_one_second, args=(server.port, stop, failures))
    poller.start()
    try:
        assert _send_big_body(server.port, 20 * 2**20, declare) == 413
    finally:
        stop.set()
        poller.join()
    assert not failures, failures
    status, answer, _ = request(
        server.port, "POST", "/v1/completions", b"x" * 100, {"Content-Type": "application/json"}
    )
    assert status == 400 and answer["error"]["code"] == "invalid_json"  # (and still up)


def test_413_names_the_limit(start_server):
    server = start_server(limits=Limits(max_body_bytes=1000))
    body = {"model": "tiny", "prompt": "a" * 2000, "max_tokens": 1}
    status, answer, _ = request(server.port, "POST", "/v1/completions", body)
    assert status == 413 and "--max-body-bytes" in answer["error"]["message"]
    assert "1000 bytes" in answer["error"]["message"]


def test_a_full_queue_gets_429_with_retry_after(start_server):
    openai = pytest.importorskip("openai")
    server = start_server(limits=Limits(max_queued=2, retry_after=7))
    client = openai_client(server)
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=1)
    assert caught.value.response.headers["retry-after"] == "7"
    assert "--max-queued" in caught.value.body["message"]
    assert len(client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=1).choices)


def test_a_request_larger_than_its_share_of_the_pool_gets_a_400(start_server):
    openai = pytest.importorskip("openai")
    # 8 blocks of 16, half of them for one request: 64 tokens of prompt + completion
    server = start_server(num_blocks=8, max_share=0.5)
    assert server.served.context_length == 64
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="a" * 40, max_tokens=30)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "64 tokens" in caught.value.body["message"]
    answer = client.completions.create(model="tiny", prompt="a" * 40, max_tokens=24)
    assert answer.usage.total_tokens == 64


def test_max_share_is_checked():
    from mhsa.apps.serve.models import make_engine

    with pytest.raises(ValueError, match="max_share"):
        make_engine(tiny_gpt(), num_blocks=8, max_share=1.5)
    with pytest.raises(ValueError, match="max_share 0.5"):
        make_engine(tiny_gpt(), num_blocks=8, block_size=16, max_share=0.5, context_length=100)


def test_a_body_sent_too_slowly_gets_408(start_server):
    server = start_server(limits=Limits(body_seconds=0.5))
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '
    )  # ... and the rest never comes
    reply = b""
    while chunk := sock.recv(4096):  # (the head and the body may come apart)
        reply += chunk
    sock.close()
    assert reply.split(b" ")[1] == b"408" and b"--body-seconds" in reply
    assert request(server.port, "GET", "/health")[0] == 200
