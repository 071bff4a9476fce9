"""What `python -m mhsa.benchmarks.gpu` prints and writes from its gpu.json: the goals
of issue 44 marked met or missed with their numbers, a text summary, and gpu.md (the
markdown tables the README's GPU table is pasted from). Reads only the result dict,
so `--report gpu.json` renders a saved (or cut-short) run again anywhere.

Every ratio is a time ratio (ms / the peer's ms): below 1 is faster than the peer.
"""

from __future__ import annotations

FLEX_RATIO = 1.0  # triton at least flex's speed: triton ms / flex ms <= 1
MATMUL_SHARE, MATMUL_LENGTH = 0.6, 8192  # triton causal forward, of the bf16 matmul
AUTO_SLACK = 1.05  # auto within 5% of the best backend
SCORE_RATIO = 1.3  # a score function costs at most 1.3x plain causal
LONG_LENGTH = 131072
# memory linear in L: peak grows at most 1.25x as fast as L between two lengths; with
# one length, peak <= this many times q's size (q, k, v, out, their grads: 7 of them)
LINEAR_SLACK, ONE_LENGTH_PEAK = 1.25, 16


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _rollup(title: str, checks: list[bool], details: list[str]) -> list[str]:
    if not checks:
        return [f"{title}: not measured"]
    met = sum(checks)
    return [f"{title}: {_verdict(all(checks))} ({met} of {len(checks)} met)", *details]


def _triton_vs_flex(result: dict) -> list[str]:
    checks, details = [], []
    for row in result.get("bench", []):
        if row["backend"] == "triton" and "vs_flex" in row and "pass" in row:
            ratio = row["vs_flex"]
            checks.append(ratio <= FLEX_RATIO)
            details.append(
                f"    {row['case']}, L={row['length']}, {row['pass']}: triton/flex time "
                f"{ratio:.2f}x ({_verdict(ratio <= FLEX_RATIO)})"
            )
    return _rollup(
        "triton at least flex's speed, fwd and fwd+bwd, every case and L", checks, details
    )


def _matmul_share(result: dict) -> list[str]:
    title = f"triton causal forward >= {MATMUL_SHARE:.0%} of the matmul at L={MATMUL_LENGTH}"
    for row in result.get("bench", []):
        key = (row["case"], row["backend"], row["pass"], row["length"])
        if key == ("causal", "triton", "fwd", MATMUL_LENGTH) and "of_matmul" in row:
            share = row["of_matmul"]
            return [f"{title}: {_verdict(share >= MATMUL_SHARE)} ({share:.1%})"]
    return [f"{title}: not measured"]


def _auto(result: dict) -> list[str]:
    checks, details = [], []
    for row in result.get("bench", []):
        if row["backend"] == "auto" and "vs_best" in row:
            ok = row["vs_best"] <= AUTO_SLACK
            checks.append(ok)
            details.append(
                f"    {row['case']}, L={row['length']}, {row['pass']}: auto picked "
                f"{row.get('picked')}, {row['vs_best']:.2f}x the best ({_verdict(ok)})"
            )
    return _rollup(f"auto within {AUTO_SLACK - 1:.0%} of the best backend", checks, details)


def _scores(result: dict) -> list[str]:
    """Through auto (what a user gets) decides; each backend's ratio is listed."""
    checks, details = [], []
    for row in result.get("scores", []):
        if row["score"] != "none" and "vs_plain" in row:
            ok = row["vs_plain"] <= SCORE_RATIO
            if row["backend"] == "auto":
                checks.append(ok)
            picked = f" ({row['picked']})" if row.get("picked") else ""
            details.append(
                f"    {row['score']}, L={row['length']}, {row['pass']}, "
                f"{row['backend']}{picked}: {row['vs_plain']:.2f}x plain causal ({_verdict(ok)})"
            )
    title = f"score functions <= {SCORE_RATIO}x plain causal, through auto"
    return _rollup(title, checks, details)


