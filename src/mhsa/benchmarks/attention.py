"""`mhsa bench attention`: the flash engine against PyTorch SDPA, time and memory.

Float32 on the CPU by default (device and dtype: any), B=1. Times are best-of-N,
interleaved in one run; GFLOP/s count 4*B*H*L*S*D for a forward (halved for causal) and
2.5x that for a backward, and are also given as a fraction of a matmul in the same dtype
measured in the same run. The targets (flash against SDPA) and the memory cases (a
fresh process's resident memory) are the CPU's: on CUDA neither is measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhsa.core.attention import attention

from .memory import measure_in_subprocess
from .placement import CPU, Placement
from .timing import best_times, matmul_gflops

GIB = 2**30


def _inputs(heads: int, length: int, head_dim: int, grad: bool = False, **placed):
    """q, k, v (1, heads, length, head_dim); placed: device and dtype."""
    return [
        torch.randn(1, heads, length, head_dim, **placed).requires_grad_(grad) for _ in range(3)
    ]


def _forward_backward(fn, tensors):
    def step():
        for t in tensors:
            t.grad = None
        fn(*tensors).sum().backward()

    return step


def timing_cases(
    length: int,
    heads: int,
    head_dim: int,
    repeat: int,
    on: Placement = CPU,
) -> list[dict]:
    """Dense and causal forward, causal forward+backward: sdpa vs flash (and auto)."""
    q, k, v = _inputs(heads, length, head_dim, **on.kwargs)
    fwd_flops = 4 * heads * length * length * head_dim
    grads = _inputs(heads, length, head_dim, grad=True, **on.kwargs)
    cases = [
        (
            "dense forward",
            fwd_flops,
            {
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
                "flash": lambda: attention(q, k, v, backend="flash"),
                "auto": lambda: attention(q, k, v),
            },
            {"flash": 1.3, "auto": 1.05},
        ),
        (
            "causal forward",
            fwd_flops / 2,
            {
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "flash": lambda: attention(q, k, v, causal=True, backend="flash"),
            },
            {"flash": 1.3},
        ),
        (
            "causal forward+backward",
            fwd_flops / 2 * 3.5,
            {
                "sdpa": _forward_backward(
                    lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), grads
                ),
                "flash": _forward_backward(
                    lambda a, b, c: attention(a, b, c, causal=True, backend="flash"), grads
                ),
            },
            {"flash": 1.6},
        ),
    ]
    rows = []
    for name, flops, fns, targets in cases:
        times = best_times(fns, repeat, on.device)
        targets = targets if on == CPU else {}  # the targets are the CPU's, in float32
        for backend, seconds in times.items():
            rows.append(
                {
                    "case": name,
                    "shape": f"B=1 H={heads} L=S={length} D={head_dim}",
                    "backend": backend,
                    "seconds": seconds,
                    "vs_sdpa": seconds / times["sdpa"],
                    "gflops": flops / seconds / 1e9,
                    "target_vs_sdpa": targets.get(backend),
                }
            )
    return rows


def memory_cases(long: bool) -> list[dict]:
    """Peak extra memory of forward+backward, each in a fresh process. The default run
    fits a 16 GB machine (the reference at L=8192, H=2 peaks near 3 GiB); long adds
    L=16384 (the reference needs about 12 GiB there) and a causal L=65536, H=8 flash
    run (about 1 GiB, a minute on 2 cores)."""
    # the reference needs ~3 score matrices (4*H*L*L bytes each): the ratio is taken at
    # H=2 (both backends scale linearly in H)
    lengths = (8192, 16384) if long else (8192,)
    rows = []
    for length in lengths:
        rows.append(measure_in_subprocess("reference", length, heads=2))
        rows.append(measure_in_subprocess("flash", length, heads=2))
    rows.append(measure_in_subprocess("flash", lengths[-1], heads=8))
    if long:
        rows.append(measure_in_subprocess("flash", 65536, heads=8, causal=True))
    return rows


def run(
    length: int = 4096,
    heads: int = 8,
    head_dim: int = 64,
    repeat: int = 5,
    memory: bool = True,
    long: bool = False,
    on: Placement = CPU,
) -> dict:
    """The timings, placed by `on` (and, on the CPU, the memory cases)."""
    torch.manual_seed(0)
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul_gflops": matmul_gflops(2048 if on.cpu else 8192, **on.kwargs),
        "timing": timing_cases(length, heads, head_dim, repeat, on),
    }
    if on != CPU:  # (the CPU in bfloat16 too: its dtype heads the table)
        result["dtype"] = on.dtype_name
    if not on.cpu:
        result["device"] = str(on.device)
    # the memory cases are the CPU's in float32: their fresh processes take no dtype
    result["memory"] = memory_cases(long) if memory and on == CPU else []
    return result


def report(result: dict) -> str:
    """The human-readable table."""
    where = f"{result['threads']} threads" if "device" not in result else result["device"]
    lines = [
        f"torch {result['torch']}, {where}, {result.get('dtype', 'float32')} matmul "
        f"{result['matmul_gflops']:.1f} GFLOP/s",
        f"{'case':<24} {'shape':<26} {'backend':<8} {'ms':>9} {'vs sdpa':>8} "
        f"{'GFLOP/s':>8} {'of matmul':>9}  target",
    ]
    for row in result["timing"]:
        target = row["target_vs_sdpa"]
        verdict = (
            ""
            if target is None
            else (f"<= {target}x " + ("ok" if row["vs_sdpa"] <= target else "MISSED"))
        )
        lines.append(
            f"{row['case']:<24} {row['shape']:<26} {row['backend']:<8} "
            f"{row['seconds'] * 1e3:9.1f} {row['vs_sdpa']:7.2f}x {row['gflops']:8.1f} "
            f"{row['gflops'] / result['matmul_gflops']:8.0%}  {verdict}"
        )
    if "device" in result:
        lines.append(
            "no targets or memory cases on CUDA (the CPU's: resident memory of a fresh "
            "process); GPU memory: python -m mhsa.benchmarks.gpu (its long section)"
        )
    elif "dtype" in result:
        lines.append("no targets or memory cases in this dtype (the CPU's are in float32)")
    if result["memory"]:
        lines.append("forward+backward peak extra memory (fresh process each):")
    by_key = {}
    for row in result["memory"]:
        shape = f"L=S={row['length']} H={row['heads']}" + (" causal" if row["causal"] else "")
        if "error" in row:
            lines.append(f"  {row['backend']:<10} {shape:<26} failed: {row['error']}")
            continue
        by_key[(row["backend"], row["length"], row["heads"])] = row["extra_bytes"]
        lines.append(
            f"  {row['backend']:<10} {shape:<26} {row['extra_bytes'] / GIB:8.2f} GiB "
            f"in {row['seconds']:.1f} s"
        )
        if row["length"] == 65536:
            need = 4 * row["heads"] * row["length"] ** 2 / GIB
            lines.append(
                f"  {'':<10} target <= 3 GiB: "
                + ("ok" if row["extra_bytes"] <= 3 * GIB else "MISSED")
                + f" (one reference score matrix alone: {need:.0f} GiB)"
            )
    for length in (8192, 16384):
        ref, flash = by_key.get(("reference", length, 2)), by_key.get(("flash", length, 2))
        if ref and flash:
            ratio = flash / ref
            verdict = "ok" if ratio <= 1 / 8 else "MISSED"
            lines.append(
                f"  flash / reference at L=S={length}: {ratio:.3f} (target <= 0.125) {verdict}"
            )
    return "\n".join(lines)
