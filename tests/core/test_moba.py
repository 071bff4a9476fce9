"""MoBA: equal to dense attention under the same block choice as an explicit mask (out,
lse, gradients), causal when every block is chosen, its block plan visits only the
chosen tiles, and its SelectedBlocks pattern is exact at every tile size."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import golden_attention, make_qkv, max_error
from mhsa.core.backends.flash_plan import plan_for
from mhsa.core.masks import SelectedBlocks
from mhsa.core.masks.blocks import reduce_blocks
from mhsa.core.moba import moba_mask, moba_select
from mhsa.nn import MoBA

# (B, H, H_kv, L, S, D, block_size, top_k): awkward lengths, L != S, GQA, L = 1
CASES = [
    (2, 4, 2, 203, 203, 16, 32, 2),
    (1, 2, 2, 113, 150, 8, 16, 3),
    (2, 2, 1, 64, 64, 8, 16, 1),
    (1, 3, 3, 100, 100, 8, 7, 4),
    (2, 2, 2, 1, 45, 8, 8, 2),
]


def inputs(case, dtype=torch.float64):
    batch, heads, kv_heads, q_len, kv_len, dim, _, _ = case
    torch.manual_seed(q_len + kv_len)
    return make_qkv(batch, heads, kv_heads, q_len, kv_len, dim, dtype=dtype, requires_grad=True)


def with_grads(out, lse, tensors, seed=0):
    generator = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    grad_lse = torch.randn(lse.shape, generator=generator, dtype=lse.dtype)
    alive = torch.isfinite(lse)
    loss = (out * grad_out).sum() + (lse.where(alive, 0) * grad_lse).sum()
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_equals_dense_attention_with_the_same_selection_as_a_mask(case):
    q, k, v = inputs(case)
    block_size, top_k = case[-2:]
    out, lse = mhsa.moba_attention(q, k, v, block_size, top_k, return_lse=True)
    mask = moba_mask(q, k, block_size, top_k)  # (B, H, L, S), True = may attend
    want_out, want_lse = golden_attention(q, k, v, mask)
    assert max_error(out, want_out) < 1e-5 and max_error(lse, want_lse) < 1e-5
    got_grads = with_grads(out, lse, (q, k, v))
    for got, want in zip(got_grads, with_grads(want_out, want_lse, (q, k, v)), strict=True):
        assert max_error(got, want) < 1e-5


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "x".join(map(str, c)))
def test_float32_on_the_engine_within_float32_error_of_the_golden_answer(case):
    q, k, v = inputs(case, torch.float32)
    out, lse = mhsa.moba_attention(q, k, v, *case[-2:], return_lse=True)
    want_out, want_lse = golden_attention(q, k, v, moba_mask(q, k, *case[-2:]))
    assert max_error(out, want_out) < 1e-5 and max_error(lse, want_lse) < 1e-5


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_choosing_every_block_is_causal_attention(case):
    q, k, v = inputs(case)
    block_size = case[-2]
    every = -(-k.shape[2] // block_size)
    out, lse = mhsa.moba_attention(q, k, v, block_size, every, return_lse=True)
    want_out, want_lse = golden_attention(q, k, v, causal=True)
    assert max_error(out, want_out) < 1e-5 and max_error(lse, want_lse) < 1e-5


def test_the_choice_is_the_top_k_earlier_blocks_by_mean_query_and_key():
    torch.manual_seed(0)
    q, k, _ = make_qkv(1, 2, 2, 40, 40, 8, dtype=torch.float64)
    chosen = moba_select(q, k, 8, 2)  # 5 blocks
    q_means = q.view(1, 2, 5, 8, 8).mean(3)
    k_means = k.view(1, 2, 5, 8, 8).mean(3)
    scores = q_means @ k_means.transpose(-1, -2)
    for head in range(2):
        for block in range(5):
            earlier = scores[0, head, block, :block]
            want = set(earlier.topk(min(2, block)).indices.tolist())
            assert set(chosen[0, head, block].nonzero().flatten().tolist()) == want


def test_the_plan_visits_only_the_chosen_tiles():
    """One (batch, head)'s plan on the fused kernel's tiles: the own block's triangle
    and the chosen blocks, unmasked; nothing else."""
    chosen = torch.zeros(8, 8, dtype=torch.bool)
    chosen[5, [0, 3]] = True
    chosen[7, [1, 2, 6]] = True
    pattern = SelectedBlocks(chosen, 64)
    plan = plan_for(pattern, False, 512, 512, "cpu", fused=True)
    runs = {row.q0 // 64: row.runs for row in plan.rows}
    assert all(run.triangle == "lower" for run in (r[0] for r in runs.values()))
    assert runs[5][1].blocks == (0, 3) and runs[5][1].full
    assert runs[7][1].blocks == (1, 2, 6) and runs[7][1].full
    assert sum(len(r) for r in runs.values()) == 8 + 2
    visited = (8 * (64 * 65 // 2) + 5 * 64 * 64) / 512**2
    assert plan.visited_fraction == pytest.approx(visited)


@pytest.mark.parametrize(
    ("q_len", "kv_len", "block", "block_q", "block_k"),
    [(203, 203, 32, 32, 32), (203, 203, 32, 128, 128), (150, 203, 16, 8, 24), (100, 100, 7, 3, 5)],
)
def test_selected_blocks_kinds_equal_the_reduced_dense_mask(q_len, kv_len, block, block_q, block_k):
    torch.manual_seed(block_q)
    n = -(-kv_len // block)
    pattern = SelectedBlocks(torch.rand(2, 3, n, n) > 0.5, block)
    want = reduce_blocks(pattern.dense(q_len, kv_len), q_len, kv_len, block_q, block_k)
    assert torch.equal(pattern.kinds(q_len, kv_len, block_q, block_k), want)


def test_cached_moba_equals_full_recompute_when_each_call_fills_whole_blocks():
    torch.manual_seed(0)
    module = MoBA(32, 4, block_size=4, top_k=2, num_kv_heads=2).double()
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    cache = mhsa.KVCache(2, 2, 16, 8, dtype=torch.float64)
    steps = [module(x[:, :8], cache=cache), module(x[:, 8:12], cache=cache)]
    steps.append(module(x[:, 12:], cache=cache))
    assert max_error(torch.cat(steps, 1), module(x)) < 1e-10


@pytest.mark.parametrize("top_k", [0, -1, 5, 2.0, True])
def test_top_k_outside_one_to_the_number_of_blocks_is_an_error(top_k):
    q, k, v = make_qkv(1, 2, 2, 30, 30, 8)
    with pytest.raises(ValueError, match=r"top_k must be an int in 1\.\.4") as error:
        mhsa.moba_attention(q, k, v, 8, top_k)
    assert "\n" not in str(error.value)


def test_other_bad_arguments_name_themselves():
    q, k, v = make_qkv(1, 2, 2, 30, 20, 8)
    with pytest.raises(ValueError, match="L <= S"):
        mhsa.moba_attention(q, k, v, 8, 1)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        mhsa.moba_attention(q, k, v, 0, 1)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        MoBA(16, 2, block_size=4, top_k=0)
    with pytest.raises(ValueError, match="MoBA is causal"):
        MoBA(16, 2, block_size=4, top_k=1)(torch.randn(1, 5, 16), causal=False)
