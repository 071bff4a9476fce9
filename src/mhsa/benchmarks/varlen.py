"""`mhsa bench varlen`: training on packed sequences against a padded batch.

Speed: one GPT training step (forward + backward, float32) on sequences whose lengths
are drawn from a long-tailed distribution (log-normal, median ~200, clipped to
16..2048), drawn until the next would pass a token budget. Packed: the sequences in
one row (mhsa.data.pack; each attends only itself, targets -100 at each end). Padded:
the same sequences as a (batch, longest) batch padded on the right (causal, so the
padding needs no mask; its targets are -100). Both train on the same real tokens, so
tokens/s is real tokens over the step's time (best of `repeat`, interleaved).
Planning: the packed step's own planning (the packed row's checks and positions, and
each layer's Segments pattern and block plan, as the flash backend builds them), timed
alone, as a share of the step.

Memory: peak extra resident memory of one attention forward + backward (causal,
H=8, D=64) in a fresh process: 65536 tokens as 64 packed sequences of 1024
(mhsa.attention_varlen) against a (64, 8, 1024, 64) batch (mhsa.attention).

On another device (run's `on`) the speed case runs there, under autocast to on's
dtype (a training step: float32 weights); the memory case is the CPU's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from .memory import peak_bytes, reset_peak, rss_bytes
from .placement import CPU, Placement
from .timing import best_times

HEADS, HEAD_DIM = 8, 64
FULL = {"budget": 16384, "low": 16, "high": 2048, "median": 200, "layers": 2, "d_model": 256}
QUICK = {"budget": 1024, "low": 4, "high": 256, "median": 24, "layers": 1, "d_model": 32}


def long_tailed_lengths(budget: int, low: int, high: int, median: int, seed: int = 0) -> list:
    """Lengths from a log-normal (sigma 1) of the given median, clipped to low..high,
    drawn until the next would pass budget tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while True:
        draw = torch.randn(1, generator=generator).exp().item() * median
        length = int(min(max(draw, low), high))
        if sum(lengths) + length > budget:
            return lengths
        lengths.append(length)


def _model(layers: int, d_model: int):
    from mhsa.models import GPT, GPTConfig

    torch.manual_seed(0)
    heads = max(1, d_model // 64)  # head_dim 64 (32 at the quick size)
    return GPT(
        GPTConfig(vocab_size=256, n_layer=layers, n_head=heads, d_model=d_model, position="rotary")
    )


def _batches(lengths: list[int]) -> tuple[dict, dict]:
    """(packed batch, padded batch) of the same random sequences, for model.loss(**b)."""
    from mhsa.data.packing import IGNORE, next_token_targets, pack

    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 256, (n,), generator=generator) for n in lengths]
    (row,) = pack(sequences, sum(lengths))
    packed = {
        "idx": row.tokens.view(1, -1),
        "targets": next_token_targets(row.tokens, row.cu_seqlens).view(1, -1),
        "cu_seqlens": row.cu_seqlens,
    }
    longest = max(lengths)
    idx = torch.zeros(len(lengths), longest, dtype=torch.long)
    targets = torch.full_like(idx, IGNORE)
    for i, s in enumerate(sequences):
        idx[i, : len(s)] = s
        targets[i, : len(s) - 1] = s[1:]
    return packed, {"idx": idx, "targets": targets}


def _planning(model, packed: dict, device: torch.device | str = "cpu") -> None:
    """What the packed step plans: the row's checks and positions, then per layer the
    Segments pattern and the flash backend's block plan."""
    from mhsa.core.backends.flash_plan import plan_for
    from mhsa.models.packing import packed_row

    row = packed_row(packed["idx"], packed["cu_seqlens"], None)
    total = packed["idx"].shape[1]
    for _ in range(model.config.n_layer):
        plan_for(row.pattern(causal=True), False, total, total, device, fused=True)


