"""Chunked(size): Llama 4's chunked causal pattern, dense vs block layout, its block plan
(no masked tile inside a chunk, none visited across chunks), every CPU backend and the
triton interpreter against the float64 reference, and transformers' own chunked mask."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import cpu_backends, make_qkv, max_error, reference_with_grads
from mhsa.core.kernels.plan import build_plan
from mhsa.core.masks import EMPTY, FULL, Chunked, KeyPadding, with_causal
from optional import needs

LENGTHS = [(203, 203), (113, 203), (1, 203), (203, 113)]


def by_definition(size: int, q_len: int, kv_len: int, start: int = 0) -> torch.Tensor:
    """Written out: query i at position start + i + S - L sees key j (at start + j) when
    j's position is at most its own and both lie in one chunk of `size` positions."""
    p = torch.arange(q_len).view(-1, 1) + start + kv_len - q_len
    k = torch.arange(kv_len).view(1, -1) + start
    return (k <= p) & (torch.floor(k / size) == torch.floor(p / size))


@pytest.mark.parametrize("size", [1, 16, 50, 64, 300])
@pytest.mark.parametrize("q_len, kv_len", LENGTHS)
def test_dense_is_the_definition_and_agrees_with_block_layout(size, q_len, kv_len):
    for start in (0, 37, -5):
        pattern = Chunked(size, start=start)
        dense = pattern.dense(q_len, kv_len)
        assert torch.equal(dense, by_definition(size, q_len, kv_len, start)), start
        for block_q, block_k in ((16, 16), (32, 64), (7, 13)):
            layout = pattern.block_layout(q_len, kv_len, block_q, block_k)
            for qi in range(layout.shape[0]):
                for kj in range(layout.shape[1]):
                    tile = dense[
                        qi * block_q : (qi + 1) * block_q, kj * block_k : (kj + 1) * block_k
                    ]
                    kind = int(layout[qi, kj])
                    assert kind != EMPTY or not tile.any(), (start, qi, kj)
                    assert kind != FULL or tile.all(), (start, qi, kj)
                    # exact: a tile that is all allowed or all not is said so
                    assert not tile.all() or kind == FULL, (start, qi, kj)
                    assert tile.any() or kind == EMPTY, (start, qi, kj)


def test_block_plan_takes_the_fast_path():
    """Chunks of 256 over 4096 tokens: the engine visits exactly the allowed entries
    (full blocks and causal triangles, no masked tile), and causal adds nothing."""
    pattern = Chunked(256)
    assert with_causal(pattern, True) is pattern
    assert (pattern & KeyPadding([5, 9])).within_causal
    assert not (pattern | KeyPadding([5, 9])).within_causal
    for gather in (True, False):
        plan = build_plan(pattern, 4096, 4096, block_q=128, block_k=128, gather=gather)
        allowed = pattern.dense(4096, 4096).double().mean().item()
        assert plan.visited_fraction == pytest.approx(allowed, rel=1e-9)
        runs = [run for row in plan.rows for run in row.runs]
        assert all(run.full or run.triangle == "lower" for run in runs)
    # the pieces: one per chunk, decoding from a cache (L != S, start) included
    for q_len, kv_len, start in ((4096, 4096, 0), (300, 1000, 0), (1, 1000, 0), (10, 200, 900)):
        pieces = Chunked(256, start=start).diagonal_pieces(q_len, kv_len)
        covered = torch.zeros(q_len, kv_len, dtype=torch.bool)
        for q0, q1, runs in pieces:
            for k0, k1, kind in runs:
                rows = torch.arange(q1 - q0).view(-1, 1)
                cols = torch.arange(k1 - k0).view(1, -1)
                covered[q0:q1, k0:k1] = (cols <= rows) if kind == "lower" else True
        assert torch.equal(covered, by_definition(256, q_len, kv_len, start))


def attend_and_compare(backend, q_len, kv_len, size, start=0, heads=(4, 2), dim=16):
    q, k, v = make_qkv(2, *heads, q_len, kv_len, dim, requires_grad=True)
    pattern = Chunked(size, start=start)
    out = mhsa.attention(q, k, v, pattern, causal=True, backend=backend)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    dense = by_definition(size, q_len, kv_len, start)
    ref, _, grads = reference_with_grads(q, k, v, dense, None, False, grad_out)
    assert max_error(out, ref) < 2e-5
    for got, want in zip((q, k, v), grads, strict=False):
        assert torch.isfinite(got.grad).all()
        assert max_error(got.grad, want) < 1e-4


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("q_len, kv_len", LENGTHS)
@pytest.mark.parametrize("size", [16, 64, 100])
def test_every_backend_equals_the_float64_reference(backend, q_len, kv_len, size):
    attend_and_compare(backend, q_len, kv_len, size)


@pytest.mark.parametrize("backend", cpu_backends())
def test_decoding_steps_with_a_shifted_start(backend):
    """A cache that dropped its first keys: key 0 at position 900."""
    attend_and_compare(backend, 3, 150, 64, start=900, heads=(2, 1), dim=59)


@pytest.mark.slow
def test_triton_interpreter_equals_the_float64_reference():
    needs("triton")
    attend_and_compare("triton", 113, 203, 32, heads=(2, 1))
    attend_and_compare("triton", 1, 70, 32, heads=(2, 2))


def test_equals_transformers_chunked_causal_mask():
    utils = needs("transformers.masking_utils")
    for size, q_len, kv_len, kv_offset in (
        (3, 12, 12, 0),
        (5, 4, 23, 0),
        (8, 1, 40, 0),
        (4, 2, 6, 9),
    ):
        q_offset = kv_offset + kv_len - q_len
        theirs = utils.sdpa_mask(
            batch_size=1,
            q_length=q_len,
            kv_length=kv_len,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=utils.chunked_causal_mask_function(size, torch.zeros(1, dtype=int)),
            allow_is_causal_skip=False,
        )
        ours = Chunked(size, start=kv_offset).dense(q_len, kv_len)
        assert torch.equal(theirs[0, 0], ours), (size, q_len, kv_len, kv_offset)


def test_bad_sizes_are_one_line_errors():
    for size in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="size must be an int >= 1") as error:
            Chunked(size)
        assert "\n" not in str(error.value)
    with pytest.raises(TypeError, match="start must be an int"):
        Chunked(8, start=1.5)
    assert repr(Chunked(8)) == "Chunked(8)" and repr(Chunked(8, start=3)) == "Chunked(8, start=3)"
    assert mhsa.masks.Chunked is Chunked
