"""`mhsa bench moba --quick`: both sides run (time and peak memory) and the report
states what was compared; no timing is asserted."""

from __future__ import annotations

import json

import torch

from mhsa.benchmarks import moba
from mhsa.benchmarks.moba import computed_fraction
from mhsa.cli import main


def test_quick_run_measures_both_sides(capsys):
    assert main(["bench", "moba", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["length"] == 1024 and result["block_size"] == 128 and result["top_k"] == 3
    assert set(result["seconds"]) == {"moba", "dense causal"}
    assert all(value > 0 for value in result["extra_bytes"].values()), result
    # 8 blocks, top-3: own triangles plus 0 + 1 + 2 + 3 * 5 chosen blocks
    pairs = 8 * 128 * 129 / 2 + 18 * 128**2
    assert abs(result["computed_fraction"] - pairs / (1024 * 1025 / 2)) < 1e-9
    text = moba.report(result)
    assert "L=S=1024, blocks of 128, top-3" in text and "dense causal" in text


def test_computed_fraction_counts_a_short_last_block():
    chosen = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    chosen[0, 0, 2, 0] = True  # blocks of 4, 4 and 2 positions
    pairs = 10 + 10 + 3 + 2 * 4
    assert abs(computed_fraction(chosen, 10, 4) - pairs / 55) < 1e-12