def speed_case(settings: dict, repeat: int, on: Placement = CPU) -> dict:
    """The packed and padded steps (and the planning) on on.device, under autocast to
    on.dtype."""
    from mhsa.apps.train.throughput import autocast, to_device

    device = on.device
    lengths = long_tailed_lengths(
        settings["budget"], settings["low"], settings["high"], settings["median"]
    )
    model = _model(settings["layers"], settings["d_model"]).to(device)
    packed, padded = to_device(_batches(lengths), device)

    def step(batch):
        def run() -> None:
            model.zero_grad(set_to_none=True)
            with autocast(device, on.dtype):
                loss = model.loss(**batch)
            loss.backward()

        return run

    times = best_times(
        {
            "packed": step(packed),
            "padded": step(padded),
            "planning": lambda: _planning(model, packed, device),
        },
        repeat,
        device,
    )
    tokens = sum(lengths)
    return {
        "sequences": len(lengths),
        "tokens": tokens,
        "median_length": sorted(lengths)[len(lengths) // 2],
        "longest": max(lengths),
        "padded_tokens": len(lengths) * max(lengths),
        "layers": settings["layers"],
        "d_model": settings["d_model"],
        "seconds": times,
        "tokens_per_second": {
            "packed": tokens / times["packed"],
            "padded": tokens / times["padded"],
        },
        "speedup": times["padded"] / times["packed"],
        "planning_share": times["planning"] / times["packed"],
    }


def measure_memory(kind: str, segments: int, length: int) -> dict:
    """Peak extra RSS of one causal attention forward + backward: `segments` sequences
    of `length` tokens, packed (attention_varlen) or as a batch (attention)."""
    from mhsa.core.attention import attention
    from mhsa.core.varlen import attention_varlen

    cu = torch.arange(segments + 1, dtype=torch.int32) * length

    def run(q, k, v, cu_seqlens, n) -> torch.Tensor:
        if kind == "packed":
            return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, n, n, causal=True)
        return attention(q, k, v, causal=True)

    def inputs(count: int, n: int) -> list[torch.Tensor]:
        shape = (count * n, HEADS, HEAD_DIM) if kind == "packed" else (count, HEADS, n, HEAD_DIM)
        return [torch.randn(shape, requires_grad=True) for _ in range(3)]

    small = torch.arange(3, dtype=torch.int32) * 64  # warm-up: thread pools, libraries
    run(*inputs(2, 64), small, 64).sum().backward()
    q, k, v = inputs(segments, length)
    baseline = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    run(q, k, v, cu, length).sum().backward()
    seconds = time.perf_counter() - start
    peak = peak_bytes()
    return {"kind": kind, "seconds": seconds, "extra_bytes": peak - baseline}


def memory_case(segments: int, length: int) -> dict:
    """Both sides, each in a fresh process so that their peaks do not mix."""
    rows = {}
    for kind in ("packed", "batched"):
        cmd = [sys.executable, "-m", "mhsa.benchmarks.varlen", kind, str(segments), str(length)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            error = (done.stderr.strip().splitlines() or ["killed"])[-1]
            return {"segments": segments, "length": length, "error": f"{kind}: {error}"}
        rows[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "segments": segments,
        "length": length,
        "extra_bytes": {kind: row["extra_bytes"] for kind, row in rows.items()},
        "ratio": rows["packed"]["extra_bytes"] / max(1, rows["batched"]["extra_bytes"]),
    }


def run(repeat: int = 3, quick: bool = False, on: Placement = CPU) -> dict:
    """The speed case on on.device (autocast to on.dtype); the memory case on the CPU
    only."""
    settings = QUICK if quick else FULL
    if not on.cpu:
        memory = {"error": "measured on the CPU only (resident memory of a fresh process)"}
    else:
        memory = memory_case(4, 128) if quick else memory_case(64, 1024)
    result = {
        "speed": speed_case(settings, repeat, on),
        "memory": memory,
        "threads": torch.get_num_threads(),
    }
    if on != CPU:
        result["placement"] = f"{on} autocast"
    return result


def report(result: dict) -> str:
    s, m = result["speed"], result["memory"]
    lines = [
        f"GPT training step ({s['layers']} layers, d_model {s['d_model']}, "
        f"{result.get('placement', 'float32')}, "
        f"{result['threads']} threads): {s['sequences']} sequences, {s['tokens']} tokens "
        f"(median {s['median_length']}, longest {s['longest']}; padded: {s['padded_tokens']})",
        f"{'':<10}{'seconds':>10}{'tokens/s':>12}",
    ]
    for name in ("packed", "padded"):
        seconds, rate = s["seconds"][name], s["tokens_per_second"][name]
        lines.append(f"{name:<10}{seconds:>10.3f}{rate:>12,.0f}")
    lines.append(f"packed / padded tokens/s: {s['speedup']:.2f}x (goal >= 2x)")
    lines.append(
        f"planning: {s['seconds']['planning'] * 1e3:.2f} ms, {s['planning_share']:.2%} of the "
        "packed step (goal < 5%)"
    )
    if "error" in m:
        lines.append(f"memory: {m['error']}")
    else:
        mib = {kind: b / 2**20 for kind, b in m["extra_bytes"].items()}
        lines.append(
            f"attention forward+backward peak, {m['segments']} x {m['length']} tokens: packed "
            f"{mib['packed']:.0f} MiB, batched {mib['batched']:.0f} MiB, ratio "
            f"{m['ratio']:.2f}x (goal < 1.2x)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["packed", "batched"])
    parser.add_argument("segments", type=int)
    parser.add_argument("length", type=int)
    args = parser.parse_args()
    print(json.dumps(measure_memory(args.kind, args.segments, args.length)))


if __name__ == "__main__":
    main()
