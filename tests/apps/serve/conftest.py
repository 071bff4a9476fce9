"""The live-server fixture of tests/apps/serve (helpers in live_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from live_server import tiny_gpt

from mhsa.apps.serve.models import ServedModel
from optional import needs


@pytest.fixture
def start_server() -> Iterator:
    """start_server(limits=..., access=..., **engine options) -> a running Server on a free
    port over tiny_gpt (each stopped at the end of the test)."""
    needs("starlette"), needs("uvicorn")
    from mhsa.apps.serve.server import Server

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: a second thread only waits
    running = []

    def start(limits=None, access=None, served=None, **engine_options):
        options = {"num_blocks": 64, "block_size": 16, **engine_options}
        served = served or ServedModel.from_gpt(tiny_gpt(), "tiny", **options)
        server = Server(served, port=0, limits=limits, access=access).start()
        running.append(server)
        return server

    yield start
    for server in running:
        server.stop()
    torch.set_num_threads(threads)
