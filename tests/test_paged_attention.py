"""mhsa.paged_attention: the reference and tiled backends over a paged cache equal dense
causal attention (bottom-right per sequence) over each sequence's gathered keys."""

from __future__ import annotations

import math

import pytest
import torch

import mhsa
from helpers import golden_attention, max_error
from mhsa.kernels import paged as paged_kernels
from mhsa.positional import alibi_slopes
from mhsa.scores import ALiBi, RelativeBias, Softcap


def _paged(lengths, block_size, num_heads=4, num_kv_heads=2, q_len=1, head_dim=7, value_dim=5,
           dtype=torch.float64, num_blocks=None):  # fmt: skip
    """Random q (N, H, T, D), pools whose unused blocks hold NaN, a shuffled block
    table padded with -1, and each sequence's keys and values (1, H_kv, len, D) gathered
    by hand."""
    counts = [math.ceil(n / block_size) for n in lengths]
    num_blocks = num_blocks or sum(counts) + 3
    k_pool = torch.full((num_blocks, block_size, num_kv_heads, head_dim), torch.nan, dtype=dtype)
    v_pool = torch.full((num_blocks, block_size, num_kv_heads, value_dim), torch.nan, dtype=dtype)
    table = torch.full((len(lengths), max(counts) + 1), -1, dtype=torch.long)
    ids, keys, values = torch.randperm(num_blocks).tolist(), [], []
    for n, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        blocks, ids = ids[:count], ids[count:]
        table[n, :count] = torch.tensor(blocks, dtype=torch.long)
        k = torch.randn(1, num_kv_heads, length, head_dim, dtype=dtype)
        v = torch.randn(1, num_kv_heads, length, value_dim, dtype=dtype)
        for j in range(length):  # slots past a sequence's length stay NaN
            k_pool[blocks[j // block_size], j % block_size] = k[0, :, j]
            v_pool[blocks[j // block_size], j % block_size] = v[0, :, j]
        keys.append(k)
        values.append(v)
    q = torch.randn(len(lengths), num_heads, q_len, head_dim, dtype=dtype)
    return q, k_pool, v_pool, table, keys, values


def _golden(q, keys, values, lengths, window=None, modify=None, scale=None):
    """Each sequence alone: dense causal attention over its keys (float64)."""
    outs = []
    for n, length in enumerate(lengths):
        q_len = q.shape[2]
        mask = None
        if window is not None:
            rows = torch.arange(length - q_len, length).view(-1, 1)
            mask = torch.arange(length).view(1, -1) >= rows - window
        outs.append(golden_attention(q[n : n + 1], keys[n], values[n], mask, causal=True,
                                     modify=modify, scale=scale)[0])  # fmt: skip
    return torch.cat(outs)


CASES = {
    "block 16, decode": (16, [1, 17, 40, 33, 113], 1),
    "block 5, decode": (5, [5, 7, 203, 33], 1),
    "block 5, 3 new tokens": (5, [7, 17, 40, 4], 3),
    "block 16, a prefill chunk": (16, [113], 40),
    "block 16, chunks of different prompts": (16, [30, 90, 57], 30),
}


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_equals_dense_causal_attention(backend, case, num_kv_heads):
    block_size, lengths, q_len = CASES[case]
    q, k_pool, v_pool, table, keys, values = _paged(lengths, block_size, q_len=q_len,
                                                    num_kv_heads=num_kv_heads)  # fmt: skip
    for tile_size in (256, 16):  # one tile and many (whole pages: 16 keys, or 15 of 5)
        out = mhsa.paged_attention(q, k_pool, v_pool, table, torch.tensor(lengths),
                                   backend=backend, tile_size=tile_size)  # fmt: skip
        assert out.shape == (len(lengths), 4, q_len, 5) and out.dtype == torch.float64
        assert max_error(out, _golden(q, keys, values, lengths)) < 1e-12


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_window_scale_and_score_functions_at_each_sequences_positions(backend):
    lengths, q_len = [9, 40, 23], 4
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 5, q_len=q_len)
    slopes = alibi_slopes(4).double()
    table_t5 = torch.randn(8, 4, dtype=torch.float64)
    alibi = ALiBi(slopes).then(Softcap(3.0))
    t5 = RelativeBias(table_t5, num_buckets=8, max_distance=16, bidirectional=False)

    def alibi_softcap(s, i, j):
        return torch.tanh((s - slopes.view(1, -1, 1, 1) * (i - j).abs()) / 3.0) * 3.0

    def t5_bias(s, i, j):
        return s + t5.table[t5_bucket(j - i)].permute(2, 0, 1).unsqueeze(0)

    def t5_bucket(offsets):
        from mhsa.scores import t5_bucket as bucket

        return bucket(offsets, 8, 16, False)

    for score, modify in ((alibi, alibi_softcap), (t5, t5_bias)):
        for window in (None, 0, 6):
            out = mhsa.paged_attention(q, k_pool, v_pool, table, lengths, scale=0.3, score=score,
                                       window=window, backend=backend, tile_size=10)  # fmt: skip
            want = _golden(q, keys, values, lengths, window, modify, scale=0.3)
            assert max_error(out, want) < 1e-12


def test_long_prefills_go_through_in_query_chunks(monkeypatch):
    monkeypatch.setattr(paged_kernels, "QUERY_CHUNK", 7)
    lengths = [50, 31]
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 5, q_len=30)
    for window in (None, 8):
        out = mhsa.paged_attention(q, k_pool, v_pool, table, lengths, window=window,
                                   backend="tiled", tile_size=10)  # fmt: skip
        assert max_error(out, _golden(q, keys, values, lengths, window)) < 1e-12


def test_queries_without_keys_get_zero_and_float32_is_close():
    lengths = [2, 12]  # sequence 0 has fewer keys than queries: its first rows see none
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 4, q_len=3)
    for backend in ("reference", "tiled"):
        out = mhsa.paged_attention(q, k_pool, v_pool, table, lengths, backend=backend)
        assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))
        assert max_error(out[1:], _golden(q[1:], keys[1:], values[1:], lengths[1:])) < 1e-12
    lengths = [30, 3, 17]
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 16, q_len=2)
    want = _golden(q, keys, values, lengths)
    pools = [t.float().nan_to_num() for t in (q, k_pool, v_pool)]
    for backend in ("reference", "tiled"):
        out = mhsa.paged_attention(*pools, table, lengths, backend=backend)
        assert out.dtype == torch.float32 and max_error(out, want) < 1e-5


