"""Graceful shutdown of `mhsa serve` (a subprocess serving a tiny `mhsa train gpt`
checkpoint): on SIGTERM or SIGINT it takes no new request (503), running streams finish
within --drain-timeout, the rest end with an error event and `data: [DONE]`; it exits
0 with no traceback, and a second signal cuts the drain short."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mhsa.models.gpt import GPT, GPTConfig
from optional import needs

pytestmark = pytest.mark.slow  # several processes

SRC = Path(__file__).resolve().parents[3] / "src"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A GPT checkpoint as `mhsa train gpt` writes it (config.json + model.safetensors)."""
    from mhsa.checkpoint import save_checkpoint

    torch.manual_seed(0)
    # big enough that 500 tokens take seconds, so a stream is cut mid-answer
    config = GPTConfig(vocab_size=256, max_len=512, d_model=256, n_head=4, n_layer=6)
    folder = tmp_path_factory.mktemp("gpt")
    info = {"model": "gpt", "config": config.to_dict()}
    save_checkpoint(folder, 0, GPT(config), info, {})
    return folder


def _start(checkpoint: Path, *options: str) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "mhsa.cli", "serve", "--model", str(checkpoint)]
    command += ["--port", "0", "--threads", "1", "--num-blocks", "256", *options]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    line = server.stdout.readline()
    found = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
    if not found:
        server.kill()
        pytest.fail(line + server.stderr.read())
    return server, int(found[1])


def _stream(port: int, max_tokens: int, events: list, started: threading.Event) -> None:
    """Read one streamed completion into events: ("text", n), ("error", body), ("done",)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"prompt": "hello", "max_tokens": max_tokens, "stream": True}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    events.append(("status", response.status))
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :].strip()
        if data == b"[DONE]":
            events.append(("done",))
            break
        chunk = json.loads(data)
        events.append(("error", chunk["error"]) if "error" in chunk else ("text",))
        started.set()
    connection.close()


def _post_status(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    status = connection.getresponse().status
    connection.close()
    return status


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_then_ends_every_stream_with_done(checkpoint, signum):
    needs("starlette"), needs("uvicorn")
    server, port = _start(checkpoint, "--drain-timeout", "0.5")
    # 2 short streams finish within the drain; 2 long ones (500 tokens) do not
    lengths = [3, 3, 500, 500]
    events = [[] for _ in lengths]
    started = [threading.Event() for _ in lengths]
    clients = [
        threading.Thread(target=_stream, args=(port, n, e, s))
        for n, e, s in zip(lengths, events, started, strict=True)
    ]
    try:
        for client in clients:
            client.start()
        for event in started:
            assert event.wait(60), "a stream did not start"
        server.send_signal(signum)
        time.sleep(0.3)  # (the signal is handled)
        refused = _post_status(port)
        for client in clients:
            client.join(timeout=60)
        code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    stderr = server.stderr.read()
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert refused == 503
    for n, stream in zip(lengths, events, strict=True):
        assert stream[0] == ("status", 200) and stream[-1] == ("done",), stream[-3:]
        errors = [e for e in stream if e[0] == "error"]
        if n == 3:
            assert not errors  # it finished within the drain
        else:
            assert len(errors) == 1 and "shutting down" in errors[0][1]["message"]


def test_a_second_signal_cuts_the_drain_short(checkpoint):
    needs("starlette"), needs("uvicorn")
    server, port = _start(checkpoint, "--drain-timeout", "300")
    events, started = [], threading.Event()
    client = threading.Thread(target=_stream, args=(port, 480, events, started))
    try:
        client.start()
        assert started.wait(60)
        server.send_signal(signal.SIGINT)
        time.sleep(0.3)
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)  # (not the 300 s drain)
        client.join(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    stderr = server.stderr.read()
    assert code == 0 and "Traceback" not in stderr, stderr
    assert events[-1] == ("done",) and events[-2][0] == "error"
