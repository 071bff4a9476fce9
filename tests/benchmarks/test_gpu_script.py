"""The prepared GPU script keeps working where there is no GPU: --dry-run runs every
check and benchmark case on tiny CPU shapes (triton in the interpreter, flex eager)."""

from __future__ import annotations

import json

import pytest
import torch

from optional import needs

needs("triton")


@pytest.mark.slow
def test_gpu_script_dry_run(tmp_path, monkeypatch, capsys):
    import sys

    from mhsa.benchmarks import gpu

    monkeypatch.setattr(sys, "argv", ["gpu", "--dry-run", "--out", str(tmp_path), "--repeat", "1"])
    gpu.main()
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert len(result["checks"]) == 12 and len(result["bench"]) == 24  # 4 cases x 3 backends
    for row in result["checks"]:
        assert "skipped" not in row, row
        assert max(row["max_errors"]) < 1e-5, row
    assert all(
        "ms" in row and row["tflops"] > 0 and row["first_call_s"] > 0 for row in result["bench"]
    )
    assert [row["config"] for row in result["tuning"]] == [[16, 16, 4, 1], [32, 16, 4, 1]]
    assert all(row["ms"] > 0 for row in result["tuning"])
    printed = capsys.readouterr().out
    assert "of matmul" in printed and "triton forward vs flex, causal, L=64" in printed
    assert list(tmp_path.iterdir()) == [tmp_path / "gpu.json"]  # no temporary file left


@pytest.mark.slow
def test_gpu_script_records_failures_and_the_budget(tmp_path, monkeypatch):
    from mhsa.benchmarks import gpu

    def broken(name, *args):
        if name == "flex":
            raise AssertionError("flex broke")  # not a ValueError: still recorded
        return original(name, *args)

    original = gpu._call
    monkeypatch.setattr(gpu, "_call", broken)
    result = gpu.run(True, repeat=1, out=tmp_path / "gpu.json", lengths=(64,), budget=0.0)
    flex_checks = [row for row in result["checks"] if row["backend"] == "flex"]
    assert all(row["skipped"] == "AssertionError: flex broke" for row in flex_checks)
    assert all(row["skipped"] == "time budget spent" for row in result["bench"])
    assert all(row["skipped"] == "time budget spent" for row in result["tuning"])
    assert json.loads((tmp_path / "gpu.json").read_text()) == result
    assert gpu.goals(result) == []


def test_gpu_script_times_the_others_when_one_fails_while_timed(monkeypatch):
    from mhsa.benchmarks import gpu

    calls = {"triton": 0}

    def flaky(name, *args):
        if name == "triton":
            calls["triton"] += 1
            if calls["triton"] > 1:  # the first (compiling) call works, a timed one fails
                raise RuntimeError("illegal memory access")
        return original(name, *args)

    original = gpu._call
    monkeypatch.setattr(gpu, "_call", flaky)
    qkv = [torch.randn(1, 2, 64, 16) for _ in range(3)]
    rows = gpu._bench_case(
        qkv, "dense", None, False, True, 1, torch.device("cpu"), 1e9, over_budget=False
    )
    by_name = {row["backend"]: row for row in rows}
    assert by_name["triton"]["skipped"] == "RuntimeError: illegal memory access"
    assert "ms" in by_name["sdpa"] and "ms" in by_name["flex"]
