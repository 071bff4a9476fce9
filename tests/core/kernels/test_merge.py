"""The logsumexp merge of partial results (mhsa.core.kernels.merge) has one
definition: checked here against float64 attention over all keys, and the source tree
is checked to hold no second copy and every engine to call it."""

from __future__ import annotations

import ast
import re

import pytest
import torch

from helpers import SOURCE, golden_attention, make_qkv, source_code
from mhsa.core.kernels.merge import merge_partials
from mhsa.core.masks.causal import causal_mask


def _split_keys(kv_len: int, cuts: list[int]) -> list[slice]:
    edges = [0, *cuts, kv_len]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cuts", [[3], [1, 2, 9], [0, 13], [5, 5, 11]])
def test_merging_parts_equals_attention_over_all_keys(causal, cuts):
    """Parts of the keys attended alone (float32) and merged equal the whole in float64;
    empty parts and rows that see nothing of a part are included."""
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 3, q_len=6, kv_len=13, head_dim=8, value_dim=5)
    mask = torch.rand(2, 1, 6, 13) > 0.4
    mask[0, 0, 2] = False  # a row with no key at all
    want_out, want_lse = golden_attention(q, k, v, mask, causal=causal)
    full = causal_mask(6, 13) if causal else torch.ones(6, 13, dtype=torch.bool)
    parts = []
    for cols in _split_keys(13, cuts):
        if cols.stop == cols.start:  # an empty part: no key, so out 0 and lse -inf
            parts.append((torch.zeros(2, 3, 6, 5), torch.full((2, 3, 6), -torch.inf)))
            continue
        part_mask = (mask & full)[..., cols]
        out, lse = golden_attention(q, k[:, :, cols], v[:, :, cols], part_mask)
        parts.append((out.float(), lse.float()))
    out, lse = merge_partials(parts)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=0)
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    assert bool(torch.isneginf(lse[0, :, 2]).all())


def test_merge_gradients_are_exact_and_zero_on_rows_with_no_key():
    torch.manual_seed(1)
    outs = [torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    lses = [torch.randn(2, 3, dtype=torch.float64) for _ in range(3)]
    for lse in lses:
        lse[0, 1] = -torch.inf  # row (0, 1) sees no key in any part
    lses[1][1, 2] = -torch.inf  # row (1, 2) sees nothing of part 1
    lses = [lse.requires_grad_() for lse in lses]

    def merged(*tensors):
        out, lse = merge_partials(list(zip(tensors[:3], tensors[3:], strict=True)))
        return out, torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)

    assert torch.autograd.gradcheck(merged, (*outs, *lses))
    out, lse = merge_partials(list(zip(outs, lses, strict=True)))
    (out.sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()).backward()
    for tensor in (*outs, *lses):
        assert torch.isfinite(tensor.grad).all()
        assert torch.equal(tensor.grad[0, 1], torch.zeros_like(tensor.grad[0, 1]))


def test_a_sink_is_a_part_without_a_value():
    """merge with (0, sink) is softmax with one more key whose value is 0."""
    torch.manual_seed(2)
    q, k, v = make_qkv(1, 2, q_len=3, kv_len=5, dtype=torch.float64)
    sinks = torch.tensor([0.3, -1.2], dtype=torch.float64)
    out, lse = golden_attention(q, k, v)
    merged, merged_lse = merge_partials([(out, lse), (out.new_zeros(()), sinks.view(1, -1, 1))])
    want_out, want_lse = golden_attention(q, k, v, sinks=sinks)
    torch.testing.assert_close(merged, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(merged_lse, want_lse, atol=1e-12, rtol=0)


def test_merge_needs_a_part():
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])


def test_the_merge_is_written_once_and_every_engine_calls_it():
    merging = re.compile(r"\blogaddexp\b|\blogsumexp\b")
    sources = source_code()
    offenders = [
        name
        for name, code in sources.items()
        if name != "core/kernels/merge.py" and merging.search(code)
    ]
    assert offenders == []
    callers = [
        "core/kernels/flash.py",
        "core/kernels/paged.py",
        "core/kernels/scored.py",
        "distributed/ring.py",
        "core/cluster.py",
    ]
    for name in callers:
        tree = ast.parse((SOURCE / name).read_text())
        called = {
            node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        assert "merge_partials" in called, name
