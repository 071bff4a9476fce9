"""The GPU run of issue 44: correctness of sdpa, flex and triton on CUDA, their speed
against each other and a bf16 matmul, auto's choices, score functions, long context.

    python -m mhsa.benchmarks.gpu --out DIR            full run, about 6 minutes on an
                                                       H200 (fits 8; --budget 400 s)
    python -m mhsa.benchmarks.gpu --quick --out DIR    about 3 minutes (--budget 170 s)
    python -m mhsa.benchmarks.gpu --dry-run            anywhere: tiny shapes, float32,
                                                       CPU (triton in the interpreter,
                                                       flex eager), every code path
    python -m mhsa.benchmarks.gpu --report DIR/gpu.json   print and write gpu.md again

Sections, in order (bf16; B=4, H=16, D=128 unless said):
  checks  forward output and q/k/v gradients of sdpa, flex and triton against the
          float32 reference (on 1 batch entry and 2 heads), dense, causal,
          SlidingWindow(1024, 0), bigbird(64), at the bench's first L (8192)
  bench   per L (full 8192, 2048, 16384; quick 8192) and case: forward, then
          forward+backward, of sdpa, flex (compiled), triton and auto (which backend it
          picked), timed interleaved: ms, TFLOP/s, share of the matmul, time ratio to
          flex and to sdpa, auto's ratio to the best. After the first L (full run), the
          triton causal forward with each launch config in TUNING.
  scores  causal plain, + ALiBi, + Softcap(30) at L = 4096 and 16384 (quick 4096),
          forward and forward+backward, per backend and auto: ratio to plain causal of
          the same backend
  long    causal, window(1024, 0), bigbird(64) forward+backward through auto at
          L = 65536 and 131072 (quick 131072), B=1, H=32, D=128: time, picked backend,
          peak memory (max_memory_allocated after a reset, above the inputs), an OOM
          or any failure as the row's error
Forward is timed on inputs that require grad, so that forward and forward+backward
share each compiled graph (--forward-no-grad: on detached inputs, one more flex
compile per case and length); flops are 4 * D per allowed score entry, x3.5 with
backward. --sections runs some sections only (the matmul yardstick always runs).

DIR/gpu.json is rewritten after every row (a run cut short keeps its rows; each row
has at_s, seconds since the start); DIR/gpu.md (the README's table) after every
section. The summary ends with each goal of the issue, met or MISSED, and its numbers.
Each section has a deadline, a share of --budget: a case that would start after it is
recorded as skipped, so one run fits its slot and every section gets its turn.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
from pathlib import Path

import torch

from . import gpu_measure as measure
from . import gpu_sections as sections
from .gpu_report import goals, markdown, summary
from .gpu_sections import Plan
from .timing import matmul_gflops

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
SECTIONS = ("checks", "bench", "scores", "long")
BUDGET = {"full": 400.0, "quick": 170.0}
# the deadline of each section, as a share of the budget (cumulative)
SHARES = {
    "full": {"checks": 0.25, "bench": 0.6, "scores": 0.78, "long": 1.0},
    "quick": {"checks": 0.5, "bench": 0.65, "scores": 0.82, "long": 1.0},
}


def make_plan(
    dry_run: bool,
    quick: bool = False,
    repeat: int | None = None,
    lengths: tuple[int, ...] | None = None,
    budget: float | None = None,
    grad_forward: bool = True,
) -> Plan:
    """What a run measures: full or quick, on the GPU or (dry_run) on tiny CPU shapes;
    repeat, lengths (of the bench) and budget override the mode's defaults."""
    mode = "quick" if quick else "full"
    if dry_run:
        common = dict(
            device=torch.device("cpu"),
            dtype=torch.float32,
            shape=(1, 2, 16),
            cases=sections.cases(16, 16),
            lengths=(64,) if quick else (64, 32),
            tuning=() if quick else DRY_RUN_TUNING,
            score_lengths=(32,) if quick else (32, 64),
            long_lengths=(128,) if quick else (64, 128),
            long_shape=(1, 2, 16),
            repeat=1,
            long_repeat=1,
            matmul_size=256,
            min_sample=0.0,
        )
    else:
        common = dict(
            device=torch.device("cuda"),
            dtype=torch.bfloat16,
            shape=(4, 16, 128),
            cases=sections.cases(1024, 64),
            lengths=(8192,) if quick else (8192, 2048, 16384),
            tuning=() if quick else TUNING,
            score_lengths=(4096,) if quick else (4096, 16384),
            long_lengths=(131072,) if quick else (65536, 131072),
            long_shape=(1, 32, 128),
            repeat=10,
            long_repeat=3,
            matmul_size=8192,
            min_sample=1e-3,
        )
    if repeat is not None:
        common["repeat"] = repeat
    if lengths:
        common["lengths"] = tuple(lengths)
    return Plan(
        **common,
        budget=BUDGET[mode] if budget is None else budget,
        shares=SHARES[mode],
        grad_forward=grad_forward,
    )


