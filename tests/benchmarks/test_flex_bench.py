"""`mhsa bench flex` on tiny shapes: every implementation runs (or says why not), the
outputs agree, and the report prints what is compared, the shapes and the ratios."""

from __future__ import annotations

import pytest

from mhsa.benchmarks import flex
from mhsa.benchmarks.timing import Setup

pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch: eager flex is slow


def test_cases_run_small_without_compiling(monkeypatch):
    not_made = Setup(None, None, "not compiled in this test")
    monkeypatch.setattr(flex, "_compiled", lambda *args: not_made)
    result = {"cases": [flex.run_case(case, 64, 2, 16, 1) for case in flex.CASES]}
    for row in result["cases"]:
        assert row["forward"]["mhsa"] > 0 and row["forward_backward"]["mhsa"] > 0
        assert row["max_difference"]["torch eager"] < 1e-5
        assert row["max_difference"][flex.NATIVE] < 1e-5  # the same call, mhsa's own API
        assert row["forward_backward"][flex.NATIVE] > 0
        # torch runs a CPU backward, or its error is reported (pytorch#148752)
        assert ("torch eager" in row["forward_backward"]) != bool(row["torch_backward_unavailable"])
    text = flex.report(result)
    assert "B=1 H=2 L=S=64 D=16" in text and "causal + relative bias table" in text
    assert "sliding window of 256" in text
    assert "torch compiled unavailable: not compiled in this test" in text
    assert "mhsa is" in text and "create_block_mask" in text


@pytest.mark.slow
def test_quick_run_compiles_torchs_flex_attention():
    result = flex.run(quick=True, heads=2, head_dim=16)
    for row in result["cases"]:
        if row["compiled_unavailable"] is None:
            assert row["max_difference"]["torch compiled"] < 1e-4
            assert row["forward"]["torch compiled"] > 0
    assert "L=S=256" in flex.report(result)
