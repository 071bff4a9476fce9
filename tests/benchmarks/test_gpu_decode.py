"""The GPU decoding benchmark (mhsa.benchmarks.gpu_decode) run on the CPU at tiny sizes:
every row is written, the same weights give transformers' greedy tokens, and a row that
fails (the CUDA graph, on the CPU) records its error while the run goes on."""

from __future__ import annotations

import json

import pytest

from mhsa.benchmarks import gpu_decode

TINY = {
    **gpu_decode.SMOLLM2_135M,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
}


@pytest.mark.slow
def test_the_benchmark_writes_a_row_per_decoder_and_survives_a_failing_one(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(gpu_decode, "SMOLLM2_135M", TINY)
    monkeypatch.setattr(gpu_decode, "DEVICE", "cpu")
    gpu_decode.run(tmp_path, prompt_len=13, new=6, repeat=1)
    lines = (tmp_path / "gpu_decode.jsonl").read_text().splitlines()
    rows = {row["row"]: row for row in map(json.loads, lines)}
    assert rows["setup"]["device"] == "cpu" and "done" in rows
    assert "CUDA device" in rows["mhsa generate (CUDA graph)"]["error"]
    eager = rows["mhsa generate (eager)"]
    assert eager["new_tokens"] == 6 and eager["tokens_per_s"] > 0
    assert rows["transformers generate"]["new_tokens"] == 6
    # the same weights: transformers' greedy tokens are mhsa's, but for a float32 near-tie
    assert rows["transformers generate"]["matches_mhsa_eager"]
    static = rows['transformers generate (cache_implementation="static", compiled)']
    assert static.get("new_tokens") == 6, static
