"""The GPU check: correctness of sdpa, flex and triton on CUDA, then their speed.

    python -m mhsa.benchmarks.gpu --out DIR        on a CUDA machine (bf16)
    python -m mhsa.benchmarks.gpu --dry-run        anywhere: tiny shapes, float32, on
                                                   CPU (triton in the interpreter, flex
                                                   eager), to keep the script working

Checks: forward output and q/k/v gradients of every backend that serves a case,
against the float32 reference of the same inputs. Benchmark: B=4, H=16, D=128,
L = S in {2048, 8192, 16384}, cases dense, causal, SlidingWindow(1024, 0) and
bigbird(64); forward time and TFLOP/s (4 * D per allowed score entry; backward
counted as 2.5x forward), each as a fraction of a bf16 matmul measured in the same
run. Results go to DIR/gpu.json; a summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import mhsa
from mhsa.backends.common import combined_mask
from mhsa.masks import SlidingWindow
from mhsa.masks.presets import bigbird

from .timing import best_times, matmul_gflops

BACKENDS = ("sdpa", "flex", "triton")


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
        from mhsa.backends.flex import flex_forward

        return flex_forward(q, k, v, mask=mask, causal=causal, scale=q.shape[-1] ** -0.5,
                            compiled=False)[0]  # fmt: skip
    return mhsa.attention(q, k, v, mask, causal=causal, backend=name)


def check(name: str, case: str, mask, causal: bool, shape: tuple, dtype, device, dry_run: bool):
    """Max errors of out, dq, dk, dv against the float32 reference on the same inputs."""
    batch, heads, length, dim = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=dtype)
               for _ in range(3))  # fmt: skip
    grad = torch.randn_like(q)
    backward = name != "flex" or not dry_run  # eager flex has no backward on CPU
    results = {}
    for label, inputs, call in (
        ("ref", [t.float() for t in (q, k, v)], lambda *t: mhsa.attention(
            *t, mask, causal=causal, backend="reference")),
        ("ours", [q, k, v], lambda *t: _call(name, *t, mask, causal, dry_run)),
    ):  # fmt: skip
        inputs = [t.detach().requires_grad_(backward) for t in inputs]
        out = call(*inputs)
        if backward:
            out.backward(grad.to(out.dtype))
        results[label] = [out.float()] + ([t.grad.float() for t in inputs] if backward else [])
    pairs = zip(results["ours"], results["ref"], strict=True)
    errors = [float((a - b).detach().abs().max()) for a, b in pairs]
    return {"backend": name, "case": case, "shape": list(shape), "max_errors": errors}


def run(dry_run: bool, repeat: int = 10) -> dict:
    device = torch.device("cpu" if dry_run else "cuda")
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.float32 if dry_run else torch.bfloat16
    lengths = (64, 128) if dry_run else (2048, 8192, 16384)
    batch, heads, dim = (1, 2, 16) if dry_run else (4, 16, 128)
    cases = _cases(32, 16) if dry_run else _cases(1024, 64)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "dtype": str(dtype), "checks": [],
              "bench": []}  # fmt: skip
    check_len = 64 if dry_run else 2048
    for case, (mask, causal) in cases.items():
        for name in BACKENDS:
            try:
                result["checks"].append(check(name, case, mask, causal,
                                              (1, heads, check_len, dim), dtype, device,
                                              dry_run))  # fmt: skip
            except (ValueError, ImportError, RuntimeError) as error:
                result["checks"].append({"backend": name, "case": case, "skipped": str(error)})
    peak = matmul_gflops(256 if dry_run else 8192, repeat, device, dtype) * 1e9
    result["matmul_tflops"] = peak / 1e12
    for length in lengths:
        qkv = [torch.randn(batch, heads, length, dim, device=device, dtype=dtype)
               for _ in range(3)]  # fmt: skip
        for case, (mask, causal) in cases.items():
            flops = 4 * dim * batch * heads * _allowed(mask, causal, length, device)
            for backend in BACKENDS:
                row = {"case": case, "backend": backend, "length": length}
                try:
                    seconds = best_times(
                        {backend: lambda b=backend, m=mask, c=causal, t=qkv:
                            _call(b, *t, m, c, dry_run)},
                        1 if dry_run else repeat, device,
                    )[backend]  # fmt: skip
                    row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                               of_matmul=flops / seconds / peak)  # fmt: skip
                except (ValueError, ImportError, RuntimeError) as error:
                    row["skipped"] = str(error)
                result["bench"].append(row)
    return result


def summary(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, {result['dtype']}; "
             f"matmul {result['matmul_tflops']:.2f} TFLOP/s", "checks (max |error| of "
             "out, dq, dk, dv against the float32 reference):"]  # fmt: skip
    for row in result["checks"]:
        detail = row.get("skipped") or ", ".join(f"{e:.1e}" for e in row["max_errors"])
        lines.append(f"  {row['case']:<18} {row['backend']:<7} {detail}")
    lines.append("forward:")
    for row in result["bench"]:
        detail = row.get("skipped") or (f"{row['ms']:9.3f} ms  {row['tflops']:7.2f} TFLOP/s  "
                                        f"{row['of_matmul']:6.1%} of matmul")  # fmt: skip
        lines.append(f"  L={row['length']:<6} {row['case']:<18} {row['backend']:<7} {detail}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu.json")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run, or on a GPU machine")
    result = run(args.dry_run, args.repeat)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(result, indent=2))
    print(summary(result))


if __name__ == "__main__":
    main()
