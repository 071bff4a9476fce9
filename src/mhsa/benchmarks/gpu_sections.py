"""The sections of `python -m mhsa.benchmarks.gpu`, in the order they run: checks,
bench (with the triton launch-config sweep after its first length), scores, long.

Each section takes the run's Plan, its Results and a deadline (perf_counter seconds):
a unit of work (a check, one case at one length, one score length, one long-context
case) that would start past the deadline is recorded as skipped instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mhsa.core.masks import SlidingWindow
from mhsa.core.masks.presets import bigbird
from mhsa.core.scores import ALiBi, Softcap

from . import gpu_measure as measure

BACKENDS = ("sdpa", "flex", "triton")
TIMED = (*BACKENDS, "auto")
PASSES = ("fwd", "fwd+bwd")
SKIPPED = "time budget spent"
SOFTCAP = 30.0


@dataclass(frozen=True)
class Plan:
    """What one run measures (full, quick, or either on tiny CPU shapes)."""

    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, int, int]  # (batch, heads, head_dim) of checks, bench and scores
    cases: dict  # name -> (mask, causal)
    lengths: tuple[int, ...]  # bench; the first one also gets the checks and the sweep
    tuning: tuple[tuple[int, int, int, int], ...]
    score_lengths: tuple[int, ...]
    long_lengths: tuple[int, ...]
    long_shape: tuple[int, int, int]
    repeat: int
    long_repeat: int
    matmul_size: int
    min_sample: float  # seconds: a timing sample repeats a call to last this long
    budget: float
    shares: dict = field(default_factory=dict)  # section -> its deadline, share of budget
    grad_forward: bool = True  # forward timed on inputs that require grad

    @property
    def dry_run(self) -> bool:
        return self.device.type == "cpu"


def cases(window: int, block: int) -> dict:
    return {
        "dense": (None, False),
        "causal": (None, True),
        f"window({window}, 0)": (SlidingWindow(window, 0), False),
        f"bigbird({block})": (bigbird(block), False),
    }


def _inputs(plan: Plan, batch: int, heads: int, length: int, dim: int):
    """q, k, v that require grad, and the gradient of the output."""
    make = lambda: torch.randn(  # noqa: E731
        batch, heads, length, dim, device=plan.device, dtype=plan.dtype
    )
    qkv = tuple(make().requires_grad_() for _ in range(3))
    return qkv, make()


def run_checks(plan: Plan, results, deadline: float) -> None:
    """At the bench's first length and shape: flex's graphs are compiled once for both."""
    batch, heads, dim = plan.shape
    shape = (batch, heads, plan.lengths[0], dim)
    for case, (mask, causal) in plan.cases.items():
        for name in BACKENDS:
            row = {"backend": name, "case": case}
            if time.perf_counter() > deadline:
                row["skipped"] = SKIPPED
            else:
                try:
                    row = measure.check(
                        name, case, mask, causal, shape, plan.dtype, plan.device, plan.dry_run
                    )
                except Exception as error:
                    row["skipped"] = measure.failure(error)
                    measure.release()
            results.add("checks", row)


def run_bench(plan: Plan, results, deadline: float, peak: float) -> None:
    """Per length and case: forward, then forward+backward, of every backend and auto,
    timed interleaved; the triton launch-config sweep after the first length."""
    batch, heads, dim = plan.shape
    for length in plan.lengths:
        qkv, grad = _inputs(plan, batch, heads, length, dim)
        for case, (mask, causal) in plan.cases.items():
            if time.perf_counter() > deadline:
                rows = [
                    {"case": case, "length": length, "pass": p, "backend": b, "skipped": SKIPPED}
                    for p in PASSES
                    for b in TIMED
                ]
            else:
                rows = _bench_case(plan, qkv, grad, case, mask, causal, peak)
            for row in rows:
                results.add("bench", row)
        if length == plan.lengths[0]:
            for config in plan.tuning:
                over = time.perf_counter() > deadline
                results.add("tuning", _tune(plan, qkv, config, peak, over))
        del qkv, grad
        measure.release()


def _bench_case(plan: Plan, qkv, grad, case, mask, causal, peak) -> list[dict]:
    length = qkv[0].shape[2]
    try:
        allowed = measure.allowed_entries(mask, causal, length, plan.device)
    except Exception:  # no flop count: times only
        allowed = None
    rows = []
    for p in PASSES:
        fns = {
            name: measure.forward_call(
                name, qkv, mask, causal, None, plan.dry_run, plan.grad_forward
            )
            if p == "fwd"
            else measure.train_call(name, qkv, grad, mask, causal, None, plan.dry_run)
            for name in TIMED
        }
        timed = measure.time_group(fns, plan.repeat, plan.device, plan.min_sample)
        flop = None if allowed is None else measure.flops(allowed, qkv[0].shape, p != "fwd")
        group = [
            {"case": case, "length": length, "pass": p, "backend": name, **timed[name]}
            for name in TIMED
        ]
        rows += compare(group, flop, peak)
    return rows


def compare(group: list[dict], flop: float | None, peak: float) -> list[dict]:
    """Rows of one interleaved group, with TFLOP/s, share of the matmul and the time
    ratios vs_flex and vs_sdpa (ms / their ms: below 1 is faster), and for auto
    vs_best (ms / the fastest row's)."""
    times = {row["backend"]: row["ms"] for row in group if "ms" in row}
    for row in group:
        if "ms" not in row:
            continue
        if flop is not None:
            row["tflops"] = flop / (row["ms"] * 1e-3) / 1e12
            row["of_matmul"] = row["tflops"] * 1e12 / peak
        for peer in ("flex", "sdpa"):
            if peer in times:
                row[f"vs_{peer}"] = row["ms"] / times[peer]
        if row["backend"] == "auto":
            row["vs_best"] = row["ms"] / min(times.values())
    return group


def _tune(plan: Plan, qkv, config, peak: float, over_budget: bool) -> dict:
    """The triton forward on causal attention with one launch config (BLOCK_M,
    BLOCK_N, num_warps, num_stages), to choose the kernels' defaults from."""
    length = qkv[0].shape[2]
    row = {"config": list(config), "length": length}
    if over_budget:
        return {**row, "skipped": SKIPPED}
    q, k, v = (t.detach() for t in qkv)

    def call():
        from mhsa.core.kernels.triton import triton_attention  # imports triton

        return triton_attention(q, k, v, causal=True, blocks=config)

    timed = measure.time_group({"triton": call}, plan.repeat, plan.device, plan.min_sample)
    row.update(timed["triton"])
    if "ms" in row:
        flop = measure.flops(length * (length + 1) // 2, q.shape, backward=False)
        row["of_matmul"] = flop / (row["ms"] * 1e-3) / peak
    return row


def score_functions(heads: int, device) -> dict:
    """The score functions of the section: none (plain causal), ALiBi, Softcap(30)."""
    from mhsa.nn.positional import alibi_slopes

    return {
        "none": None,
        "alibi": ALiBi(alibi_slopes(heads).to(device)),
        f"softcap({SOFTCAP:g})": Softcap(SOFTCAP),
    }


def run_scores(plan: Plan, results, deadline: float, peak: float) -> None:
    """Causal attention with each score function, forward and forward+backward, per
    backend and auto, timed interleaved with plain causal; vs_plain is the time ratio
    to plain causal of the same backend and pass."""
    batch, heads, dim = plan.shape
    scores = score_functions(heads, plan.device)
    for length in plan.score_lengths:
        if time.perf_counter() > deadline:
            for p in PASSES:
                for score in scores:
                    for name in TIMED:
                        row = {"score": score, "length": length, "pass": p, "backend": name}
                        results.add("scores", {**row, "skipped": SKIPPED})
            continue
        qkv, grad = _inputs(plan, batch, heads, length, dim)
        flop = length * (length + 1) // 2
        for p in PASSES:
            fns = {}
            for score, function in scores.items():
                for name in TIMED:
                    fns[(score, name)] = (
                        measure.forward_call(
                            name, qkv, None, True, function, plan.dry_run, plan.grad_forward
                        )
                        if p == "fwd"
                        else measure.train_call(name, qkv, grad, None, True, function, plan.dry_run)
                    )
            automatic = {(score, "auto") for score in scores}
            timed = measure.time_group(fns, plan.repeat, plan.device, plan.min_sample, automatic)
            for (score, name), row in timed.items():
                row = {"score": score, "length": length, "pass": p, "backend": name, **row}
                if "ms" in row:
                    work = measure.flops(flop, qkv[0].shape, p != "fwd")
                    row["of_matmul"] = work / (row["ms"] * 1e-3) / peak
                    plain = timed[("none", name)].get("ms")
                    if plain:
                        row["vs_plain"] = row["ms"] / plain
                results.add("scores", row)
        del qkv, grad
        measure.release()


def run_long(plan: Plan, results, deadline: float) -> None:
    """Forward+backward through auto at long lengths: time, and peak memory
    (torch.cuda.max_memory_allocated after a reset) above what was allocated before
    the call; an OOM or any failure becomes the row's error."""
    batch, heads, dim = plan.long_shape
    long_cases = {name: c for name, c in plan.cases.items() if name != "dense"}
    for length in plan.long_lengths:
        for case, (mask, causal) in long_cases.items():
            row = {"case": case, "length": length, "backend": "auto"}
            row["shape"] = [batch, heads, length, dim]
            if time.perf_counter() > deadline:
                results.add("long", {**row, "skipped": SKIPPED})
                continue
            try:
                _long_case(plan, mask, causal, (batch, heads, length, dim), row)
            except Exception as error:  # the row keeps what was measured before
                row["error"] = measure.failure(error)
            measure.release()
            results.add("long", row)


def _long_case(plan: Plan, mask, causal, shape, row: dict) -> None:
    """Fill row as the measurements come (a failure keeps the ones before it)."""
    batch, heads, length, dim = shape
    cuda = plan.device.type == "cuda"
    if cuda:
        before = torch.cuda.memory_allocated(plan.device)
    qkv, grad = _inputs(plan, batch, heads, length, dim)
    if cuda:
        row["inputs_gib"] = (torch.cuda.memory_allocated(plan.device) - before) / 2**30
    step = measure.train_call("auto", qkv, grad, mask, causal, None, plan.dry_run)

    def peak_of(call) -> float | None:
        """Peak GiB of one call above what was allocated before it (None on CPU)."""
        if not cuda:
            call()
            return None
        base = torch.cuda.memory_allocated(plan.device)
        torch.cuda.reset_peak_memory_stats(plan.device)
        call()
        torch.cuda.synchronize(plan.device)
        return (torch.cuda.max_memory_allocated(plan.device) - base) / 2**30

    def first() -> None:
        chosen: list[str] = []
        try:
            measure.observe_backend(step, chosen)
        finally:
            row["picked"] = chosen[-1] if chosen else None

    start = time.perf_counter()
    # the first call builds the block masks (and compiles): its peak counts too
    row["peak_first_gib"] = peak_of(first)
    row["first_call_s"] = time.perf_counter() - start
    row["peak_gib"] = peak_of(step)
    seconds = []
    for _ in range(plan.long_repeat):
        start = time.perf_counter()
        step()
        measure.sync(plan.device)
        seconds.append(time.perf_counter() - start)
    row["ms"] = min(seconds) * 1e3
    try:
        allowed = measure.allowed_entries(mask, causal, length, plan.device)
    except Exception:  # no flop count: the time stands
        return
    row["tflops"] = measure.flops(allowed, shape, True) / (row["ms"] * 1e-3) / 1e12
