"""The prepared GPU script keeps working where there is no GPU: --dry-run runs every
check and benchmark case on tiny CPU shapes (triton in the interpreter, flex eager)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

pytest.importorskip("triton")


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
    assert all("ms" in row and row["tflops"] > 0 for row in result["bench"])
    assert "of matmul" in capsys.readouterr().out