def run(
    dry_run: bool,
    repeat: int | None = None,
    out: Path | None = None,
    lengths: tuple[int, ...] | None = None,
    budget: float | None = None,
    quick: bool = False,
    only: tuple[str, ...] = SECTIONS,
    grad_forward: bool = True,
) -> dict:
    """The run: checks, the matmul yardstick, then the sections in `only`; each section
    starts no new case after its share of `budget` seconds. Returns the result dict
    (also in out, with gpu.md next to it)."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    plan = make_plan(dry_run, quick, repeat, lengths, budget, grad_forward)
    device = plan.device
    results = measure.Results(
        out,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        triton=_triton_version(),
        dtype=str(plan.dtype),
        mode=("dry-run " if dry_run else "") + ("quick" if quick else "full"),
        shape=list(plan.shape),
        budget_s=plan.budget,
        grad_forward=plan.grad_forward,
        section_s={},
    )

    def deadline(section: str) -> float:
        return results.start + plan.budget * plan.shares[section]

    def finish(section: str, began: float) -> None:
        results.data["section_s"][section] = round(time.perf_counter() - began, 1)
        results.save()
        _write_markdown(out, results.data)

    if "checks" in only:
        began = time.perf_counter()
        sections.run_checks(plan, results, deadline("checks"))
        finish("checks", began)
    peak = matmul_gflops(plan.matmul_size, plan.repeat, device, plan.dtype) * 1e9
    results.data["matmul_tflops"] = peak / 1e12
    if "bench" in only:
        began = time.perf_counter()
        sections.run_bench(plan, results, deadline("bench"), peak)
        finish("bench", began)
    if "scores" in only:
        began = time.perf_counter()
        sections.run_scores(plan, results, deadline("scores"), peak)
        finish("scores", began)
    if "long" in only:
        began = time.perf_counter()
        sections.run_long(plan, results, deadline("long"))
        finish("long", began)
    results.data["total_s"] = round(results.elapsed(), 1)
    results.save()
    _write_markdown(out, results.data)
    return results.data


def _triton_version() -> str | None:
    try:  # without importing it (under --dry-run, TRITON_INTERPRET must come first)
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_markdown(out: Path | None, result: dict) -> None:
    if out is not None:
        path = out.with_name("gpu.md")
        tmp = path.with_name(".gpu.md.tmp")
        tmp.write_text(markdown(result))
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--quick", action="store_true", help="the ~3-minute subset")
    parser.add_argument(
        "--out", default=os.environ.get("OUT", "."), help="folder for gpu.json and gpu.md"
    )
    parser.add_argument("--repeat", type=int, help="timing samples (default 10; dry run 1)")
    parser.add_argument("--lengths", type=int, nargs="+", help="L = S values of the bench")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="run only these (default all; the matmul yardstick always runs)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds after which no new case starts, shared out among the sections "
        f"(default {BUDGET['full']:g}; quick {BUDGET['quick']:g})",
    )
    parser.add_argument(
        "--forward-no-grad",
        action="store_true",
        help="time the forward on inputs that do not require grad (inference); costs one "
        "more flex compile per case and length",
    )
    parser.add_argument(
        "--report", metavar="GPU_JSON", help="print the summary of a saved run, rewrite its gpu.md"
    )
    args = parser.parse_args(argv)
    if args.report:
        path = Path(args.report)
        result = json.loads(path.read_text())
        _write_markdown(path, result)
        print(summary(result))
        return
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run, or on a GPU machine")
    out = Path(args.out) / "gpu.json"
    lengths = tuple(args.lengths) if args.lengths else None
    result = run(
        args.dry_run,
        args.repeat,
        out,
        lengths,
        args.budget,
        args.quick,
        tuple(args.sections),
        not args.forward_no_grad,
    )
    print(summary(result))


__all__ = ["TUNING", "goals", "main", "make_plan", "markdown", "run", "summary"]

if __name__ == "__main__":
    main()
