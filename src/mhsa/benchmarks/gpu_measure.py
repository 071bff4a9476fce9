"""How `python -m mhsa.benchmarks.gpu` measures: the calls it times, the interleaved
timer, the correctness check, flop counts, and the row-by-row JSON file.

Every call goes through `attend` (mhsa.attention with a named backend; under --dry-run
flex runs eagerly, FlexAttention's CPU path). A failure of one backend, an OOM
included, becomes that row's `skipped` reason and the run goes on.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from mhsa.core.attention import attention
from mhsa.core.masks import Causal, with_causal

BACKWARD_FLOPS = 2.5  # a backward is 2.5 forwards (5 matmuls against 2): fwd+bwd is 3.5x
NO_EAGER_BACKWARD = "eager FlexAttention has no backward on CPU (dry run: forward only)"


def failure(error: BaseException) -> str:
    """A one-line reason: a GPU run is expensive, so any failure of one backend is
    recorded and the others go on."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release() -> None:
    """Give back what a failed (or finished) call left allocated."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attend(name: str, q, k, v, mask, causal: bool, score, dry_run: bool):
    """mhsa.attention with backend `name` ("auto" too); under --dry-run flex runs eagerly
    (the backend serves CUDA only), on inputs that do not require grad (FlexAttention
    has no backward on CPU)."""
    if name == "flex" and dry_run:
        from mhsa.core.backends.flex import flex_forward

        q, k, v = (t.detach() for t in (q, k, v))
        scale = q.shape[-1] ** -0.5
        with warnings.catch_warnings():  # "flex_attention called without torch.compile()"
            warnings.simplefilter("ignore", UserWarning)
            return flex_forward(
                q, k, v, mask=mask, causal=causal, scale=scale, score=score, compiled=False
            )[0]
    return attention(q, k, v, mask, causal=causal, score=score, backend=name)


def forward_call(name, qkv, mask, causal, score, dry_run, grad=True) -> Callable[[], object]:
    """The forward, by default on inputs that require grad (as in training): forward and
    forward+backward then share one compiled flex graph per shape and mask, which
    halves the run's compile time, and the kernels do the same work (flex writes its
    lse either way: the backend asks for it). grad=False: on detached inputs
    (inference), one more compile per flex case."""
    if not grad:
        qkv = tuple(t.detach() for t in qkv)
    return lambda: attend(name, *qkv, mask, causal, score, dry_run)


def train_call(name, qkv, grad, mask, causal, score, dry_run) -> Callable[[], object]:
    """Forward and backward to q, k and v (torch.autograd.grad: nothing accumulates)."""
    if name == "flex" and dry_run:

        def no_backward():
            raise NotImplementedError(NO_EAGER_BACKWARD)

        return no_backward

    def step():
        out = attend(name, *qkv, mask, causal, score, dry_run)
        return torch.autograd.grad(out, qkv, grad)

    return step


def observe_backend(
    fn: Callable[[], object], chosen: list | None = None
) -> tuple[object, str | None]:
    """Run fn once and say which backend `auto` chose inside it, as mhsa.attention
    saw it (its select, observed for this one call, then restored). The names chosen
    are also appended to `chosen`, so that a caller learns them when fn raises (an OOM
    inside the chosen backend)."""
    import mhsa.core.attention as core

    chosen = [] if chosen is None else chosen
    original = core.select

    def observed(spec, requested):
        backend = original(spec, requested)
        chosen.append(backend.name)
        return backend

    core.select = observed
    try:
        result = fn()
    finally:
        core.select = original
    return result, (chosen[-1] if chosen else None)


def time_group(
    fns: dict[str, Callable[[], object]],
    repeat: int,
    device: torch.device,
    min_sample: float = 1e-3,
    observe: Collection = ("auto",),
) -> dict[str, dict]:
    """Per function: first_call_s (compilation included), then ms (best) and ms_median
    of `repeat` samples taken interleaved (drift hits all alike); a sample runs the
    function n times, n chosen from one warm call so that it lasts >= min_sample (no
    warm call when min_sample is 0; with repeat 0 only the first call, to compile
    ahead of a timed run). host_ms: the least time the calls took to return,
    before the device caught up; near ms, the host (Python, launches, or a sync inside
    the call) is what the call waits on, not the device. The rows of the keys in
    `observe` say which backend auto picked.
    A function that fails gets `skipped` and leaves the rotation."""
    rows: dict[str, dict] = {name: {} for name in fns}
    live: dict[str, tuple[Callable, int]] = {}
    for name, fn in fns.items():
        try:
            start = time.perf_counter()
            if name in observe:
                chosen: list[str] = []
                try:
                    observe_backend(fn, chosen)
                finally:
                    rows[name]["picked"] = chosen[-1] if chosen else None
            else:
                fn()
            sync(device)
            rows[name]["first_call_s"] = time.perf_counter() - start
            n = 1
            if min_sample > 0 and repeat > 0:
                start = time.perf_counter()
                fn()
                sync(device)
                warm = max(time.perf_counter() - start, 1e-9)
                n = max(1, min(100, math.ceil(min_sample / warm)))
            live[name] = (fn, n)
        except Exception as error:  # OOM, compile errors, "cannot serve this call"
            rows[name]["skipped"] = failure(error)
        if name not in live:  # (after the except: its traceback no longer holds memory)
            release()
    samples: dict[str, list[float]] = {name: [] for name in live}
    host: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(repeat):
        for name, (fn, n) in list(live.items()):
            try:
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                host[name].append((time.perf_counter() - start) / n)
                sync(device)
                samples[name].append((time.perf_counter() - start) / n)
            except Exception as error:
                rows[name]["skipped"] = failure(error)
                del live[name]
            if name not in live:
                release()
    for name, (_, n) in live.items():
        if not samples[name]:  # (repeat 0)
            continue
        ordered = sorted(samples[name])
        rows[name].update(
            ms=ordered[0] * 1e3,
            ms_median=ordered[len(ordered) // 2] * 1e3,
            host_ms=min(host[name]) * 1e3,
            calls_per_sample=n,
        )
    return rows


def allowed_entries(
    mask, causal: bool, length: int, device: torch.device, chunk_entries: int = 2**28
) -> int:
    """How many (query, key) pairs may attend in an L = S call, counted over chunks of
    rows of about chunk_entries entries (no L x L mask at once: this runs at L = 131072
    too)."""
    pattern = with_causal(mask, causal)
    if pattern is None:
        return length * length
    if isinstance(pattern, Causal):
        return length * (length + 1) // 2
    chunk = max(1, chunk_entries // length)
    cols = torch.arange(length, device=device).view(1, -1)
    total = 0
    for start in range(0, length, chunk):
        rows = torch.arange(start, min(length, start + chunk), device=device).view(-1, 1)
        allowed = pattern.allowed(rows, cols, length, length)
        allowed = allowed.reshape(-1, *allowed.shape[-2:])[0]  # one batch entry
        total += int(allowed.expand(rows.shape[0], length).sum())
    return total


def flops(allowed: int, shape: tuple, backward: bool) -> float:
    """4 * D flops per allowed entry and (batch, head) forward; x3.5 with backward."""
    batch, heads, _, dim = shape
    forward = 4.0 * dim * batch * heads * allowed
    return forward * (1 + BACKWARD_FLOPS) if backward else forward


def check(name, case, mask, causal, shape, dtype, device, dry_run, heads=(1, 2)) -> dict:
    """Max errors of out, dq, dk, dv against the float32 reference on the same inputs.

    The backend runs at the bench's full shape (so that compiled graphs are shared with
    the bench); the reference, on the first heads[0] batch entries and heads[1] heads
    (attention is independent per batch entry and head), so that it fits at L = 8192."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    backward = name != "flex" or not dry_run  # eager flex has no backward on CPU
    part = (slice(0, heads[0]), slice(0, heads[1]))
    results = {}
    for label, inputs, backend, grad_out in (
        ("ref", [t[part].float() for t in (q, k, v)], "reference", grad[part].float()),
        ("ours", [q, k, v], name, grad),
    ):
        inputs = [t.detach().requires_grad_(backward) for t in inputs]
        out = attend(backend, *inputs, mask, causal, None, dry_run)
        grads = torch.autograd.grad(out, inputs, grad_out) if backward else ()
        results[label] = [t[part].detach().float() for t in (out, *grads)]
    pairs = zip(results["ours"], results["ref"], strict=True)
    errors = [float((a - b).abs().max()) for a, b in pairs]
    return {"backend": name, "case": case, "shape": list(shape), "max_errors": errors}


