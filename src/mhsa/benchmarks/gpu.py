"""The GPU check: correctness of sdpa, flex and triton on CUDA, then their speed.

    python -m mhsa.benchmarks.gpu --out DIR        on a CUDA machine (bf16)
    python -m mhsa.benchmarks.gpu --dry-run        anywhere: tiny shapes, float32, on
                                                   CPU (triton in the interpreter, flex
                                                   eager), to keep the script working

Checks: forward output and q/k/v gradients of every backend that serves a case,
against the float32 reference of the same inputs. Benchmark: B=4, H=16, D=128,
L = S in {8192, 2048, 16384}, cases dense, causal, SlidingWindow(1024, 0) and
bigbird(64); forward time and TFLOP/s (4 * D flops per allowed score entry), each as
a fraction of a bf16 matmul measured in the same run; the backends of one case are
timed interleaved. DIR/gpu.json is rewritten after every row (a run cut short keeps
what it measured); a summary is printed, ending with the issue's goals (triton
forward >= 0.8x flex; >= 60% of the matmul on causal L=8192). After the first length,
the triton forward is timed with each launch config in TUNING (causal), to choose the
kernels' defaults from. --budget (default 420 s) stops starting new cases, to fit a
10-minute slot.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from mhsa.core.attention import attention
from mhsa.core.backends.common import combined_mask
from mhsa.core.masks import SlidingWindow
from mhsa.core.masks.presets import bigbird

from .timing import best_times, matmul_gflops

BACKENDS = ("sdpa", "flex", "triton")
# triton forward launch configs (BLOCK_M, BLOCK_N, num_warps, num_stages) timed on causal
# attention at the first length, to choose kernels/triton/function.py's defaults from
TUNING = (
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (128, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 4, 3),
)
DRY_RUN_TUNING = ((16, 16, 4, 1), (32, 16, 4, 1))


def _cases(window: int, block: int) -> dict:
    return {
        "dense": (None, False),
        "causal": (None, True),
        f"window({window}, 0)": (SlidingWindow(window, 0), False),
        f"bigbird({block})": (bigbird(block), False),
    }


def _allowed(mask, causal: bool, length: int, device: torch.device) -> int:
    dense = combined_mask(mask, causal, length, length, device)
    return length * length if dense is None else int(dense.expand(length, length).sum())


def _call(name: str, q, k, v, mask, causal: bool, dry_run: bool):
    if name == "flex" and dry_run:  # the backend serves CUDA only: run flex eagerly here
        from mhsa.core.backends.flex import flex_forward

        return flex_forward(
            q, k, v, mask=mask, causal=causal, scale=q.shape[-1] ** -0.5, compiled=False
        )[0]
    return attention(q, k, v, mask, causal=causal, backend=name)


def check(name: str, case: str, mask, causal: bool, shape: tuple, dtype, device, dry_run: bool):
    """Max errors of out, dq, dk, dv against the float32 reference on the same inputs."""
    batch, heads, length, dim = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    backward = name != "flex" or not dry_run  # eager flex has no backward on CPU
    results = {}
    for label, inputs, call in (
        (
            "ref",
            [t.float() for t in (q, k, v)],
            lambda *t: attention(*t, mask, causal=causal, backend="reference"),
        ),
        ("ours", [q, k, v], lambda *t: _call(name, *t, mask, causal, dry_run)),
    ):
        inputs = [t.detach().requires_grad_(backward) for t in inputs]
        out = call(*inputs)
        if backward:
            out.backward(grad.to(out.dtype))
        results[label] = [out.float()] + ([t.grad.float() for t in inputs] if backward else [])
    pairs = zip(results["ours"], results["ref"], strict=True)
    errors = [float((a - b).detach().abs().max()) for a, b in pairs]
    return {"backend": name, "case": case, "shape": list(shape), "max_errors": errors}


class Results:
    """The result dict, rewritten to DIR/gpu.json (atomically) after every row, so a run
    cut short by a time limit still leaves everything it measured."""

    def __init__(self, path: Path | None, **header) -> None:
        self.path = path
        self.data = {**header, "checks": [], "bench": []}

    def add(self, section: str, row: dict) -> None:
        self.data[section].append(row)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)


def _failure(error: Exception) -> str:
    # a GPU run is expensive: record any failure of one backend and go on with the rest
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def run(
    dry_run: bool,
    repeat: int = 10,
    out: Path | None = None,
    lengths: tuple[int, ...] | None = None,
    budget: float = float("inf"),
) -> dict:
    """Checks, then the benchmark (L=8192 first: the issue's goals are measured there);
    rows that would start after `budget` seconds are recorded as skipped."""
    start = time.perf_counter()
    device = torch.device("cpu" if dry_run else "cuda")
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.float32 if dry_run else torch.bfloat16
    lengths = lengths or ((64, 128) if dry_run else (8192, 2048, 16384))
    batch, heads, dim = (1, 2, 16) if dry_run else (4, 16, 128)
    cases = _cases(32, 16) if dry_run else _cases(1024, 64)
    results = Results(
        out,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        dtype=str(dtype),
        tuning=[],
    )
    check_len = 64 if dry_run else 2048
    for case, (mask, causal) in cases.items():
        for name in BACKENDS:
            try:
                row = check(
                    name, case, mask, causal, (1, heads, check_len, dim), dtype, device, dry_run
                )
            except Exception as error:
                row = {"backend": name, "case": case, "skipped": _failure(error)}
            results.add("checks", row)
    peak = matmul_gflops(256 if dry_run else 8192, repeat, device, dtype) * 1e9
    results.data["matmul_tflops"] = peak / 1e12
    for length in lengths:
        qkv = [torch.randn(batch, heads, length, dim, device=device, dtype=dtype) for _ in range(3)]
        for case, (mask, causal) in cases.items():
            rows = _bench_case(
                qkv,
                case,
                mask,
                causal,
                dry_run,
                repeat,
                device,
                peak,
                over_budget=time.perf_counter() - start > budget,
            )
            for row in rows:
                results.add("bench", row)
        if length == lengths[0]:
            for config in DRY_RUN_TUNING if dry_run else TUNING:
                over_budget = time.perf_counter() - start > budget
                results.add(
                    "tuning", _tune(qkv, config, dry_run, repeat, device, peak, over_budget)
                )
    return results.data


def _tune(qkv, config, dry_run, repeat, device, peak, over_budget) -> dict:
    """The triton forward on causal attention with one launch config."""
    from mhsa.core.kernels.triton import triton_attention

    batch, heads, length, dim = qkv[0].shape
    row = {"config": list(config), "length": length}
    if over_budget:
        return {**row, "skipped": "time budget spent"}
    flops = 4 * dim * batch * heads * _allowed(None, True, length, device)
    try:
        call = lambda: triton_attention(*qkv, causal=True, blocks=config)  # noqa: E731
        seconds = best_times({"triton": call}, 1 if dry_run else repeat, device)["triton"]
    except Exception as error:
        return {**row, "skipped": _failure(error)}
    return {**row, "ms": seconds * 1e3, "of_matmul": flops / seconds / peak}


def _bench_case(qkv, case, mask, causal, dry_run, repeat, device, peak, over_budget):
    """One row per backend: forward ms, TFLOP/s and fraction of the matmul, timed
    interleaved; first_call_s is the first call (compilation included)."""
    batch, heads, length, dim = qkv[0].shape
    rows = {name: {"case": case, "backend": name, "length": length} for name in BACKENDS}
    if over_budget:
        for row in rows.values():
            row["skipped"] = "time budget spent"
        return list(rows.values())
    flops = 4 * dim * batch * heads * _allowed(mask, causal, length, device)
    calls = {}
    for name in BACKENDS:
        call = lambda b=name: _call(b, *qkv, mask, causal, dry_run)  # noqa: E731
        try:
            first = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rows[name]["first_call_s"] = time.perf_counter() - first
            calls[name] = call
        except Exception as error:
            rows[name]["skipped"] = _failure(error)
    repeat = 1 if dry_run else repeat
    try:
        seconds = best_times(calls, repeat, device) if calls else {}
    except Exception:  # one backend failed while timing: time the others alone
        seconds = {}
        for name, call in calls.items():
            try:
                seconds[name] = best_times({name: call}, repeat, device)[name]
            except Exception as error:
                rows[name]["skipped"] = _failure(error)
    for name, s in seconds.items():
        rows[name].update(ms=s * 1e3, tflops=flops / s / 1e12, of_matmul=flops / s / peak)
    return list(rows.values())


def goals(result: dict) -> list[str]:
    """The issue's two goals, where their rows were measured."""
    times = {(r["case"], r["backend"], r["length"]): r["ms"] for r in result["bench"] if "ms" in r}
    lines = []
    for case, backend, length in times:
        flex = times.get((case, "flex", length))
        if backend == "triton" and flex is not None:
            ratio = flex / times[(case, backend, length)]
            lines.append(
                f"  triton forward vs flex, {case}, L={length}: {ratio:.2f}x "
                f"(goal >= 0.8x: {'met' if ratio >= 0.8 else 'MISSED'})"
            )
    for row in result["bench"]:
        if (row["case"], row["backend"]) == ("causal", "triton") and "ms" in row:
            share = row["of_matmul"]
            verdict = "met" if share >= 0.6 else "MISSED"
            lines.append(
                f"  triton causal L={row['length']}: {share:.1%} of the matmul "
                f"(goal >= 60% at L=8192: {verdict})"
            )
    return lines


def summary(result: dict) -> str:
    lines = [
        f"{result['device']}, torch {result['torch']}, {result['dtype']}; "
        f"matmul {result.get('matmul_tflops', float('nan')):.2f} TFLOP/s",
        "checks (max |error| of out, dq, dk, dv against the float32 reference):",
    ]
    for row in result["checks"]:
        detail = row.get("skipped") or ", ".join(f"{e:.1e}" for e in row["max_errors"])
        lines.append(f"  {row['case']:<18} {row['backend']:<7} {detail}")
    lines.append("forward:")
    for row in result["bench"]:
        detail = row.get("skipped") or (
            f"{row['ms']:9.3f} ms  {row['tflops']:7.2f} TFLOP/s  "
            f"{row['of_matmul']:6.1%} of matmul  first call "
            f"{row['first_call_s']:.1f} s"
        )
        lines.append(f"  L={row['length']:<6} {row['case']:<18} {row['backend']:<7} {detail}")
    lines.append("triton forward launch configs, causal (BLOCK_M, BLOCK_N, warps, stages):")
    for row in result["tuning"]:
        detail = row.get("skipped") or f"{row['ms']:9.3f} ms  {row['of_matmul']:6.1%} of matmul"
        lines.append(f"  L={row['length']:<6} {str(tuple(row['config'])):<20} {detail}")
    lines.append("goals:")
    lines.extend(goals(result) or ["  not measured"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu.json")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--lengths", type=int, nargs="+", help="L = S values to benchmark")
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds after which no new benchmark case starts",
    )
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run, or on a GPU machine")
    out = Path(args.out) / "gpu.json"
    lengths = tuple(args.lengths) if args.lengths else None
    result = run(args.dry_run, args.repeat, out, lengths, args.budget)
    print(summary(result))


if __name__ == "__main__":
    main()
