"""The GPU check of the Triton paged kernel (issue 45): correctness against the float32
reference, and its speed against dense SDPA over the same keys already gathered.

    python -m mhsa.benchmarks.gpu_paged --out DIR          on a GPU, about 60 s
    python -m mhsa.benchmarks.gpu_paged --dry-run --out DIR anywhere: tiny shapes,
                                                           float32, CPU (Triton's
                                                           interpreter), every path

Sections, in order (bf16, H=32 query heads over H_kv=8, D=128, unless said):
  checks  odd shapes against the float32 paged reference by FlashAttention's rule
          (error <= 2 x the bf16 reference's + a floor): D 64, 80 (padded), 128; page
          5, 16, 64; decode, drafts (T=4), a prefill chunk (T=64); GQA 4 and 1; a
          window; ALiBi, Softcap; split-K and one partition
  bench   decode (T=1) at batch 1, 8, 64 and contexts 512..32768, pages 16 and 64:
          the kernel (ms, GB/s of K and V read, share of the bandwidth of a device
          copy measured in the run), mhsa.paged_attention through `auto` with its step
          planned (which backend it took), and SDPA over the keys gathered beforehand
          into contiguous (N, H_kv, S, D) tensors (each kv head's G query heads as
          query rows: the flash kernel), the kernel's time over SDPA's; each row also
          checks the first two sequences against the float32 reference. flash (the
          unfused tile engine, torch matmuls, that served CUDA before) at batch 8, contexts <= 4096
  tune    the kernel's launch (key block, warps, stages, keys per partition) at batch
          1 x 32768 and batch 64 x 4096, to choose kernels/triton/paged.py's defaults

DIR/gpu_paged.jsonl gets one JSON object per line, flushed as it is made (a run cut
short keeps its rows): a header (device, versions), the rows, a summary. A failure of
one row (an OOM included) is that row's `failure`, and the run goes on; rows that would
start after --budget seconds are recorded as skipped.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mhsa.core.kernels.paged import PagedCall, paged_reference
from mhsa.core.paged import paged_attention
from mhsa.core.paged_step import PagedStep
from mhsa.core.scores import ALiBi, Softcap

from .gpu_measure import JsonRows, failure, release
from .timing import best_times

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 8, 64)
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
PAGES = (16, 64)
TUNED = ("block_n", "num_warps", "num_stages", "split_keys")  # the launch fields swept
TUNING = (
    (64, 4, 2, 256),
    (32, 4, 2, 256),
    (128, 4, 2, 256),
    (64, 8, 2, 256),
    (64, 4, 3, 256),
    (64, 4, 2, 512),
    (64, 4, 2, 1024),
    (128, 8, 3, 512),
)


def make_call(
    batch: int,
    context: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    heads: tuple[int, int] = (HEADS, KV_HEADS),
    dims: tuple[int, int] = (HEAD_DIM, HEAD_DIM),
    q_len: int = 1,
    score=None,
    window: int | None = None,
) -> PagedCall:
    """batch sequences of `context` keys (the last sequence 7 shorter where it can be,
    so that lengths differ) in shuffled pages of a pool, q of q_len new queries each."""
    pages = math.ceil(context / block_size)
    num_blocks = batch * pages
    (num_heads, num_kv_heads), (head_dim, value_dim) = heads, dims
    k_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn(
        num_blocks, block_size, num_kv_heads, value_dim, device=device, dtype=dtype
    )
    table = torch.randperm(num_blocks, device=device).view(batch, pages)
    lengths = [context] * batch
    if batch > 1 and context > 7 + q_len:
        lengths[-1] = context - 7
    q = torch.randn(batch, num_heads, q_len, head_dim, device=device, dtype=dtype)
    return PagedCall(q, k_pool, v_pool, table, lengths, head_dim**-0.5, score, window)


def first(call: PagedCall, count: int) -> PagedCall:
    """The call on its first `count` sequences."""
    return call._replace(
        q=call.q[:count], block_table=call.block_table[:count], lengths=call.lengths[:count]
    )


def check(call: PagedCall, run: Callable[[PagedCall], torch.Tensor]) -> dict:
    """run(call)'s error against the float32 reference, the same-dtype reference's, and
    whether FlashAttention's rule holds (at most twice it plus a floor)."""
    as32 = call._replace(q=call.q.float(), k_pool=call.k_pool.float(), v_pool=call.v_pool.float())
    golden = paged_reference(as32)
    got = run(call).float()
    error = float((got - golden).abs().max())
    naive = float((paged_reference(call).float() - golden).abs().max())
    floor = max(2 * torch.finfo(call.q.dtype).eps, 1e-5)
    return {
        "max_error": error,
        "reference_error": naive,
        "ok": bool(error <= 2 * naive + floor) and not bool(got.isnan().any()),
    }


