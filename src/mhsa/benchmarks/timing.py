"""Timing helpers: interleaved best-of-N wall times, a peer's timed setup, and a
matmul yardstick."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch


class Setup(NamedTuple):
    """A peer made for a comparison (say, compiled FlexAttention): fn and the seconds
    making it took, compiling included; or fn None and why it could not be made."""

    fn: Callable | None
    seconds: float | None
    unavailable: str | None


def timed_setup(make: Callable[[], Callable]) -> Setup:
    """make(), timed; where it raises (no compiler toolchain, an unsupported platform,
    a torch without the API), the error's first line instead."""
    start = time.perf_counter()
    try:
        fn = make()
    except Exception as error:
        return Setup(None, None, error_line(error))
    return Setup(fn, time.perf_counter() - start, None)


def error_line(error: Exception) -> str:
    """ "TypeName: the message's first line"."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def best_times(
    fns: dict[str, Callable[[], object]], repeat: int, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """Best-of-`repeat` seconds for each function, run interleaved after one warm-up
    each, so that drift on a shared machine hits all of them alike. On a CUDA device
    each timing waits for the queued kernels to finish."""
    device = torch.device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in fns.values():
        fn()
    sync()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def matmul_gflops(
    size: int = 2048,
    repeat: int = 5,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Achieved GFLOP/s of a (size x size) @ (size x size) matmul here."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    seconds = best_times({"matmul": lambda: a @ b}, repeat, device)["matmul"]
    return 2 * size**3 / seconds / 1e9


def versus(name: str, mine: float, theirs: float) -> str:
    """ "NAME is 1.40x faster" or "NAME is 2.86x slower": mine's seconds against theirs."""
    ratio = theirs / mine
    return f"{name} is {ratio:.2f}x faster" if ratio >= 1 else f"{name} is {1 / ratio:.2f}x slower"