def _long(result: dict) -> list[str]:
    """At the longest length run (131072 on the GPU)."""
    rows = [row for row in result.get("long", []) if "skipped" not in row]
    longest = max((row["length"] for row in rows), default=LONG_LENGTH)
    at_length = [row for row in rows if row["length"] == longest]
    title = f"long context, fwd+bwd at L={longest} through auto, memory linear in L"
    if not at_length:
        return [f"{title}: not measured"]
    details, checks, measured = [], [], False
    for row in at_length:
        if "error" in row:
            checks.append(False)
            details.append(f"    {row['case']}: failed: {row['error']}")
            continue
        linear, peak = _linear(row, rows), _peak(row)
        measured |= linear is not None
        checks.append(linear is not False)
        memory = "peak not measured" if peak is None else f"peak {peak:.2f} GiB"
        how = {True: "linear", False: "NOT linear", None: "linearity not measured"}[linear]
        details.append(
            f"    {row['case']}: {row['ms']:.4g} ms ({row.get('picked')}), {memory}, {how}"
        )
    if not measured and all(checks):  # ran, but without CUDA memory figures
        ran = f"ran {len(checks)} of {len(checks)}, no memory figures"
        return [f"{title}: not measured ({ran})", *details]
    return _rollup(title, checks, details)


def _linear(row: dict, rows: list[dict]) -> bool | None:
    """Peak memory linear in L: against a shorter length of the same case, or with one
    length, against the size of q; None without CUDA memory figures."""
    peak = _peak(row)
    if peak is None:
        return None
    shorter = [
        r for r in rows if r["case"] == row["case"] and r["length"] < row["length"] and _peak(r)
    ]
    if shorter:
        base = max(shorter, key=lambda r: r["length"])
        return peak / _peak(base) <= LINEAR_SLACK * row["length"] / base["length"]
    batch, heads, length, dim = row["shape"]
    q_gib = batch * heads * length * dim * 2 / 2**30
    return peak <= ONE_LENGTH_PEAK * q_gib


def _peak(row: dict) -> float | None:
    peaks = [row.get(key) for key in ("peak_first_gib", "peak_gib")]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


def goals(result: dict) -> list[str]:
    """Each goal of issue 44 this run measures: met, MISSED or not measured, with the
    numbers behind it."""
    return [
        *_triton_vs_flex(result),
        *_matmul_share(result),
        *_auto(result),
        *_scores(result),
        *_long(result),
    ]


def _ms(row: dict) -> str:
    return row.get("skipped") or row.get("error") or f"{row['ms']:.3f} ms"


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def _share(row: dict) -> str:
    return f"{row['of_matmul']:.0%}" if "of_matmul" in row else "-"


def _backend(row: dict, best: bool = False) -> str:
    """The backend, with auto's pick (and with best, its time ratio to the best)."""
    if not row.get("picked"):
        return row["backend"]
    against = f", {row['vs_best']:.2f}x best" if best and "vs_best" in row else ""
    return f"auto ({row['picked']}{against})"


def _first(row: dict) -> str:
    return f"  first {row['first_call_s']:.1f} s" if "first_call_s" in row else ""


def summary(result: dict) -> str:
    """The text printed at the end of a run (or by --report)."""
    matmul = result.get("matmul_tflops", float("nan"))
    times = ", ".join(f"{name} {s:g} s" for name, s in result.get("section_s", {}).items())
    lines = [
        f"{result['device']}, torch {result['torch']}, triton {result.get('triton')}, "
        f"{result['dtype']}, {result.get('mode', 'full')} run; matmul {matmul:.3g} TFLOP/s",
        f"time: {times or '-'}; total {result.get('total_s', '-')} s",
        "checks (max |error| of out, dq, dk, dv against the float32 reference):",
    ]
    for row in result.get("checks", []):
        detail = row.get("skipped") or ", ".join(f"{e:.1e}" for e in row["max_errors"])
        lines.append(f"  {row['case']:<18} {row['backend']:<7} {detail}")
    lines.append("bench (ms, % of matmul, time vs flex, vs sdpa; auto: vs the best):")
    for row in result.get("bench", []):
        detail = _ms(row)
        if "ms" in row:
            detail += f"  {_share(row):>4}  {_ratio(row, 'vs_flex'):>6}"
            detail += f"  {_ratio(row, 'vs_sdpa'):>6}"
            detail += f"  best {_ratio(row, 'vs_best')}" if "vs_best" in row else ""
        where = f"L={row['length']:<6} {row['case']:<16} {row.get('pass', 'fwd'):<7}"
        lines.append(f"  {where} {_backend(row):<14} {detail}{_first(row)}")
    lines.append("triton forward launch configs, causal (BLOCK_M, BLOCK_N, warps, stages):")
    for row in result.get("tuning", []):
        detail = _ms(row) + (f"  {_share(row)} of matmul" if "ms" in row else "")
        lines.append(f"  L={row['length']:<6} {str(tuple(row['config'])):<20} {detail}")
    lines.append("score functions, causal (ms, time vs plain causal of the same backend):")
    for row in result.get("scores", []):
        detail = _ms(row) + (f"  {_ratio(row, 'vs_plain')}" if "ms" in row else "")
        where = f"L={row['length']:<6} {row['score']:<12} {row['pass']:<7}"
        lines.append(f"  {where} {_backend(row):<14} {detail}{_first(row)}")
    lines.append(
        "long context, fwd+bwd through auto (ms; peak above the inputs: first call, next):"
    )
    for row in result.get("long", []):
        detail = _ms(row)
        if "ms" in row:
            detail += f"  {_gib(row.get('peak_first_gib'))}, {_gib(row.get('peak_gib'))}"
        where = f"L={row['length']:<6} {row['case']:<16}"
        lines.append(f"  {where} {_backend(row):<14} {detail}{_first(row)}")
    lines.append("goals (issue 44):")
    lines.extend(f"  {line}" for line in goals(result))
    return "\n".join(lines)


