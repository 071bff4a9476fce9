"""Peak extra resident memory of one attention forward+backward, in a fresh process.

    python -m mhsa.benchmarks.memory --backend flash --length 16384 --heads 8 --causal

prints one JSON line: the baseline RSS after creating the inputs, the peak RSS
(ru_maxrss) after forward+backward, and their difference.
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(backend: str, length: int, heads: int, head_dim: int, causal: bool) -> dict:
    import mhsa

    q, k, v = (torch.randn(1, heads, length, head_dim, requires_grad=True) for _ in range(3))
    baseline = _rss_bytes()
    start = time.perf_counter()
    out = mhsa.attention(q, k, v, causal=causal, backend=backend)
    out.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "backend": backend, "length": length, "heads": heads, "head_dim": head_dim,
        "causal": causal, "seconds": seconds, "baseline_bytes": baseline,
        "peak_bytes": peak, "extra_bytes": peak - baseline,
    }  # fmt: skip


def measure_in_subprocess(
    backend: str, length: int, heads: int, head_dim: int = 64, causal: bool = False
) -> dict:
    """Run `measure` in a fresh interpreter so that peaks do not mix."""
    cmd = [
        sys.executable, "-m", "mhsa.benchmarks.memory", "--backend", backend,
        "--length", str(length), "--heads", str(heads), "--head-dim", str(head_dim),
    ]  # fmt: skip
    if causal:
        cmd.append("--causal")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return {"backend": backend, "length": length, "heads": heads, "causal": causal,
                "error": (result.stderr.strip().splitlines() or ["killed"])[-1]}  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    print(json.dumps(measure(args.backend, args.length, args.heads, args.head_dim, args.causal)))


if __name__ == "__main__":
    main()
