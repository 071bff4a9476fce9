"""`mhsa bench scores`: score functions inside the flash engine against the same call
without one (causal, B=1, H=8, D=64, float32, forward + backward), in one run.

Time: best of `repeat`, interleaved. Memory: peak extra resident memory of one
forward + backward in a fresh process (mhsa.benchmarks.memory), against the same call
without a score function and against ALiBi given as the dense (H, L, S) bias it was
before score functions (estimated: H * L * S * 4 bytes, twice with its gradient).
"""

from __future__ import annotations

import torch

from .memory import measure_in_subprocess, score_named
from .timing import best_times

HEADS, HEAD_DIM = 8, 64
SCORES = (None, "alibi", "softcap")


def _step(q, k, v, score):
    from mhsa.functional import attention

    def run() -> None:
        out = attention(q, k, v, causal=True, backend="flash", score=score)
        torch.autograd.grad(out.sum(), (q, k, v))

    return run


def run(length: int = 4096, repeat: int = 3, memory: bool = True) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    fns = {str(name): _step(q, k, v, score_named(name, HEADS)) for name in SCORES}
    seconds = best_times(fns, repeat)
    result = {"length": length, "heads": HEADS, "head_dim": HEAD_DIM, "seconds": seconds}
    if memory:
        result["extra_bytes"] = {
            str(name): measure_in_subprocess("flash", length, HEADS, HEAD_DIM, causal=True,
                                             score=name).get("extra_bytes")
            for name in (None, "alibi")
        }  # fmt: skip
    result["dense_bias_bytes"] = HEADS * length * length * 4
    return result


def report(result: dict) -> str:
    seconds, base = result["seconds"], result["seconds"]["None"]
    lines = [f"score functions in the flash engine: causal, B=1, H={result['heads']}, "
             f"D={result['head_dim']}, L=S={result['length']}, float32, forward+backward",
             f"{'score':>10} {'time (s)':>9} {'vs none':>8}"]  # fmt: skip
    for name, value in seconds.items():
        lines.append(f"{name:>10} {value:9.3f} {value / base:7.2f}x")
    extra = result.get("extra_bytes")
    if extra and extra.get("None"):
        none, alibi = extra["None"] / 2**20, extra["alibi"] / 2**20
        dense = result["dense_bias_bytes"] / 2**20
        lines.append(f"peak extra memory: none {none:.0f} MiB, alibi {alibi:.0f} MiB "
                     f"({alibi / none:.2f}x); a dense ALiBi bias is {dense:.0f} MiB")  # fmt: skip
    return "\n".join(lines)