def test_reference_backend_is_differentiable():
    lengths = [6, 3]
    q, k_pool, v_pool, table, _, _ = _paged(lengths, 4, q_len=2, head_dim=3, value_dim=2)
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()
    inputs = [t.clone().requires_grad_() for t in (q, k_pool, v_pool)]

    def call(q, k, v):
        return mhsa.paged_attention(q, k, v, table, lengths, backend="reference")

    assert torch.autograd.gradcheck(call, inputs)
    assert torch.equal(mhsa.paged_attention(*inputs, table, lengths), call(*inputs))  # auto
    with pytest.raises(ValueError, match="inference"):
        mhsa.paged_attention(*inputs, table, lengths, backend="tiled")


def test_bad_inputs_raise_clear_errors():
    q, k_pool, v_pool, table, _, _ = _paged([5, 9], 4)
    lengths = [5, 9]
    call = mhsa.paged_attention
    cases = [
        ((q[0], k_pool, v_pool, table, lengths), ValueError, "q must be a 4-D float"),
        ((q, k_pool.float(), v_pool, table, lengths), TypeError, "share one dtype"),
        ((q, k_pool, v_pool[:, :3], table, lengths), ValueError, "v_pool must be"),
        ((q, k_pool[..., :3], v_pool, table, lengths), ValueError, "head_dim 7"),
        ((q[:, :3], k_pool, v_pool, table, lengths), ValueError, "multiple of"),
        ((q, k_pool, v_pool, table[:1], lengths), ValueError, "block_table must be a"),
        ((q, k_pool, v_pool, table.float(), lengths), TypeError, "integer block ids"),
        ((q, k_pool, v_pool, table, [5]), ValueError, "lengths must hold 2"),
        ((q, k_pool, v_pool, table, [5, 17]), ValueError, r"lengths must be in 0\.\.16"),
        ((q, k_pool, v_pool, table, torch.tensor([5.0, 9.0])), TypeError, "lengths must be"),
        ((q, k_pool, v_pool, table + 100, lengths), ValueError, "block_table's blocks"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            call(*args)
    for kwargs, message in (({"backend": "flash"}, "backend must be one of"),
                            ({"window": -1}, "window must be"),
                            ({"tile_size": 0}, "tile_size must be"),
                            ({"scale": -1.0}, "scale must be")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call(q, k_pool, v_pool, table, lengths, **kwargs)
