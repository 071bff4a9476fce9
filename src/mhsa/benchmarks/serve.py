"""`mhsa bench serve`: one `mhsa serve` process (the packaged SmolLM2 unless --model),
the same requests run two ways through its OpenAI-compatible HTTP API:

- concurrent: `clients` streaming clients, each sending its share of the requests
  one after another (continuous batching serves them together);
- one at a time: a single client sends the same requests in turn.

Each request is a greedy `/v1/completions` stream of a prompt cut from the Python
standard library's source (mixed lengths) with a mixed max_tokens. Reported: total
output tokens/s of each load and their ratio, time to first token and inter-token
latency (p50, p95, seen by the clients), and the server's peak cache memory
(`/health`) against a contiguous cache sized for the longest request per running
sequence (what a batch of `max_batch` such requests would reserve). Then speculative
decoding: a second server with `--speculate prompt-lookup` (started alongside) and the
plain one answer the same greedy chat requests one at a time, alternately
(mhsa.benchmarks.speculation: rewriting a paragraph, and free-form chat).

Last, head of line (head_of_line, a server of its own, alone on the machine): a 4-token
request's time to first token behind long prompts being prefilled, against its time
alone and one prefill chunk's time (a long prompt's own time to first token over its
chunks): behind one long prompt (the goal: within 2x alone plus one chunk, the chunk
the server was computing when it came) and behind four (a pool with room for two long
requests, not three, and --max-wait 0: two run and two wait, with a reservation; the
goal: within 3x alone plus one chunk).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..core.checks import int_at_least
from . import speculation

# "chat": short questions, longer answers; "long-prompts": prompts about twice the
# answers, where prefilling (the same work in both loads) takes a larger share
LOADS = {
    "chat": {"requests": 64, "clients": 16, "prompt": (8, 96), "new": (64, 192)},
    "long-prompts": {"requests": 64, "clients": 16, "prompt": (16, 192), "new": (32, 128)},
    "quick": {"requests": 8, "clients": 4, "prompt": (8, 32), "new": (4, 16)},
}


JSON = {"Content-Type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(count: int, words: tuple[int, int], seed: int = 0) -> list[str]:
    """count prompts of words[0]..words[1] words cut from the standard library."""
    from ..data.text import stdlib_corpus

    corpus = stdlib_corpus(limit_bytes=400_000).split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(*words)
        start = rng.randrange(len(corpus) - length)
        prompts.append(" ".join(corpus[start : start + length]))
    return prompts


def _get(port: int, path: str) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def _stream(port: int, model: str, prompt: str | list[int], max_tokens: int) -> dict:
    """One streamed greedy completion of a text or token ids: its token count, time to
    first token and the gaps between tokens (seconds)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    arrivals, tokens = [], None
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), JSON)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the server answered {response.status}: {response.read()!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                arrivals.append(time.perf_counter())
    finally:
        connection.close()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"tokens": tokens, "ttft": arrivals[0] - start if arrivals else None, "gaps": gaps}


def _load(port: int, model: str, requests: list[tuple[str, int]], clients: int) -> dict:
    """Run requests from `clients` threads (each its share, in turn); totals and latencies."""
    results: list[dict] = []
    errors: list[Exception] = []
    lock = threading.Lock()

    def client_loop(share: list[tuple[str, int]]) -> None:
        try:
            for prompt, new in share:
                if errors:  # another client failed: the run stops
                    return
                result = _stream(port, model, prompt, new)
                with lock:
                    results.append(result)
        except Exception as error:  # raised in the caller's thread, after the others end
            with lock:
                errors.append(error)

    threads = [
        threading.Thread(target=client_loop, args=(requests[i::clients],)) for i in range(clients)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a client's request failed: {errors[0]}") from errors[0]
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "requests": len(results),
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "ttft": _percentiles(ttft),
        "itl": _percentiles(gaps),
    }


