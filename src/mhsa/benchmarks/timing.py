"""Timing helpers: interleaved best-of-N wall times, and a matmul yardstick."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_times(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best-of-`repeat` seconds for each function, run interleaved after one warm-up
    each, so that drift on a shared machine hits all of them alike."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def matmul_gflops(size: int = 2048, repeat: int = 5) -> float:
    """Achieved GFLOP/s of a float32 (size x size) @ (size x size) matmul here."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = best_times({"matmul": lambda: a @ b}, repeat)["matmul"]
    return 2 * size**3 / seconds / 1e9
