"""The `mhsa serve` command: it serves a `mhsa train gpt` checkpoint (bytes, no chat
template) on the port it prints, answers completions with stop strings, refuses chat
for such a model with a pointer to /v1/completions, and stops on Ctrl-C."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mhsa.cli import main
from optional import needs

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    status, answer = response.status, json.loads(response.read())
    connection.close()
    return status, answer


@pytest.mark.slow
def test_mhsa_serve_a_gpt_checkpoint(tmp_path, capsys):
    needs("starlette"), needs("uvicorn")
    data = tmp_path / "data.txt"
    data.write_text("for i in range(10):\n    print(i)\n" * 100)
    out = tmp_path / "run"
    train = [
        "train",
        "gpt",
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--seq-len",
        "32",
    ]
    assert main(train) == 0
    capsys.readouterr()
    command = [
        sys.executable,
        "-m",
        "mhsa.cli",
        "serve",
        "--model",
        str(out),
        "--port",
        "0",
        "--num-blocks",
        "8",
        "--threads",
        "1",
    ]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    try:
        line = server.stdout.readline()
        found = re.search(r"serving (\S+) at http://127\.0\.0\.1:(\d+)/v1", line)
        assert found, line + server.stderr.read()
        name, port = found[1], int(found[2])
        assert name == "run" and "context 32 tokens" in line  # the model's max_len
        body = {"model": "run", "prompt": "for i", "max_tokens": 20, "temperature": 0}
        status, whole = _post(port, "/v1/completions", body)
        assert status == 200 and whole["usage"]["completion_tokens"] == 20
        text = whole["choices"][0]["text"]
        stop = text[5:7]  # the text stops before the first place this occurs
        status, cut = _post(port, "/v1/completions", {**body, "stop": [stop]})
        assert status == 200 and cut["choices"][0]["text"] == text[: text.index(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"
        status, refused = _post(
            port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 400 and "/v1/completions" in refused["error"]["message"]
        status, long = _post(port, "/v1/completions", {"prompt": "x" * 40})
        assert status == 400 and refused["error"]["code"] != long["error"]["code"]
        assert long["error"]["code"] == "context_length_exceeded"
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=60)
    assert code == 0, server.stderr.read()


def test_mhsa_serve_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--num-blocks", "1"]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err


def test_a_port_out_of_range_or_in_use_is_a_one_line_error(tmp_path, capsys):
    needs("starlette"), needs("uvicorn")
    import socket

    import torch

    from mhsa.checkpoint import save_checkpoint
    from mhsa.models.gpt import GPT, GPTConfig

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "70000"])
    assert exited.value.code == 2 and "in 0..65535, got 70000" in capsys.readouterr().err
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, max_len=32, d_model=32, n_head=2, n_layer=1)
    save_checkpoint(tmp_path, 0, GPT(config), {"model": "gpt", "config": config.to_dict()}, {})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        command = ["serve", "--model", str(tmp_path), "--port", port, "--num-blocks", "8"]
        assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mhsa serve: the server could not start on 127.0.0.1:" + port)
    assert not any("Traceback" in line for line in err)


@pytest.mark.slow
def test_mhsa_imports_without_the_serve_extra_and_serve_says_how_to_get_it():
    code = (
        "import sys; sys.modules['starlette'] = sys.modules['uvicorn'] = None\n"
        "import mhsa, mhsa.apps.serve, mhsa.apps.serve.models\n"
        "from mhsa.cli import main\n"
        "print(main(['serve', '--port', '0']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        check=True,
    )
    assert result.stdout.strip() == "2"
    assert "pip install 'mhsa[serve]'" in result.stderr


def test_ctrl_c_in_wait_returns_only_once_the_server_and_engine_have_stopped():
    """Ctrl-C while Server.wait blocks (what `mhsa serve` does): wait returns only after
    uvicorn's shutdown and the engine's thread have ended (on Python 3.11 an interrupted
    Thread.join marks the thread stopped while it still runs; an exit then could abort)."""
    needs("starlette"), needs("uvicorn")
    import _thread
    import threading

    from mhsa.apps.serve.models import ServedModel
    from mhsa.apps.serve.server import Server
    from mhsa.models.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab_size=256, max_len=32, d_model=16, n_head=2, n_layer=1)).eval()
    server = Server(ServedModel.from_gpt(gpt, "tiny", num_blocks=4), port=0).start()
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 3, "temperature": 0}
    assert _post(server.port, "/v1/completions", body)[0] == 200
    threading.Timer(1.0, _thread.interrupt_main).start()  # (wait is entered long before)
    server.wait()
    alive = [t.name for t in threading.enumerate() if t.name in ("mhsa-serve", "mhsa-engine")]
    assert alive == []
