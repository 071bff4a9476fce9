"""Peak extra resident memory of one attention forward+backward, in a fresh process.

    python -m mhsa.benchmarks.memory --backend flash --length 16384 --heads 8 --causal

prints one JSON line: the baseline RSS after a small warm-up and creating the inputs,
the peak RSS (VmHWM, reset to the baseline first) after forward+backward, and their
difference.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, where allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pattern_named(name: str | None):
    """The patterns the benchmarks use, by name (None: no mask)."""
    from mhsa.core import masks

    return {
        None: None,
        "window": masks.SlidingWindow(256, 256),
        "bigbird": masks.bigbird(64),
    }[name]


def score_named(name: str | None, heads: int):
    """The score functions the benchmarks use, by name (None: none)."""
    from mhsa.core.scores import ALiBi, Softcap
    from mhsa.nn.positional import alibi_slopes

    return {None: None, "alibi": ALiBi(alibi_slopes(heads)), "softcap": Softcap(30.0)}[name]


def measure(
    backend: str,
    length: int,
    heads: int,
    head_dim: int,
    causal: bool,
    pattern: str | None = None,
    score: str | None = None,
    moba: tuple[int, int] | None = None,
) -> dict:
    """moba (block_size, top_k): mhsa.moba_attention on `backend` instead of attention."""
    from mhsa.core.attention import attention
    from mhsa.core.moba import moba_attention

    mask = pattern_named(pattern)
    score_fn = score_named(score, heads)

    def call(q, k, v):
        if moba is not None:
            return moba_attention(q, k, v, min(moba[0], q.shape[2]), 1, backend=backend)
        return attention(q, k, v, mask, causal=causal, backend=backend, score=score_fn)

    # a small warm-up first, so one-time costs (thread pools, libraries) are not counted
    tiny = [torch.randn(1, heads, 128, head_dim, requires_grad=True) for _ in range(3)]
    call(*tiny).sum().backward()
    if moba is not None:

        def call(q, k, v):
            return moba_attention(q, k, v, *moba, backend=backend)

    q, k, v = (torch.randn(1, heads, length, head_dim, requires_grad=True) for _ in range(3))
    baseline = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    out = call(q, k, v)
    out.sum().backward()
    seconds = time.perf_counter() - start
    peak = peak_bytes()
    return {
        "backend": backend,
        "length": length,
        "heads": heads,
        "head_dim": head_dim,
        "causal": causal,
        "pattern": pattern,
        "score": score,
        "moba": moba,
        "seconds": seconds,
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "extra_bytes": peak - baseline,
    }


def measure_in_subprocess(
    backend: str,
    length: int,
    heads: int,
    head_dim: int = 64,
    causal: bool = False,
    pattern: str | None = None,
    score: str | None = None,
    moba: tuple[int, int] | None = None,
) -> dict:
    """Run `measure` in a fresh interpreter so that peaks do not mix."""
    cmd = [
        sys.executable,
        "-m",
        "mhsa.benchmarks.memory",
        "--backend",
        backend,
        "--length",
        str(length),
        "--heads",
        str(heads),
        "--head-dim",
        str(head_dim),
    ]
    if causal:
        cmd.append("--causal")
    if pattern:
        cmd += ["--pattern", pattern]
    if score:
        cmd += ["--score", score]
    if moba:
        cmd += ["--moba", f"{moba[0]},{moba[1]}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        error = (result.stderr.strip().splitlines() or ["killed"])[-1]
        return {
            "backend": backend,
            "length": length,
            "heads": heads,
            "causal": causal,
            "pattern": pattern,
            "score": score,
            "error": error,
        }
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--pattern", choices=["window", "bigbird"])
    parser.add_argument("--score", choices=["alibi", "softcap"])
    parser.add_argument("--moba", metavar="BLOCK,TOP_K", help="MoBA instead of attention")
    args = parser.parse_args()
    moba = tuple(int(x) for x in args.moba.split(",")) if args.moba else None
    row = measure(
        args.backend,
        args.length,
        args.heads,
        args.head_dim,
        args.causal,
        args.pattern,
        args.score,
        moba,
    )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
