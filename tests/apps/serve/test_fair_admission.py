"""Fair admission on a live server: a small request behind one that waits for the whole
pool is admitted beside the running request (by fit) and completes while the large one
still waits, instead of queueing behind it."""

from __future__ import annotations

import threading
import time

from live_server import openai_client


def test_a_small_request_behind_a_large_one_completes_first(start_server):
    # 16 blocks of 16 tokens; one request may take the whole pool
    server = start_server(num_blocks=16, block_size=16, max_share=1.0, max_batch=4)
    engine = server.served.engine
    client = openai_client(server)
    running = client.completions.create(
        model="tiny", prompt=[1 + i % 200 for i in range(100)], max_tokens=140, stream=True
    )  # 240 tokens: 15 blocks
    next(iter(running))  # it runs
    large_done = threading.Event()

    def large() -> None:  # 256 tokens: all 16 blocks, so it waits for the first to end
        client.completions.create(model="tiny", prompt=[7] * 100, max_tokens=156)
        large_done.set()

    waiter = threading.Thread(target=large)
    waiter.start()
    deadline = time.monotonic() + 30
    while engine.queued == 0 and not large_done.is_set():
        assert time.monotonic() < deadline, "the large request never queued"
        time.sleep(0.001)
    small = client.completions.create(model="tiny", prompt="hi", max_tokens=4, timeout=30)
    assert small.choices[0].finish_reason == "length"
    assert not large_done.is_set()  # the small one did not wait for the large one
    for _ in running:
        pass
    waiter.join(timeout=60)
    assert large_done.is_set() and engine.idle and engine.cache.used_blocks == 0