def timed(fns: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """Milliseconds of each function: triton's do_bench on a GPU (median, L2 cleared
    between runs), else the best of 2."""
    if device.type != "cuda":
        return {name: 1e3 * s for name, s in best_times(fns, 2, device).items()}
    from triton.testing import do_bench

    return {
        name: float(do_bench(fn, warmup=5, rep=25, return_mode="median"))
        for name, fn in fns.items()
    }


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write), the yardstick of the rows."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 29, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    ms = timed({"copy": lambda: y.copy_(x)}, device)["copy"]
    return 2 * x.numel() * x.element_size() / ms / 1e6


def _kernel():
    from mhsa.core.kernels.triton import paged  # imports triton

    return paged


def run_checks(rows: JsonRows, device: torch.device, dtype: torch.dtype, dry: bool) -> None:
    kernel = _kernel()
    d = 16 if dry else HEAD_DIM
    slopes = torch.tensor([2 ** -(i + 1) for i in range(HEADS)], device=device)
    cases = {
        "decode D128 page 16": dict(context=1000, block_size=16),
        "decode D64 page 64": dict(context=777, block_size=64, dims=(64, 64)),
        "decode D80 page 5": dict(context=333, block_size=5, dims=(80, 80)),
        "drafts T4 window 100": dict(context=900, block_size=16, q_len=4, window=100),
        "prefill chunk T64 MQA": dict(context=500, block_size=16, q_len=64, heads=(8, 1)),
        "ALiBi + Softcap": dict(
            context=600, block_size=16, score=ALiBi(slopes).then(Softcap(20.0))
        ),
        "long, split-K": dict(context=20000, block_size=16),
    }
    for name, options in cases.items():
        options = dict(options)
        if dry:  # tiny: the interpreter runs each program in numpy
            options["context"] = min(options["context"], 70)
            options["dims"] = (d, d)
            options["heads"] = (4, 1) if "MQA" in name else (4, 2)
            options["q_len"] = min(options.get("q_len", 1), 8)
            if options.get("score") is not None:
                options["score"] = ALiBi(slopes[:4]).then(Softcap(20.0))
        for split_keys in (None, 32 if dry else 1 << 30):  # (default: split on a GPU)
            row = {"section": "checks", "case": name, "split_keys": split_keys or "default"}
            try:
                call = make_call(2, device=device, dtype=dtype, **options)
                launch = kernel.prepare_paged_launch(call, split_keys)
                row["splits"] = launch.splits
                row |= check(
                    call, lambda c, launch=launch: kernel.triton_paged_attention(c, launch)
                )
            except Exception as error:  # noqa: BLE001 (a GPU run records every failure)
                row["failure"] = failure(error)
            rows.write(row)
            release()


def bench_row(
    batch: int, context: int, block_size: int, device: torch.device, dtype, bandwidth: float
) -> dict:
    kernel = _kernel()
    call = make_call(batch, context, block_size, device, dtype)
    launch = kernel.prepare_paged_launch(call)
    step = PagedStep(
        call.block_table, call.lengths, num_blocks=call.k_pool.shape[0], block_size=block_size
    )
    row = {"splits": launch.splits} | check(first(call, 2), kernel.triton_paged_attention)
    # SDPA over keys gathered beforehand (as a contiguous cache holds them): each kv
    # head's G query heads as G query rows of one head, which the flash kernel serves
    group = HEADS // KV_HEADS
    index = call.block_table.reshape(-1)
    keys = call.k_pool.index_select(0, index).view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context]
    values = call.v_pool.index_select(0, index).view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context]
    keys, values = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    grouped_q = call.q.reshape(batch, KV_HEADS, group, HEAD_DIM)
    fns = {
        "kernel": lambda: kernel.triton_paged_attention(call, launch),
        "auto": lambda: paged_attention(call.q, call.k_pool, call.v_pool, step),
        "sdpa": lambda: F.scaled_dot_product_attention(grouped_q, keys, values),
    }
    if batch == 8 and context <= 4096:
        fns["flash"] = lambda: paged_attention(
            call.q, call.k_pool, call.v_pool, step, backend="flash"
        )
    with torch.no_grad():
        ms = timed(fns, device)
    read = 2 * sum(call.lengths) * KV_HEADS * HEAD_DIM * call.k_pool.element_size()
    row["auto_backend"] = [plan.backend.name for plan in step.plans.values()]
    row |= {f"{name}_ms": round(value, 4) for name, value in ms.items()}
    row["kernel_GBps"] = round(read / ms["kernel"] / 1e6, 1)
    row["kernel_share_of_copy"] = round(row["kernel_GBps"] / bandwidth, 3)
    row["kernel_over_sdpa"] = round(ms["kernel"] / ms["sdpa"], 3)
    return row