class Results:
    """The result dict, rewritten to DIR/gpu.json (atomically) after every row, so a run
    cut short by a time limit still leaves everything it measured; each row notes
    at_s, the seconds since the run began when it was written (to plan the next run)."""

    SECTIONS = ("checks", "bench", "tuning", "scores", "long")

    def __init__(self, path: Path | None, **header) -> None:
        self.path = path
        self.start = time.perf_counter()
        self.data = {**header, **{section: [] for section in self.SECTIONS}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def add(self, section: str, row: dict) -> None:
        self.data[section].append({**row, "at_s": round(self.elapsed(), 1)})
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)


class JsonRows:
    """The rows of a GPU script, one JSON object per line appended to DIR/name and
    flushed as each is made (a run cut short keeps what it measured), printed too and
    kept in `rows`; each notes at_s, the seconds since the script began. out None:
    printed only."""

    def __init__(self, out: Path | None, name: str) -> None:
        self.file = None
        self.start = time.perf_counter()
        self.rows: list[dict] = []
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.file = open(out / name, "a")  # noqa: SIM115 (kept open for the run)

    def write(self, row: dict) -> dict:
        row = {**row, "at_s": round(time.perf_counter() - self.start, 2)}
        self.rows.append(row)
        text = json.dumps(row)
        print(text, flush=True)
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()
        return row

    def add(self, **row) -> dict:
        return self.write(row)
