"""`mhsa bench ring`: ring attention's per-rank peak memory and time against one process.

Forward+backward of attention at total length L, float32, B=1, on the CPU:
    single  mhsa.attention on the whole sequence (flash backend) in one process
    ring    mhsa.distributed.ring_attention with L / P positions on each of P processes
            (a local gloo group), every process with cpus / P threads
Each runs in fresh spawned processes. Memory is the peak resident memory (VmHWM, reset
just before the call) above the resident memory once the inputs exist, per process:
ring's should fall about as 1/P. Time is the best of `repeat` calls (for ring, the
slowest rank's), given as ring / single.

    mhsa bench ring --nproc 4
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..distributed import LAYOUTS
from .memory import peak_bytes, reset_peak, rss_bytes

MIB = 2**20


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Case:
    """One measured configuration: ring attention over the processes (else flash in
    each), float32 inputs (1, heads, length, head_dim) split into equal shards."""

    ring: bool
    length: int
    heads: int
    head_dim: int
    causal: bool
    layout: str
    repeat: int


def _measure(rank: int, world: int, case: Case) -> dict:
    """One process's memory and times (run in a spawned process of a local group)."""
    from mhsa.core.attention import attention
    from mhsa.distributed import ring_attention

    heads, head_dim = case.heads, case.head_dim

    def call(q, k, v):
        if case.ring:
            return ring_attention(q, k, v, causal=case.causal, layout=case.layout)
        return attention(q, k, v, causal=case.causal, backend="flash")

    def step(tensors):
        for t in tensors:
            t.grad = None
        call(*tensors).sum().backward()

    # warm up thread pools, the process group and the kernels on a small input first
    step([torch.randn(1, heads, 64, head_dim, requires_grad=True) for _ in range(3)])
    shard_len = case.length // world
    gen = torch.Generator().manual_seed(rank)
    tensors = [
        torch.randn(1, heads, shard_len, head_dim, generator=gen).requires_grad_() for _ in range(3)
    ]
    dist.barrier()
    baseline = rss_bytes()
    reset = reset_peak()
    times = []
    for i in range(case.repeat):
        dist.barrier()
        start = time.perf_counter()
        step(tensors)
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = peak_bytes()
    return {"extra_bytes": peak - baseline, "times": times, "peak_reset": reset}


def _case(nproc: int, case: Case, cores: int) -> dict:
    from mhsa.distributed import run_local

    threads = max(1, cores // nproc)
    ranks = run_local(_measure, nproc, case, timeout=600, threads=threads)
    per_call = [max(r["times"][i] for r in ranks) for i in range(case.repeat)]  # slowest rank
    return {
        "mode": "ring" if case.ring else "single",
        "nproc": nproc,
        "threads_per_process": threads,
        "length": case.length,
        "shard_len": case.length // nproc,
        "heads": case.heads,
        "head_dim": case.head_dim,
        "causal": case.causal,
        "layout": case.layout if case.ring else None,
        "input_bytes_per_process": 3 * case.heads * (case.length // nproc) * case.head_dim * 4,
        "extra_bytes": max(r["extra_bytes"] for r in ranks),
        "per_rank_extra_bytes": [r["extra_bytes"] for r in ranks],
        "seconds": min(per_call),
        "peak_reset": all(r["peak_reset"] for r in ranks),
    }


def run(
    nproc: int = 2,
    length: int = 32768,
    heads: int = 4,
    head_dim: int = 64,
    causal: bool = True,
    layout: str = "zigzag",
    repeat: int = 2,
    quick: bool = False,
    threads: int | None = None,
) -> list[dict]:
    """Two rows: the single-process baseline, then ring attention over nproc processes
    (with memory_ratio = ring / single per process, ideal_ratio = 1 / nproc, and
    time_ratio = ring / single), at length rounded up to a multiple of the layout's
    chunks (2 * nproc for zigzag). quick: a smoke run at length 2048, repeat 1. threads: the
    cores the benchmark may use (default: all this process may use); the baseline gets
    them all, each of the nproc processes an equal share."""
    if quick:
        length, repeat = 2048, 1
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    chunks = nproc * (2 if layout == "zigzag" else 1)
    length = -(-length // chunks) * chunks  # (rounded up: each rank's chunks equal)
    case = Case(False, length, heads, head_dim, causal, layout, repeat)
    cores = _cpus() if threads is None else threads
    single = _case(1, case, cores)
    ring = _case(nproc, replace(case, ring=True), cores)
    ring["memory_ratio"] = ring["extra_bytes"] / single["extra_bytes"]
    ring["ideal_ratio"] = 1.0 / nproc
    ring["time_ratio"] = ring["seconds"] / single["seconds"]
    return [single, ring]


def report(rows: list[dict]) -> str:
    first = rows[0]
    lines = [
        f"attention forward+backward, L={first['length']}, H={first['heads']}, "
        f"D={first['head_dim']}, causal={first['causal']}, float32, B=1, CPU; "
        "peak memory above the inputs, per process",
        f"  {'case':<24} {'shard':>7} {'threads':>7} {'MiB/proc':>9} {'mem ratio':>9} "
        f"{'seconds':>8} {'time ratio':>10}",
    ]
    for row in rows:
        name = (
            "single process"
            if row["mode"] == "single"
            else (f"ring, {row['nproc']} ranks, {row['layout']}")
        )
        ratio = f"{row['memory_ratio']:.2f}" if "memory_ratio" in row else "1.00"
        time_ratio = f"{row['time_ratio']:.2f}x" if "time_ratio" in row else "1.00x"
        lines.append(
            f"  {name:<24} {row['shard_len']:>7} {row['threads_per_process']:>7} "
            f"{row['extra_bytes'] / MIB:>9.1f} {ratio:>9} {row['seconds']:>8.2f} "
            f"{time_ratio:>10}"
        )
    for row in rows:
        if "memory_ratio" in row:
            per_rank = ", ".join(f"{b / MIB:.1f}" for b in row["per_rank_extra_bytes"])
            lines.append(
                f"  per-rank MiB: {per_rank}; memory ratio x P = "
                f"{row['memory_ratio'] * row['nproc']:.2f} (1.00 would be exactly 1/P)"
            )
    if not all(row["peak_reset"] for row in rows):
        lines.append("  note: VmHWM could not be reset; peaks include the warm-up")
    return "\n".join(lines)
