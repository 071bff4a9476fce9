"""`mhsa bench varlen` at its --quick size: the lengths it draws, both training steps on
the same real tokens, the planning it times, the memory it measures (in this process
here; the suite runs each side in a fresh one), and its table. No timing asserts."""

from __future__ import annotations

from mhsa.benchmarks import varlen
from mhsa.cli import build_parser


def test_long_tailed_lengths_fill_the_budget_within_bounds():
    lengths = varlen.long_tailed_lengths(16384, 16, 2048, 200)
    assert sum(lengths) <= 16384 and all(16 <= n <= 2048 for n in lengths)
    assert 100 <= sorted(lengths)[len(lengths) // 2] <= 400  # median about 200
    assert lengths == varlen.long_tailed_lengths(16384, 16, 2048, 200)  # seeded


def test_the_packed_and_padded_batches_hold_the_same_targets():
    packed, padded = varlen._batches([3, 1, 5])
    assert packed["idx"].shape == (1, 9) and padded["idx"].shape == (3, 5)
    real = padded["targets"][padded["targets"] != -100]
    assert sorted(real.tolist()) == sorted(packed["targets"][packed["targets"] != -100].tolist())
    assert len(real) == 2 + 0 + 4


def test_quick_size_runs_and_reports():
    speed = varlen.speed_case(varlen.QUICK, repeat=1)
    assert speed["tokens"] <= varlen.QUICK["budget"] and speed["speedup"] > 0
    assert speed["planning_share"] > 0
    memory = {kind: varlen.measure_memory(kind, 2, 32) for kind in ("packed", "batched")}
    assert all(row["seconds"] > 0 for row in memory.values())
    extra = {kind: row["extra_bytes"] for kind, row in memory.items()}
    result = {
        "speed": speed,
        "memory": {"segments": 2, "length": 32, "extra_bytes": extra, "ratio": 1.0},
        "threads": 1,
    }
    text = varlen.report(result)
    assert "packed / padded tokens/s" in text and "of the packed step" in text
    assert "memory: packed: boom" in varlen.report({**result, "memory": {"error": "packed: boom"}})


def test_the_suite_is_registered():
    args = build_parser().parse_args(["bench", "varlen", "--quick", "--repeat", "1"])
    assert args.quick and args.repeat == 1 and args.run.__name__ == "bench_varlen"
