"""`mhsa bench hf`: the window case measures both implementations on the same model, and
the report prints what it compares."""

from __future__ import annotations

import pytest

from mhsa.benchmarks import hf


@pytest.mark.slow
def test_the_window_case_runs_both_implementations_in_fresh_processes():
    rows = [hf.window_in_subprocess(name, 256, 32) for name in ("mhsa", "sdpa")]
    for row in rows:
        assert "error" not in row, row
        assert row["seconds"] > 0 and row["length"] == 256 and row["window"] == 32
    result = {
        "speed": {
            "model": "a model",
            "threads": 1,
            "prefill_seconds": {"128": {"mhsa": 1.0, "sdpa": 2.0, "eager": 3.0}},
            "decode": {"prompt": 128, "new_tokens": 8, "seconds": {"mhsa": 1.0, "sdpa": 2.0}},
        },
        "window": rows,
    }
    text = hf.report(result)
    assert "prefill L=128: mhsa 1.000 s (1.00x), sdpa 2.000 s (2.00x)" in text
    assert "mhsa  (pattern) L=256" in text and "sdpa  (dense 4-D mask) L=256" in text
    assert "sdpa / mhsa: time" in text


def test_the_window_case_says_a_failure():
    text = hf.report(
        {
            "speed": {
                "model": "m",
                "threads": 1,
                "prefill_seconds": {},
                "decode": {"prompt": 1, "new_tokens": 1, "seconds": {"mhsa": 1.0}},
            },
            "window": [{"implementation": "sdpa", "length": 9, "error": "MemoryError"}],
        }
    )
    assert "sdpa  L=9: failed (MemoryError)" in text