def _percentiles(values: list[float]) -> dict:
    if len(values) < 2:
        return {"p50": values[0] if values else None, "p95": values[0] if values else None}
    cuts = statistics.quantiles(values, n=20)
    return {"p50": statistics.median(values), "p95": cuts[18]}


def _start_server(model: str | None, port: int, options: list[str]) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "mhsa.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(["--model", model] if model else []),
        *options,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
    )


def _wait_ready(port: int, server: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mhsa serve exited: {server.stderr.read()[-2000:]}")
        try:
            return _get(port, "/health")
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"mhsa serve did not answer /health within {timeout:.0f} s")


def run(
    model: str | None = None,
    quick: bool = False,
    threads: int | None = None,
    quantize: str | None = None,
    load: str = "chat",
    draft_tokens: int = 4,
    device: str | None = None,
    dtype: str | None = None,
    clients: int | None = None,
    serial_requests: int | None = None,
    throughput_only: bool = False,
) -> dict:
    """Both runs of a load (one of LOADS) against one server; see the module docstring.
    device and dtype: the servers' --device and --dtype (default: mhsa serve's own).
    clients: concurrent clients (default the load's; the server's --max-batch, and at
    least 2 requests each); serial_requests: how many of the requests the one-at-a-time
    run sends (default all; tokens/s is a rate, so a GPU run can time fewer);
    throughput_only: leave out speculative decoding and head of line."""
    name = "quick" if quick else load
    if name not in LOADS:
        raise ValueError(f"load must be one of {', '.join(LOADS)}, got {load!r}")
    load = dict(LOADS[name], name=name)
    if clients is not None:
        int_at_least("clients", clients, 1)
        load.update(clients=clients, requests=max(load["requests"], 2 * clients))
    if serial_requests is not None:
        int_at_least("serial_requests", serial_requests, 1)
    rng = random.Random(1)
    prompts = _prompts(load["requests"], load["prompt"])
    requests = [(p, rng.randint(*load["new"])) for p in prompts]
    pool = []  # the server's default pool (512 blocks of 16) unless clients need more
    if clients is not None:
        # room for every client's longest request at once: a token holds at least a
        # byte (byte-level and byte-fallback tokenizers), so bytes bound the tokens
        longest = max(len(p.encode()) for p in prompts) + load["new"][1]
        pool = ["--num-blocks", str(max(512, clients * -(-longest // 16)))]
    port = _free_port()
    own = [*(["--threads", str(threads)] if threads else [])]
    own += ["--quantize", quantize] if quantize else []
    own += ["--device", device] if device else []
    own += ["--dtype", dtype] if dtype else []
    options = ["--max-batch", str(load["clients"]), *pool, *own]
    server = _start_server(model, port, options)
    fast, fast_port, extras = None, _free_port(), {}
    if not throughput_only:
        speculate = ["--speculate", "prompt-lookup", "--draft-tokens", str(draft_tokens)]
        fast = _start_server(model, fast_port, [*options, *speculate])
    try:
        health = _wait_ready(port, server)
        name = _get(port, "/v1/models")["data"][0]["id"]
        _load(port, name, requests[:2], 1)  # warm-up
        if fast is not None:
            _wait_ready(fast_port, fast)
            _load(fast_port, name, requests[:2], 1)
        concurrent = _load(port, name, requests, load["clients"])
        peak = _get(port, "/health")["cache"]
        serial = _load(port, name, requests[:serial_requests], 1)
        if not serial["tokens"]:
            raise RuntimeError(f"{name} ended every one-at-a-time answer before its first token")
        if not throughput_only:
            ports = {"plain": port, "speculative": fast_port}
            extras["speculative"] = speculation.compare(ports, name, quick=name_is_quick(load))
    finally:
        for process in (server, fast):
            if process is not None:
                process.terminate()
                process.wait(30)
    if not throughput_only:
        extras["head_of_line"] = head_of_line(model, own, quick=name_is_quick(load))
    load["serial_requests"] = len(requests[:serial_requests])
    return {
        "model": name,
        "quantize": quantize or "default",
        "load": load,
        "cache": health["cache"],
        "peak": peak,
        "concurrent": concurrent,
        "one_at_a_time": serial,
        "speedup": concurrent["tokens_per_second"] / serial["tokens_per_second"],
        **extras,
        "draft_tokens": draft_tokens,
        "cpu": _cpu_name(),
    }


# head of line: the long prompts' and the short one's tokens and new tokens (one: the
# server streams a token once it has text, so the first could hide in the second, but an
# answer's end always comes); the server's prefill chunk (mhsa serve's) and block size;
# the tries of each case (the median counts)
LONG, LONG_NEW, SHORT, SHORT_NEW, CHUNK, BLOCK, TRIES = 1536, 2, 4, 1, 128, 16, 7


def head_of_line(model: str | None, options: list[str], quick: bool = False) -> dict:
    """A short request's time to first token alone, behind one long prompt being
    prefilled and behind four (two running, two waiting for blocks); see the module
    docstring. Prompts are random token ids 100..999 (exact lengths, no prefix hits)."""
    long = LONG // 2 if quick else LONG
    long_blocks = math.ceil((long + LONG_NEW) / BLOCK)
    num_blocks = 2 * long_blocks + long_blocks // 2  # two long requests, not three
    port = _free_port()
    own = ["--num-blocks", str(num_blocks), "--block-size", str(BLOCK), "--max-wait", "0"]
    server = _start_server(model, port, [*options, *own])
    rng = random.Random(3)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(length)]

    try:
        _wait_ready(port, server)
        name = _get(port, "/v1/models")["data"][0]["id"]
        _stream(port, name, prompt(64), 2)  # warm-up
        alone = [_stream(port, name, prompt(SHORT), SHORT_NEW)["ttft"] for _ in range(TRIES)]
        long_alone = _stream(port, name, prompt(long), LONG_NEW)["ttft"]
        chunk = long_alone / math.ceil(long / CHUNK)
        cases = [
            _behind(port, name, [prompt(long) for _ in range(count)], prompt(SHORT), chunk)
            for count in (1, 4)
            for _ in range(TRIES)
        ]
    finally:
        server.terminate()
        server.wait(30)
    alone_ms = statistics.median(alone)
    result = {"long": long, "num_blocks": num_blocks, "alone": alone_ms}
    result.update(long_alone=long_alone, chunk=chunk, cases=[])
    for count, factor in ((1, 2), (4, 3)):
        tries = [case for case in cases if case["longs"] == count]
        ttft = statistics.median(case["ttft"] for case in tries)
        goal = factor * alone_ms + chunk
        result["cases"].append(
            {**tries[0], "ttft": ttft, "tries": [case["ttft"] for case in tries], "goal": goal}
            | {"factor": factor, "ratio": ttft / alone_ms, "met": ttft <= goal}
        )
    return result


def _behind(port: int, model: str, longs: list[list[int]], short: list[int], chunk: float) -> dict:
    """Send the long prompts, wait until the server runs two of them (one if one) and
    queues the rest, and one chunk's time more, then the short one: its time to first
    token, and what the server ran and queued then. The long ones are then cancelled
    (their connections closed) and gone before this returns."""
    body = {"model": model, "max_tokens": LONG_NEW, "temperature": 0, "stream": True}
    connections = []
    for tokens in longs:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        payload = json.dumps({**body, "prompt": tokens})
        connection.request("POST", "/v1/completions", payload, JSON)
        connections.append(connection)
    running = min(len(longs), 2)
    _until(port, lambda h: (h["running"], h["waiting"]) == (running, len(longs) - running))
    time.sleep(chunk)  # it comes while the long prompts are being prefilled
    health = _get(port, "/health")
    ttft = _stream(port, model, short, SHORT_NEW)["ttft"]
    for connection in connections:
        connection.close()
    _until(port, lambda h: h["running"] == h["waiting"] == 0)
    state = {"running": health["running"], "waiting": health["waiting"]}
    return {"longs": len(longs), "ttft": ttft, **state}


def _until(port: int, done, timeout: float = 120) -> None:
    """Poll /health until done(its answer)."""
    deadline = time.perf_counter() + timeout
    while not done(health := _get(port, "/health")):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the server did not get there in {timeout:.0f} s: {health}")
        time.sleep(0.002)


def name_is_quick(load: dict) -> bool:
    return load.get("name") == "quick"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def report(result: dict) -> str:
    load, cache, peak = result["load"], result["cache"], result["peak"]
    lines = [
        f"mhsa serve: {result['model']} (quantize {result.get('quantize', 'default')}), "
        f"load {load.get('name', '?')}: {load['requests']} greedy streamed completions "
        f"(prompts {load['prompt'][0]}..{load['prompt'][1]} words, {load['new'][0]}.."
        f"{load['new'][1]} new tokens), {result['cpu']}",
        f"{'load':<28}{'tokens/s':>10}{'TTFT p50':>10}{'p95':>9}{'ITL p50':>10}{'p95':>9}",
    ]
    serial = load.get("serial_requests", load["requests"])
    for label, key in (
        (f"{load['clients']} concurrent clients", "concurrent"),
        (f"one at a time ({serial} requests)", "one_at_a_time"),
    ):
        r = result[key]
        lines.append(
            f"{label:<28}{r['tokens_per_second']:>10.1f}{_ms(r['ttft']['p50']):>10}"
            f"{_ms(r['ttft']['p95']):>9}{_ms(r['itl']['p50']):>10}"
            f"{_ms(r['itl']['p95']):>9}"
        )
    lines.append(f"throughput, concurrent vs one at a time: {result['speedup']:.2f}x")
    mib = 2**20
    contiguous = peak["contiguous_bytes"]
    lines.append(
        f"peak cache memory: {peak['peak_bytes'] / mib:.1f} MiB ({peak['peak_used_blocks']} of "
        f"{cache['num_blocks']} blocks of {cache['block_size']} tokens) vs "
        f"{contiguous / mib:.1f} MiB for contiguous caches of the longest request "
        f"({peak['longest_request']} tokens) x {peak['peak_running']} running: "
        f"{peak['peak_bytes'] / contiguous:.2f}x"
    )
    if "speculative" in result:
        lines += speculation.report(result["speculative"], result.get("draft_tokens", 4))
    if "head_of_line" in result:
        lines += head_of_line_report(result["head_of_line"])
    return "\n".join(lines)


def head_of_line_report(head: dict) -> list[str]:
    lines = [
        f"head of line: a {SHORT}-token prompt ({_tokens(SHORT_NEW)} new) behind "
        f"{head['long']}-token prompts ({LONG_NEW} new) prefilled in {CHUNK}-token chunks; "
        f"a pool of {head['num_blocks']} blocks of {BLOCK} (two long requests), --max-wait 0",
        f"  alone: time to first token {_ms(head['alone'])} (median of {TRIES}); a long prompt "
        f"alone {_ms(head['long_alone'])}, one chunk {_ms(head['chunk'])}",
        f"  {'behind':<30}{'TTFT':>9}{'x alone':>9}   goal (median of {TRIES}; the tries)",
    ]
    for case in head["cases"]:
        label = f"{case['longs']} long ({case['running']} running, {case['waiting']} waiting)"
        goal = f"{case['factor']}x alone + 1 chunk = {_ms(case['goal'])}"
        tries = ", ".join(f"{t * 1000:.0f}" for t in case["tries"])
        lines.append(
            f"  {label:<30}{_ms(case['ttft']):>9}{case['ratio']:>8.1f}x"
            f"   {'met' if case['met'] else 'MISSED'}: <= {goal} ({tries} ms)"
        )
    return lines


def _tokens(count: int) -> str:
    return f"{count} token" + ("s" if count != 1 else "")
