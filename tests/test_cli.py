"""The `mhsa` command."""

from __future__ import annotations

import subprocess
import sys

from mhsa.cli import main


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "device: cpu" in out
    assert "sdpa" in out and "reference" in out and "usable" in out
    assert "logsumexp" in out  # sdpa's limit is explained


def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "mhsa.cli", "info"], capture_output=True, text=True, check=True
    )
    assert "backends" in result.stdout


def test_bench_attention_json_small(capsys):
    import json

    args = ["bench", "attention", "--length", "128", "--repeat", "1", "--no-memory", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    cases = {(row["case"], row["backend"]) for row in result["timing"]}
    assert ("causal forward+backward", "flash") in cases
    assert all(row["seconds"] > 0 and row["vs_sdpa"] > 0 for row in result["timing"])


def test_memory_probe_runs_in_a_subprocess():
    from mhsa.benchmarks.memory import measure_in_subprocess

    row = measure_in_subprocess("flash", 256, heads=1, causal=True)
    assert "error" not in row and row["peak_bytes"] >= row["baseline_bytes"] > 0


def test_sparse_bench_cases_run_small():
    from mhsa.benchmarks import sparse

    bird = sparse.bigbird_case(256, repeat=1)
    assert set(bird["forward"]) == {"flash", "sdpa dense mask"}
    scaling = sparse.scaling_case(256, 512, repeat=1)
    assert scaling["length_ratio"] == 2 and scaling["ratio"] > 0


def test_train_gpt_then_generate(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("for i in range(10):\n    print(i)\n" * 100)
    out = tmp_path / "run"
    args = ["train", "gpt", "--data", str(data), "--out", str(out), "--steps", "4",
            "--eval-every", "2", "--layers", "1", "--d-model", "32", "--seq-len", "32"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "unigram baseline" in text and (out / "latest").exists()
    assert main(["generate", str(out), "--prompt", "for ", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("for ") and "tokens/s" in captured.err
