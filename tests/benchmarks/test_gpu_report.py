"""The GPU script's parts that need neither a GPU nor triton: its plans (what the full
and quick runs measure), the budget, the interleaved timer, flop counts, auto's
observed choice, and the goals, summary and gpu.md rendered from a result."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mhsa.benchmarks import gpu, gpu_measure, gpu_report, gpu_sections
from mhsa.core.masks import SlidingWindow, bigbird


def test_plans_of_the_full_and_quick_runs():
    full, quick = gpu.make_plan(False), gpu.make_plan(False, quick=True)
    assert full.lengths == (8192, 2048, 16384) and quick.lengths == (8192,)
    assert full.score_lengths == (4096, 16384) and quick.score_lengths == (4096,)
    assert full.long_lengths == (65536, 131072) and quick.long_lengths == (131072,)
    assert full.shape == (4, 16, 128) and full.long_shape == (1, 32, 128)
    assert full.dtype == torch.bfloat16
    assert list(full.cases) == ["dense", "causal", "window(1024, 0)", "bigbird(64)"]
    assert len(full.tuning) == 7 and quick.tuning == ()
    assert (full.budget, quick.budget) == (400.0, 170.0)
    for plan in (full, quick):
        shares = list(plan.shares.values())
        assert list(plan.shares) == list(gpu.SECTIONS) and shares == sorted(shares)
        assert shares[-1] == 1.0
    assert gpu.make_plan(False, lengths=(1024,), repeat=3, budget=5.0).lengths == (1024,)


def test_a_spent_budget_skips_every_case_and_keeps_the_file(tmp_path):
    result = gpu.run(True, out=tmp_path / "gpu.json", budget=0.0, quick=True)
    for section in ("checks", "bench", "scores", "long"):
        assert result[section] and all(
            row["skipped"] == "time budget spent" for row in result[section]
        ), section
    assert json.loads((tmp_path / "gpu.json").read_text()) == result
    assert "not run (budget)" in (tmp_path / "gpu.md").read_text()
    assert all(line.endswith("not measured") for line in gpu.goals(result))


def test_the_timer_times_the_others_when_one_fails_while_timed():
    calls = {"bad": 0}

    def bad():
        calls["bad"] += 1
        if calls["bad"] > 2:  # the first (compiling) and warm calls work, a timed one fails
            raise RuntimeError("illegal memory access")

    def never():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 128 GiB")

    rows = gpu_measure.time_group(
        {"good": lambda: None, "bad": bad, "never": never}, 3, torch.device("cpu")
    )
    assert rows["bad"]["skipped"] == "RuntimeError: illegal memory access"
    assert rows["never"]["skipped"].startswith("OutOfMemoryError: CUDA out of memory")
    good = rows["good"]
    assert good["ms"] <= good["ms_median"] and good["calls_per_sample"] >= 1
    assert 0 < good["host_ms"] <= good["ms_median"]  # (on the CPU the host does it all)
    assert "ms" not in rows["bad"] and "first_call_s" in rows["bad"]


def test_the_timer_with_no_samples_calls_each_function_once_to_compile_it():
    calls = []
    rows = gpu_measure.time_group({"f": lambda: calls.append(1)}, 0, torch.device("cpu"))
    assert calls == [1] and list(rows["f"]) == ["first_call_s"]


def test_auto_choice_is_observed_and_select_restored():
    import mhsa.core.attention as core

    original = core.select
    q = torch.randn(1, 2, 8, 4)
    out, picked = gpu_measure.observe_backend(lambda: core.attention(q, q, q, causal=True))
    assert picked == core.select(_spec(q), "auto").name and out.shape == q.shape
    assert core.select is original
    with pytest.raises(ZeroDivisionError):
        gpu_measure.observe_backend(lambda: 1 / 0)
    assert core.select is original


def _spec(q):
    from mhsa.core.backends import AttentionSpec

    return AttentionSpec.example(
        num_heads=2, num_kv_heads=2, q_len=8, kv_len=8, head_dim=4, value_dim=4, causal=True
    )


@pytest.mark.parametrize(
    "mask, causal",
    [
        (None, False),
        (None, True),
        (SlidingWindow(7, 0), False),
        (bigbird(16), False),
        (bigbird(16), True),
    ],
)
def test_allowed_entries_count_in_row_chunks(mask, causal):
    from mhsa.core.backends.common import combined_mask

    length = 203
    dense = combined_mask(mask, causal, length, length, torch.device("cpu"))
    expected = length * length if dense is None else int(dense.expand(length, length).sum())
    counted = gpu_measure.allowed_entries(mask, causal, length, torch.device("cpu"), 1000)
    assert counted == expected
    assert gpu_measure.flops(counted, (2, 3, length, 8), backward=True) == 3.5 * 4 * 8 * 6 * counted


def _bench(case, length, passes, backend, ms, **extra):
    return {"case": case, "length": length, "pass": passes, "backend": backend, "ms": ms, **extra}


def _result() -> dict:
    """A made-up result with every goal measured, some met and some missed."""
    bench = []
    for passes in ("fwd", "fwd+bwd"):
        group = [
            _bench("causal", 8192, passes, "sdpa", 1.9, of_matmul=0.76),
            _bench("causal", 8192, passes, "flex", 3.0, of_matmul=0.47),
            _bench("causal", 8192, passes, "triton", 2.5, of_matmul=0.62),
            _bench("causal", 8192, passes, "auto", 1.95, picked="sdpa", of_matmul=0.74),
            _bench("bigbird(64)", 8192, passes, "flex", 1.0),
            _bench("bigbird(64)", 8192, passes, "triton", 1.2),
            _bench("bigbird(64)", 8192, passes, "auto", 1.2, picked="triton"),
        ]
        bench += gpu_sections.compare(group[:4], None, 1.0)
        bench += gpu_sections.compare(group[4:], None, 1.0)
    bench.append(
        {
            "case": "dense",
            "length": 8192,
            "pass": "fwd",
            "backend": "flex",
            "skipped": "InductorError: LoweringException: Buffers cannot be created",
        }
    )
    scores = [
        {
            "score": "alibi",
            "length": 4096,
            "pass": "fwd",
            "backend": "auto",
            "ms": 0.7,
            "picked": "triton",
            "vs_plain": 1.1,
        },
        {
            "score": "softcap(30)",
            "length": 4096,
            "pass": "fwd",
            "backend": "auto",
            "ms": 2.2,
            "picked": "flex",
            "vs_plain": 3.5,
        },
        {
            "score": "softcap(30)",
            "length": 4096,
            "pass": "fwd",
            "backend": "triton",
            "ms": 0.7,
            "vs_plain": 1.05,
        },
        {
            "score": "alibi",
            "length": 4096,
            "pass": "fwd",
            "backend": "sdpa",
            "skipped": "ValueError: backend 'sdpa' cannot serve this call: no score functions",
        },
    ]
    shape = lambda length: [1, 32, length, 128]  # noqa: E731
    long = [
        {
            "case": "causal",
            "length": 65536,
            "shape": shape(65536),
            "backend": "auto",
            "picked": "sdpa",
            "ms": 230.0,
            "peak_first_gib": 5.0,
            "peak_gib": 5.0,
        },
        {
            "case": "causal",
            "length": 131072,
            "shape": shape(131072),
            "backend": "auto",
            "picked": "sdpa",
            "ms": 890.0,
            "peak_first_gib": 10.0,
            "peak_gib": 10.0,
        },
        {
            "case": "window(1024, 0)",
            "length": 65536,
            "shape": shape(65536),
            "backend": "auto",
            "picked": "flex",
            "ms": 60.0,
            "peak_first_gib": 5.0,
            "peak_gib": 4.0,
        },
        {
            "case": "window(1024, 0)",
            "length": 131072,
            "shape": shape(131072),
            "backend": "auto",
            "picked": "flex",
            "ms": 120.0,
            "peak_first_gib": 20.0,
            "peak_gib": 8.0,
        },  # the first call (its block mask) grew 4x: quadratic
        {
            "case": "bigbird(64)",
            "length": 131072,
            "shape": shape(131072),
            "backend": "auto",
            "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 GiB",
        },
    ]
    return {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "dtype": "torch.bfloat16",
        "mode": "full",
        "shape": [4, 16, 128],
        "matmul_tflops": 764.0,
        "section_s": {"checks": 50.0},
        "total_s": 300.0,
        "checks": [{"backend": "triton", "case": "causal", "max_errors": [0.01, 0.02, 0.02, 0.02]}],
        "bench": bench,
        "tuning": [{"config": [64, 64, 4, 2], "length": 8192, "ms": 3.0, "of_matmul": 0.5}],
        "scores": scores,
        "long": long,
    }


def test_goals_are_marked_met_or_missed_with_their_numbers():
    result = _result()
    auto = [row for row in result["bench"] if row["backend"] == "auto"]
    assert [round(row["vs_best"], 3) for row in auto] == [1.026, 1.2, 1.026, 1.2]
    triton = next(row for row in result["bench"] if row["backend"] == "triton")
    assert math.isclose(triton["vs_flex"], 2.5 / 3.0) and math.isclose(triton["vs_sdpa"], 2.5 / 1.9)
    lines = gpu.goals(result)
    assert lines[0].startswith("triton at least flex's speed") and "MISSED (2 of 4 met)" in lines[0]
    assert "causal, L=8192, fwd: triton/flex time 0.83x (met)" in lines[1]
    assert "triton causal forward >= 60% of the matmul at L=8192: met (62.0%)" in lines
    assert "auto within 5% of the best backend: MISSED (2 of 4 met)" in lines
    assert "    bigbird(64), L=8192, fwd: auto picked triton, 1.20x the best (MISSED)" in lines
    assert "score functions <= 1.3x plain causal, through auto: MISSED (1 of 2 met)" in lines
    assert "    softcap(30), L=4096, fwd, triton: 1.05x plain causal (met)" in lines
    long = lines[lines.index(next(line for line in lines if line.startswith("long context"))) :]
    assert long[0].startswith("long context, fwd+bwd at L=131072") and "1 of 3 met" in long[0]
    assert "    causal: 890 ms (sdpa), peak 10.00 GiB, linear" in long
    assert "    window(1024, 0): 120 ms (flex), peak 20.00 GiB, NOT linear" in long
    assert long[-1].startswith("    bigbird(64): failed: OutOfMemoryError")


def test_one_long_length_is_judged_against_the_size_of_q():
    result = {
        "long": [
            {
                "case": "causal",
                "length": 131072,
                "shape": [1, 32, 131072, 128],
                "ms": 900.0,
                "picked": "sdpa",
                "peak_first_gib": 10.0,
                "peak_gib": 10.0,
            },
            {
                "case": "bigbird(64)",
                "length": 131072,
                "shape": [1, 32, 131072, 128],
                "ms": 90.0,
                "picked": "flex",
                "peak_first_gib": 40.0,
                "peak_gib": 9.0,
            },
        ]
    }
    lines = gpu_report._long(result)
    assert "MISSED (1 of 2 met)" in lines[0]
    assert lines[1].endswith("linear") and lines[2].endswith("NOT linear")


def test_summary_and_markdown_and_the_report_option(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(_result()))
    gpu.main(["--report", str(path)])
    printed = capsys.readouterr().out
    assert "NVIDIA H200, torch 2.11.0, triton 3.6.0" in printed and "goals (issue 44):" in printed
    assert "InductorError: LoweringException" in printed  # the whole reason in the summary
    table = (tmp_path / "gpu.md").read_text()
    assert "| 8192 | causal | fwd | triton | 2.500 | 62% | 0.83x | 1.32x |" in table
    assert "| 8192 | causal | fwd | auto (sdpa, 1.03x best) | 1.950 | 74% |" in table
    assert "| 8192 | dense | fwd | flex | InductorError | - | - | - |" in table
    assert "| 4096 | alibi | fwd | sdpa | does not serve | - | - |" in table
    assert "| bigbird(64) | 1, 32, 131072, 128 | auto | OutOfMemoryError | - | - |" in table
    assert "- auto within 5% of the best backend: MISSED (2 of 4 met)" in table
    assert "  - causal, L=8192, fwd: triton/flex time 0.83x (met)" in table


def test_a_long_context_oom_is_a_row_with_the_backend_auto_picked(monkeypatch):
    import dataclasses

    from mhsa.core.backends import get

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 GiB")

    sdpa = get("sdpa")
    monkeypatch.setattr(sdpa, "forward", out_of_memory)
    plan = dataclasses.replace(gpu.make_plan(True), long_lengths=(64,))
    results = gpu_measure.Results(None, device="cpu")
    gpu_sections.run_long(plan, results, deadline=math.inf)
    rows = results.data["long"]  # auto picks sdpa for each case at this size
    assert [row["case"] for row in rows] == ["causal", "window(16, 0)", "bigbird(16)"]
    for row in rows:
        assert row["picked"] == "sdpa" and "ms" not in row, row
        assert row["error"].startswith("OutOfMemoryError: CUDA out of memory"), row


def test_the_check_compares_the_full_shape_call_with_a_reference_on_some_heads(monkeypatch):
    cpu = torch.device("cpu")
    window = SlidingWindow(7, 0)
    row = gpu_measure.check("sdpa", "w", window, True, (2, 3, 40, 8), torch.float32, cpu, False)
    assert row["shape"] == [2, 3, 40, 8] and len(row["max_errors"]) == 4
    assert max(row["max_errors"]) < 1e-5

    def head_one_wrong(name, q, *args):
        out = original(name, q, *args)
        if name != "sdpa":
            return out
        return out + (torch.arange(q.shape[1]) == 1).view(1, -1, 1, 1).to(out.dtype)

    original = gpu_measure.attend
    monkeypatch.setattr(gpu_measure, "attend", head_one_wrong)
    row = gpu_measure.check("sdpa", "w", window, True, (2, 3, 40, 8), torch.float32, cpu, False)
    assert row["max_errors"][0] == pytest.approx(1.0)