def run_bench(rows: JsonRows, device, dtype, dry: bool, deadline: float, bandwidth: float) -> None:
    batches, contexts = ((1, 3), (40, 100)) if dry else (BATCHES, CONTEXTS)
    pages = (5, 16) if dry else PAGES
    for batch in batches:
        for context in contexts:
            for block_size in pages:
                row = {"section": "bench", "batch": batch, "context": context, "page": block_size}
                if time.perf_counter() > deadline:
                    rows.write(row | {"skipped": "past the budget"})
                    continue
                try:
                    row |= bench_row(batch, context, block_size, device, dtype, bandwidth)
                except Exception as error:  # noqa: BLE001 (a GPU run records every failure)
                    row["failure"] = failure(error)
                rows.write(row)
                release()


def run_tune(rows: JsonRows, device, dtype, dry: bool, deadline: float) -> None:
    kernel = _kernel()
    shapes = ((1, 100), (3, 40)) if dry else ((1, 32768), (64, 4096))
    tuning = ((16, 4, 1, 32), (16, 4, 1, 64)) if dry else TUNING
    for batch, context in shapes:
        try:
            call = make_call(batch, context, 16, device, dtype)
            base = kernel.prepare_paged_launch(call)
        except Exception as error:  # noqa: BLE001
            rows.write({"section": "tune", "batch": batch, "failure": failure(error)})
            continue
        for values in tuning:
            choice = dict(zip(TUNED, values, strict=True))
            row = {"section": "tune", "batch": batch, "context": context, **choice}
            if time.perf_counter() > deadline:
                rows.write(row | {"skipped": "past the budget"})
                continue
            try:
                splits = max(1, math.ceil(max(call.lengths) / choice["split_keys"]))
                launch = base._replace(**choice, splits=splits)
                ok = check(first(call, 2), lambda c, launch=launch: _first_two(kernel, c, launch))
                fn = functools.partial(kernel.triton_paged_attention, call, launch)
                with torch.no_grad():
                    ms = timed({"kernel": fn}, device)
                row |= {"splits": splits, "ms": round(ms["kernel"], 4), "ok": ok["ok"]}
            except Exception as error:  # noqa: BLE001
                row["failure"] = failure(error)
            rows.write(row)
        release()


def _first_two(kernel, call: PagedCall, launch):
    """The kernel on a call's first sequences with a launch made for the whole call."""
    return kernel.triton_paged_attention(call, launch._replace(lens=launch.lens[: call.q.shape[0]]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_paged.jsonl")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--budget", type=float, default=80.0, help="seconds (default 80)")
    parser.add_argument("--sections", default="checks,bench,tune")
    args = parser.parse_args(argv)
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU, or use --dry-run")
    if dry:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    dtype = torch.float32 if dry else torch.bfloat16
    rows = JsonRows(args.out, "gpu_paged.jsonl")
    start = time.perf_counter()
    header = {"section": "header", "device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        header["name"] = torch.cuda.get_device_name(device)
    for package in ("torch", "triton"):
        try:
            header[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            header[package] = None
    header["copy_GBps"] = round(copy_bandwidth(device), 1)
    rows.write(header)
    sections = args.sections.split(",")
    if "checks" in sections:
        run_checks(rows, device, dtype, dry)
    if "bench" in sections:
        deadline = start + 0.8 * args.budget
        run_bench(rows, device, dtype, dry, deadline, header["copy_GBps"])
    if "tune" in sections:
        run_tune(rows, device, dtype, dry, start + args.budget)
    failed = [r for r in rows.rows if "failure" in r or r.get("ok") is False]
    bench = [r for r in rows.rows if r.get("section") == "bench" and "kernel_ms" in r]
    rows.write(
        {
            "section": "summary",
            "rows": len(rows.rows),
            "failed": len(failed),
            "kernel_over_sdpa_median": _median([r["kernel_over_sdpa"] for r in bench]),
            "share_of_copy_max": max((r["kernel_share_of_copy"] for r in bench), default=None),
            "auto_took_triton": all(r["auto_backend"] == ["triton"] for r in bench)
            if bench
            else None,
            "seconds": round(time.perf_counter() - start, 1),
        }
    )
    return 1 if failed else 0


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


if __name__ == "__main__":
    raise SystemExit(main())
