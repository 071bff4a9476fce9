"""Attention and training past one process, on torch.distributed.

    ring.py       ring_attention: exact attention over a sequence sharded across ranks
    layout.py     shard / unshard in the contiguous and zigzag layouts
    blocks.py     which ranks a call visits and which blocks it computes
    transfer.py   point-to-point transfers around the ring
    checks.py     argument checks that fail the same way on every rank
    context.py    context_parallel(): every attention call in a block as ring attention

`run_local` (from mhsa.launch) starts a local gloo process group of CPU processes,
for tests and benchmarks.
"""

from ..launch import free_port, run_local
from .context import RingBackend, context_parallel
from .layout import LAYOUTS, shard, unshard
from .ring import ring_attention

__all__ = [
    "LAYOUTS",
    "RingBackend",
    "context_parallel",
    "free_port",
    "ring_attention",
    "run_local",
    "shard",
    "unshard",
]