def _gib(value) -> str:
    return "-" if value is None else f"{value:.2f} GiB"


def _cell(row: dict) -> str:
    """A table cell: ms, or why there is none in a word or two (gpu.json has the
    whole reason)."""
    if "ms" in row:
        return f"{row['ms']:.3f}"
    reason = row.get("skipped") or row.get("error") or ""
    if "cannot serve this call" in reason:
        return "does not serve"
    if reason == "time budget spent":
        return "not run (budget)"
    return reason.split(":")[0] or "failed"


def markdown(result: dict) -> str:
    """gpu.md: every case and backend (time, % of the matmul, time vs flex and sdpa),
    the score functions, long context and the goals."""
    matmul = result.get("matmul_tflops", float("nan"))
    dtype = str(result["dtype"]).replace("torch.", "")
    shape = ", ".join(map(str, result.get("shape", [])))
    lines = [
        f"Measured on {result['device']} (torch {result['torch']}, triton "
        f"{result.get('triton')}, {dtype}, B, H, D = {shape}; {result.get('mode', 'full')} run of "
        f"`python -m mhsa.benchmarks.gpu`). % matmul: share of a {dtype} matmul measured "
        f"in the same run ({matmul:.3g} TFLOP/s); vs flex, vs sdpa: time ratio (below 1 "
        "is faster); forward timed on inputs that "
        + ("require grad." if result.get("grad_forward", True) else "do not require grad."),
        "",
        "| L | case | pass | backend | ms | % matmul | vs flex | vs sdpa |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in result.get("bench", []):
        where = f"{row['length']} | {row['case']} | {row.get('pass', 'fwd')}"
        lines.append(
            f"| {where} | {_backend(row, best=True)} | {_cell(row)} | "
            f"{_share(row)} | {_ratio(row, 'vs_flex')} | {_ratio(row, 'vs_sdpa')} |"
        )
    lines += [
        "",
        "Score functions, causal: time vs plain causal of the same backend.",
        "",
        "| L | score | pass | backend | ms | % matmul | vs plain causal |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for row in result.get("scores", []):
        lines.append(
            f"| {row['length']} | {row['score']} | {row['pass']} | {_backend(row)} | "
            f"{_cell(row)} | {_share(row)} | {_ratio(row, 'vs_plain')} |"
        )
    lines += [
        "",
        "Long context, forward+backward through auto: peak memory above the inputs.",
        "",
        "| case | B, H, L, D | backend | ms | peak (first call) | peak |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for row in result.get("long", []):
        shape = ", ".join(map(str, row.get("shape", [])))
        lines.append(
            f"| {row['case']} | {shape} | {_backend(row)} | {_cell(row)} | "
            f"{_gib(row.get('peak_first_gib'))} | {_gib(row.get('peak_gib'))} |"
        )
    lines += ["", "Goals (issue 44):", ""]
    lines += [
        f"- {line.strip()}" if not line.startswith(" ") else f"  - {line.strip()}"
        for line in goals(result)
    ]
    return "\n".join(lines) + "\n"
