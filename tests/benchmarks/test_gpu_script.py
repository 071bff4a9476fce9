"""The prepared GPU script keeps working where there is no GPU: --dry-run runs every
section (checks, bench with the launch-config sweep, scores, long context) on tiny CPU
shapes (triton in the interpreter, flex eager)."""

from __future__ import annotations

import json

import pytest

from optional import needs

needs("triton")


@pytest.mark.slow
def test_gpu_script_dry_run(tmp_path, capsys):
    from mhsa.benchmarks import gpu
    from mhsa.benchmarks.gpu_measure import NO_EAGER_BACKWARD

    gpu.main(["--dry-run", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["mode"] == "dry-run full"
    assert set(result["section_s"]) == {"checks", "bench", "scores", "long"}
    assert len(result["checks"]) == 12  # 4 cases x 3 backends
    for row in result["checks"]:
        assert "skipped" not in row, row
        assert max(row["max_errors"]) < 1e-5, row
    # 2 lengths x 4 cases x (fwd, fwd+bwd) x (sdpa, flex, triton, auto)
    assert len(result["bench"]) == 64
    for row in result["bench"]:
        if (row["backend"], row["pass"]) == ("flex", "fwd+bwd"):
            assert row["skipped"] == f"NotImplementedError: {NO_EAGER_BACKWARD}"
            continue
        assert row["ms"] > 0 and row["tflops"] > 0 and row["first_call_s"] > 0, row
        assert row["vs_sdpa"] > 0 and (row["pass"] == "fwd+bwd" or row["vs_flex"] > 0), row
        if row["backend"] == "auto":
            assert row["picked"] in ("sdpa", "flash") and row["vs_best"] >= 1.0, row
    assert [row["config"] for row in result["tuning"]] == [[16, 16, 4, 1], [32, 16, 4, 1]]
    assert all(row["ms"] > 0 for row in result["tuning"])
    # 2 lengths x (fwd, fwd+bwd) x (none, alibi, softcap) x 4 backends
    assert len(result["scores"]) == 48
    for row in result["scores"]:
        if row["backend"] == "sdpa" and row["score"] != "none":
            assert "cannot serve this call" in row["skipped"], row
        elif row["backend"] == "triton" or (row["backend"], row["pass"]) != ("flex", "fwd+bwd"):
            assert row["vs_plain"] > 0 and row["of_matmul"] > 0, row
    assert {row["picked"] for row in result["scores"] if "ms" in row and row["backend"] == "auto"}
    assert [(row["length"], row["case"]) for row in result["long"]] == [
        (length, case)
        for length in (64, 128)
        for case in ("causal", "window(16, 0)", "bigbird(16)")
    ]
    for row in result["long"]:
        assert row["ms"] > 0 and row["tflops"] > 0 and row["picked"], row
        assert row["peak_gib"] is None  # no CUDA memory statistics on the CPU
    printed = capsys.readouterr().out
    assert "goals (issue 44):" in printed and "auto within 5% of the best backend" in printed
    assert "dense, L=64, fwd: triton/flex time" in printed
    assert "long context, fwd+bwd at L=128 through auto" in printed
    table = (tmp_path / "gpu.md").read_text()
    assert "| 64 | causal | fwd | triton |" in table and "does not serve" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json", "gpu.md"]  # no temp file


@pytest.mark.slow
def test_gpu_script_records_a_failing_backend(tmp_path, monkeypatch):
    from mhsa.benchmarks import gpu, gpu_measure

    def broken(name, *args):
        if name == "flex":
            raise AssertionError("flex broke")  # not a ValueError: still recorded
        return original(name, *args)

    original = gpu_measure.attend
    monkeypatch.setattr(gpu_measure, "attend", broken)
    only = ("checks", "bench")
    result = gpu.run(True, out=tmp_path / "gpu.json", quick=True, only=only, grad_forward=False)
    assert result["grad_forward"] is False
    flex_checks = [row for row in result["checks"] if row["backend"] == "flex"]
    assert len(flex_checks) == 4
    assert all(row["skipped"] == "AssertionError: flex broke" for row in flex_checks)
    flex_fwd = [r for r in result["bench"] if (r["backend"], r["pass"]) == ("flex", "fwd")]
    assert all(row["skipped"] == "AssertionError: flex broke" for row in flex_fwd)
    triton = [row for row in result["bench"] if row["backend"] == "triton"]
    assert all("ms" in row and "vs_flex" not in row for row in triton)
    assert result["scores"] == [] and result["long"] == []  # sections not asked for
    assert json.loads((tmp_path / "gpu.json").read_text()) == result


def test_gpu_band_scores_section_runs_on_the_cpu():
    """gpu_band's score-function section (plain, ALiBi, Softcap with tanh from exp and
    with tanh.approx, whose choice falls back to exp off the GPU; the kernels' variants
    beside the plain ones) at a tiny shape."""
    import torch

    from mhsa.benchmarks.gpu_band import run_scores
    from mhsa.benchmarks.gpu_measure import JsonRows

    rows = JsonRows(None, "band.jsonl")
    run_scores(rows, torch.device("cpu"), 1e12, 1, shape=(1, 2, 32, 16))
    names = {False: [], True: []}
    for backward, suffix in ((False, ", ahead"), (True, ", dq by atomics")):
        for score in ("none", "alibi", "softcap(30), tanh from exp", "softcap(30), tanh.approx"):
            names[backward] += [score] + ([score + suffix] if "from exp" not in score else [])
    assert [(r["score"], r["backward"]) for r in rows.rows] == [
        (score, backward) for backward in (False, True) for score in names[backward]
    ]
    for row in rows.rows:
        assert row["ms"] > 0 and row["vs_plain"] > 0 and row["of_matmul"] > 0, row
    # each against plain causal in the same kernels
    assert {r["score"]: r["vs_plain"] for r in rows.rows}["none, ahead"] == 1.0


@pytest.mark.slow
def test_gpu_band_hf_shape_section_runs_on_the_cpu():
    """gpu_band's transformers-shape section at a tiny shape: the band kernels forward
    and backward (dK/dV per query head and per KV head, dQ by atomics, the query blocks
    from the last), SDPA's forward+backward, and the window's backward under each dq and
    dK/dV config."""
    import torch

    from mhsa.benchmarks.gpu_band import DKV, DQ, run_hf_shape
    from mhsa.benchmarks.gpu_measure import JsonRows

    rows = JsonRows(None, "band.jsonl")
    run_hf_shape(rows, torch.device("cpu"), 1, shape=(1, 2, 32, 16), kv_heads=1)
    timed = {row["what"]: row for row in rows.rows}
    for case in ("causal", "window 512"):
        for what in (
            "forward",
            "backward",
            "backward, dkv per KV head",
            "backward, dq by atomics",
            "forward, last first",
            "backward, last first",
        ):
            assert timed[f"{case} band {what}"]["ms"] > 0
    assert timed["causal sdpa forward+backward"]["ms"] > 0
    assert len(timed) == 13 + len(DQ) + len(DKV)


def test_gpu_band_checks_compare_tma_loads_ahead_scores_and_atomic_dq_on_the_cpu():
    """gpu_band's variant checks at a tiny shape: the forward through TMA descriptors,
    the ones with scores a block (band) or a tile (tile lists, bigbird) ahead and the
    band forward and backward with the query blocks from the last give the plain
    kernels' bits, and the backward with dQ added by atomics is within
    float32 rounding of the dQ kernel's; a failing check gets its own row."""
    import torch

    from mhsa.benchmarks.gpu_band_checks import _check_variants
    from mhsa.benchmarks.gpu_measure import JsonRows

    rows = JsonRows(None, "band.jsonl")
    cpu = torch.device("cpu")
    _check_variants(rows, "dense", None, False, torch.float32, 16, 64, 64, cpu, heads=(1, 2, 1))
    found = {row["section"]: row for row in rows.rows}
    bits = [
        "check_tma",
        "check_ahead",
        "check_tma_ahead",
        "check_last_first",
        "check_dq_last_first",
    ]
    assert list(found) == [*bits, "check_dq_atomic", "check_tiles_ahead"]
    for section in (*bits, "check_tiles_ahead"):
        assert found[section]["same_bits"], found[section]
    differences = found["check_dq_atomic"]["max_differences"]
    assert len(differences) == 3 and max(differences) < 1e-5
    rows = JsonRows(None, "band.jsonl")
    _check_variants(rows, "causal", "not a mask", True, torch.float32, 16, 40, 50, "cpu", (1, 2, 1))
    assert [row["section"] for row in rows.rows] == [*bits, "check_dq_atomic"]
    assert all("skipped" in row for row in rows.rows)


def test_gpu_band_dispatch_section_runs_on_the_cpu():
    """gpu_band's dispatch section at a tiny shape: the band forward alone, then
    mhsa.attention (triton, sdpa) with and without isolate_nonfinite and SDPA itself,
    forward and forward+backward, each timed with its host time."""
    import torch

    from mhsa.benchmarks.gpu_band import run_dispatch
    from mhsa.benchmarks.gpu_measure import JsonRows

    rows = JsonRows(None, "band.jsonl")
    run_dispatch(rows, torch.device("cpu"), 1, shape=(1, 2, 40, 16))
    timed = {(row["what"], row["backward"]): row for row in rows.rows}
    calls = ["triton", "sdpa", "triton, isolate_nonfinite=False", "sdpa, isolate_nonfinite=False"]
    for backward in (False, True):
        for what in [*calls, "torch sdpa"]:
            assert timed[what, backward]["ms"] > 0 and timed[what, backward]["host_ms"] > 0
    assert ("triton kernel", False) in timed and ("triton kernel", True) not in timed


def test_gpu_band_tile_sweep_runs_on_the_cpu():
    """gpu_band's sweep of the tile-list kernels' launch configs (bigbird, packed
    segments; forward and forward+backward) at a tiny shape with the interpreter's
    tiles."""
    import torch

    from mhsa.benchmarks.gpu_band import run_sweep_tiles
    from mhsa.benchmarks.gpu_measure import JsonRows

    rows = JsonRows(None, "band.jsonl")
    configs = [(16, 16, 4, 1), (32, 16, 4, 1)]
    run_sweep_tiles(rows, torch.device("cpu"), 0, 1e12, 1, (1, 2, 64, 16), configs)
    names = {False: [*map(str, configs), *(f"{c} ahead" for c in configs)], True: configs}
    assert [(r["case"], r["backward"], r["config"]) for r in rows.rows] == [
        (case, backward, str(config))
        for case in ("bigbird(64)", "segments")
        for backward in (False, True)
        for config in names[backward]
    ]
    assert all(r["ms"] > 0 and r["of_matmul"] > 0 for r in rows.rows), rows.rows


@pytest.mark.parametrize(
    "args, says",
    [
        (["--only", "checks,hf_shap"], "argument --only: unknown ['hf_shap']; choose from checks,"),
        (["--dims", "128,12x"], "argument --dims: '128,12x' is not a comma-separated list of int"),
        (["--cases", "causl"], "argument --cases: unknown ['causl']; choose from dense, causal"),
        (["--only", "checks"], "no CUDA device: it times the kernels on a GPU"),
    ],
)
def test_gpu_band_refuses_a_bad_call_in_one_line(args, says, capsys, monkeypatch):
    """A misspelled section or case is an error, not a run that skips it silently."""
    import torch

    from mhsa.benchmarks import gpu_band

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        gpu_band.main(args)
    assert exited.value.code == 2 and says in capsys.readouterr().err


def test_gpu_hf_without_a_gpu_says_so_in_one_line(capsys, monkeypatch):
    import torch

    from mhsa.benchmarks import gpu_hf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        gpu_hf.main([])
    assert exited.value.code == 2
    assert "no CUDA device: run it on a GPU, or use --device cpu" in capsys.readouterr().err
