"""`mhsa bench serve`'s head-of-line case: its table from a result (the server and its
timings are the benchmark's, not a test's: no timing asserts)."""

from __future__ import annotations

import pytest

from mhsa.benchmarks import serve


def test_the_head_of_line_table_says_what_it_compares_and_whether_each_goal_was_met():
    cases = [
        {"longs": 1, "running": 1, "waiting": 0, "ttft": 0.3, "tries": [0.3, 0.2, 0.5]},
        {"longs": 4, "running": 2, "waiting": 2, "ttft": 0.9, "tries": [0.9, 0.8, 1.0]},
    ]
    for case, factor in zip(cases, (2, 3), strict=True):
        goal = factor * 0.04 + 0.5
        case.update(factor=factor, goal=goal, ratio=case["ttft"] / 0.04, met=case["ttft"] <= goal)
    head = {"long": 768, "num_blocks": 122, "alone": 0.04, "long_alone": 3.0, "chunk": 0.5}
    lines = serve.head_of_line_report({**head, "cases": cases})
    text = "\n".join(lines)
    assert "a 4-token prompt (1 token new) behind 768-token prompts (2 new)" in text
    assert "122 blocks of 16 (two long requests), --max-wait 0" in text
    assert "alone: time to first token 40 ms" in text and "one chunk 500 ms" in text
    behind_one, behind_four = lines[-2:]
    assert "1 long (1 running, 0 waiting)" in behind_one and "7.5x" in behind_one
    assert "met: <= 2x alone + 1 chunk = 580 ms (300, 200, 500 ms)" in behind_one
    assert "4 long (2 running, 2 waiting)" in behind_four and "22.5x" in behind_four
    assert "MISSED: <= 3x alone + 1 chunk = 620 ms" in behind_four


def test_clients_grow_the_requests_and_the_serial_run_sends_the_first_ones(monkeypatch):
    """--clients 40: the server's --max-batch 40 and 80 requests (2 per client);
    --serial-requests 5: the one-at-a-time run sends the first 5 of them; with
    --throughput-only no speculative server starts and no head-of-line case runs. The
    server is replaced by stand-ins that record what they were asked."""
    started, loads = [], []

    class Server:
        def terminate(self):
            pass

        def wait(self, timeout):
            pass

    def start(model, port, options):
        started.append(options)
        return Server()

    def load(port, name, requests, clients):
        loads.append((len(requests), clients, requests[0]))
        return {"tokens_per_second": 10.0 * clients, "tokens": 100}

    def get(port, path):
        if path == "/v1/models":
            return {"data": [{"id": "m"}]}
        return {"cache": {}}

    monkeypatch.setattr(serve, "_start_server", start)
    monkeypatch.setattr(serve, "_wait_ready", lambda port, server: {"cache": {}})
    monkeypatch.setattr(serve, "_get", get)
    monkeypatch.setattr(serve, "_load", load)
    monkeypatch.setattr(serve, "head_of_line", lambda *a, **k: pytest.fail("head of line ran"))
    result = serve.run(clients=40, serial_requests=5, throughput_only=True)
    # one server, no --speculate, a pool with room for 40 of the longest requests (its
    # prompt's bytes and 192 new, in blocks of 16)
    prompts = serve._prompts(80, serve.LOADS["chat"]["prompt"])
    longest = max(len(prompt.encode()) for prompt in prompts) + 192
    assert started == [["--max-batch", "40", "--num-blocks", str(40 * -(-longest // 16))]]
    (warm, _, _), (concurrent, clients, first), (serial, one, serial_first) = loads
    assert (warm, concurrent, clients, serial, one) == (2, 80, 40, 5, 1)
    assert serial_first == first  # the same requests, the first of them
    assert result["speedup"] == 40.0 and result["load"]["serial_requests"] == 5
    assert "speculative" not in result and "head_of_line" not in result
    with pytest.raises(ValueError, match="clients"):
        serve.run(clients=0)


def test_a_failed_request_stops_the_benchmark_with_the_servers_answer(monkeypatch):
    """A client thread's error (here a 400 for a prompt past the model's context) is
    raised once every client is done, not dropped from the totals."""

    def stream(port, model, prompt, new):
        if prompt == "long":
            raise RuntimeError("the server answered 400: context_length_exceeded")
        return {"tokens": new, "ttft": 0.1, "gaps": [0.01] * (new - 1)}

    monkeypatch.setattr(serve, "_stream", stream)
    done = serve._load(0, "m", [("short", 4), ("short", 6)], 2)
    assert (done["requests"], done["tokens"]) == (2, 10)
    with pytest.raises(RuntimeError, match="a client's request failed: .*400"):
        serve._load(0, "m", [("short", 4), ("long", 6), ("short", 5)], 2)
