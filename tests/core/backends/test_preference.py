"""What `auto` picks on CUDA, from the measured preference table (core/backends/
preference.py and the H200 run it cites). Chosen from AttentionSpecs alone: no GPU is
needed to check the choice."""

from __future__ import annotations

import pytest
import torch

from mhsa.core.backends import AttentionSpec, select
from mhsa.core.masks import SlidingWindow, bigbird
from mhsa.core.masks.base import part_kinds

pytest.importorskip("triton")


def _cuda_call(**changes) -> AttentionSpec:
    fields = dict(
        batch=4,
        num_heads=16,
        num_kv_heads=16,
        q_len=8192,
        kv_len=8192,
        head_dim=128,
        value_dim=128,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    return AttentionSpec.example(**{**fields, **changes})


@pytest.fixture
def cuda_seen(monkeypatch):
    """torch sees a GPU (the backends' available() asks), nothing else changes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize(
    ("call", "chosen"),
    [
        ({}, "sdpa"),  # dense: sdpa within 1% of the best
        ({"causal": True}, "sdpa"),  # causal: sdpa within 3%
        # the band kernels: 0.55x flex's time forward (gpu_band run in preference.py)
        ({"has_mask": True, "mask_kinds": part_kinds(SlidingWindow(1024, 0))}, "triton"),
        (
            {"has_mask": True, "causal": True, "mask_kinds": part_kinds(SlidingWindow(64, 64))},
            "triton",
        ),
        # ... and dense or causal calls with a score function or sinks, which sdpa cannot
        # serve, where no gradient is needed (flex led forward+backward); not where the
        # band kernels do not serve the call
        ({"causal": True, "has_score": True, "score_kinds": ("Softcap",)}, "triton"),
        ({"has_sinks": True}, "triton"),
        (
            {"causal": True, "has_score": True, "score_kinds": ("ALiBi",), "needs_grad": True},
            "flex",
        ),
        ({"has_mask": True, "needs_grad": True, "mask_kinds": ("SlidingWindow",)}, "triton"),
        # (a bias or dropout with a mask: the tile kernels, the only exact fused path)
        ({"has_mask": True, "has_bias": True, "mask_kinds": ("SlidingWindow",)}, "triton"),
        ({"has_mask": True, "dropout_p": 0.1, "mask_kinds": ("SlidingWindow",)}, "triton"),
        ({"has_mask": True, "value_dim": 64, "mask_kinds": ("SlidingWindow",)}, "flex"),
        ({"has_mask": True, "mask_kinds": part_kinds(SlidingWindow(4, 0) & bigbird(8))}, "flex"),
        ({"has_mask": True, "mask_kinds": part_kinds(bigbird(64))}, "triton"),  # 2.5x flex
        # not measured: causal or a score with a block pattern keep the fixed preference
        (
            {"has_mask": True, "causal": True, "mask_kinds": part_kinds(bigbird(64))},
            "flex",
        ),
        (
            {"has_mask": True, "has_score": True, "mask_kinds": part_kinds(bigbird(64))},
            "flex",
        ),
        # a tiny call: sdpa materialises it, whatever the pattern
        (
            {"has_mask": True, "q_len": 128, "kv_len": 128, "mask_kinds": part_kinds(bigbird(64))},
            "sdpa",
        ),
    ],
)
def test_auto_on_cuda_picks_the_measured_best(cuda_seen, call, chosen):
    assert select(_cuda_call(**call), "auto").name == chosen


def test_part_kinds_flatten_unions_and_ignore_tensors():
    assert part_kinds(bigbird(64)) == ("BlockBand", "GlobalTokens", "RandomBlocks")
    assert part_kinds(SlidingWindow(4, 0) & bigbird(8)) == (
        "SlidingWindow",
        "BlockBand",
        "GlobalTokens",
        "RandomBlocks",
    )
    assert part_kinds(None) == () and part_kinds(torch.ones(2, 2, dtype=torch.bool)) == ()
