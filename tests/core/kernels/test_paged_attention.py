"""mhsa.attention over paged keys (block_table=, seq_lens=): the reference backend and
flash's tiled paged engine equal dense causal attention (bottom-right per sequence) over
each sequence's gathered keys; the registry says which backends serve paged keys."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import max_error, paged_call, paged_case, paged_golden
from mhsa.core.kernels import paged as paged_kernels
from mhsa.core.masks import SlidingWindow
from mhsa.core.scores import ALiBi, RelativeBias, Softcap
from mhsa.nn.positional import alibi_slopes

CASES = {
    "block 16, decode": (16, [1, 17, 40, 33, 113], 1),
    "block 5, decode": (5, [5, 7, 203, 33], 1),
    "block 5, 3 new tokens": (5, [7, 17, 40, 4], 3),
    "block 16, a prefill chunk": (16, [113], 40),
    "block 16, chunks of different prompts": (16, [30, 90, 57], 30),
}


@pytest.mark.parametrize("backend", ["reference", "flash"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_equals_dense_causal_attention(backend, case, num_kv_heads, monkeypatch):
    block_size, lengths, q_len = CASES[case]
    q, k_pool, v_pool, table, keys, values = paged_case(
        lengths, block_size, q_len=q_len, num_kv_heads=num_kv_heads
    )
    for tile_size in (256, 16):  # one tile and many (whole pages: 16 keys, or 15 of 5)
        monkeypatch.setattr(paged_kernels, "TILE_SIZE", tile_size)
        out = paged_call(q, k_pool, v_pool, table, torch.tensor(lengths), backend=backend)
        assert out.shape == (len(lengths), 4, q_len, 5) and out.dtype == torch.float64
        assert max_error(out, paged_golden(q, keys, values, lengths)) < 1e-12


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_window_scale_and_score_functions_at_each_sequences_positions(backend, monkeypatch):
    monkeypatch.setattr(paged_kernels, "TILE_SIZE", 10)
    lengths, q_len = [9, 40, 23], 4
    q, k_pool, v_pool, table, keys, values = paged_case(lengths, 5, q_len=q_len)
    slopes = alibi_slopes(4).double()
    table_t5 = torch.randn(8, 4, dtype=torch.float64)
    alibi = ALiBi(slopes).then(Softcap(3.0))
    t5 = RelativeBias(table_t5, num_buckets=8, max_distance=16, bidirectional=False)

    def alibi_softcap(s, i, j):
        return torch.tanh((s - slopes.view(1, -1, 1, 1) * (i - j).abs()) / 3.0) * 3.0

    def t5_bias(s, i, j):
        return s + t5.table[t5_bucket(j - i)].permute(2, 0, 1).unsqueeze(0)

    def t5_bucket(offsets):
        from mhsa.core.scores import t5_bucket as bucket

        return bucket(offsets, 8, 16, False)

    for score, modify in ((alibi, alibi_softcap), (t5, t5_bias)):
        for window in (None, 0, 6):
            out = paged_call(
                q, k_pool, v_pool, table, lengths, window, scale=0.3, score=score, backend=backend
            )
            want = paged_golden(q, keys, values, lengths, window, modify, scale=0.3)
            assert max_error(out, want) < 1e-12


def test_long_prefills_go_through_in_query_chunks(monkeypatch):
    monkeypatch.setattr(paged_kernels, "QUERY_CHUNK", 7)
    monkeypatch.setattr(paged_kernels, "TILE_SIZE", 10)
    lengths = [50, 31]
    q, k_pool, v_pool, table, keys, values = paged_case(lengths, 5, q_len=30)
    for window in (None, 8):
        out = paged_call(q, k_pool, v_pool, table, lengths, window, backend="flash")
        assert max_error(out, paged_golden(q, keys, values, lengths, window)) < 1e-12


@pytest.mark.parametrize("q_len", [1, 3, 40])
def test_nan_in_unwritten_slots_never_reaches_the_fused_kernels_answer(q_len):
    """D == D_v without a score function runs PyTorch's fused kernel, which adds its
    -inf mask to the scores: nan keys past a sequence's end must not get there."""
    lengths = [45, 7, 30]
    q, k_pool, v_pool, table, keys, values = paged_case(lengths, 16, q_len=q_len, value_dim=7)
    out = paged_call(q, k_pool, v_pool, table, lengths, backend="flash")
    assert max_error(out, paged_golden(q, keys, values, lengths)) < 1e-12


def test_gather_pages_zeroes_the_unwritten_slots_by_index_or_by_mask():
    """The CPU path names the slots to zero by index, a GPU one by a bool mask (no
    nonzero, which would wait for the device): both zero exactly those slots."""
    pool = torch.randn(6, 4, 2, 3)  # 6 blocks of 4 slots
    before = pool.clone()
    table = torch.tensor([[5, 1], [0, 3]])
    mask = torch.zeros(2, 8, dtype=torch.bool)  # (sequence, key)
    mask[0, 6:] = mask[1, 3:5] = mask[1, 7] = True
    keys = torch.stack([torch.cat([pool[b] for b in row]) for row in table])  # (2, 8, H_kv, 3)
    want = keys.masked_fill(mask.view(2, 8, 1, 1), 0).transpose(1, 2)
    for unwritten in (mask.view(-1), mask.view(-1).nonzero().view(-1)):
        assert torch.equal(paged_kernels.gather_pages(pool, table, unwritten), want)
    assert torch.equal(pool, before)  # the gathered copy is zeroed, never the pool


def test_queries_without_keys_get_zero_and_float32_is_close():
    lengths = [2, 12]  # sequence 0 has fewer keys than queries: its first rows see none
    q, k_pool, v_pool, table, keys, values = paged_case(lengths, 4, q_len=3)
    for backend in ("reference", "flash"):
        out = paged_call(q, k_pool, v_pool, table, lengths, backend=backend)
        assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))
        assert max_error(out[1:], paged_golden(q[1:], keys[1:], values[1:], lengths[1:])) < 1e-12
    lengths = [30, 3, 17]
    q, k_pool, v_pool, table, keys, values = paged_case(lengths, 16, q_len=2)
    want = paged_golden(q, keys, values, lengths)
    pools = [t.float().nan_to_num() for t in (q, k_pool, v_pool)]
    for backend in ("reference", "flash"):
        out = paged_call(*pools, table, lengths, backend=backend)
        assert out.dtype == torch.float32 and max_error(out, want) < 1e-5


@pytest.mark.parametrize("lengths", [[5, 7, 0, 33], [0, 0], [0, 9]])
def test_empty_sequences_in_a_batch_get_zero_and_the_others_their_answer(lengths):
    """(Before: the fused kernel sized its output from the first tile's sequences, so a
    batch holding an empty one came out (N, H, T, 12) instead of (N, H, T, 16).)"""
    q, k_pool, v_pool, table, keys, values = paged_case(
        [max(n, 1) for n in lengths], 4, num_heads=3, num_kv_heads=1, head_dim=16, value_dim=16
    )
    for backend in ("reference", "flash"):
        out = paged_call(q, k_pool, v_pool, table, lengths, backend=backend)
        assert out.shape == (len(lengths), 3, 1, 16)
        for n, length in enumerate(lengths):
            if length == 0:
                assert torch.equal(out[n], torch.zeros_like(out[n])), backend
            else:
                want = paged_golden(q[n : n + 1], keys[n : n + 1], values[n : n + 1], [length])
                assert max_error(out[n : n + 1], want) < 1e-12, backend


def test_reference_backend_is_differentiable():
    lengths = [6, 3]
    q, k_pool, v_pool, table, _, _ = paged_case(lengths, 4, q_len=2, head_dim=3, value_dim=2)
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()
    inputs = [t.clone().requires_grad_() for t in (q, k_pool, v_pool)]

    def call(q, k, v):
        return paged_call(q, k, v, table, lengths, backend="reference")

    assert torch.autograd.gradcheck(call, inputs)
    assert torch.equal(paged_call(*inputs, table, lengths), call(*inputs))  # auto
    with pytest.raises(ValueError, match="inference"):
        paged_call(*inputs, table, lengths, backend="flash")
    with torch.no_grad():  # without gradients auto takes flash's tiled engine
        assert max_error(paged_call(*inputs, table, lengths), call(*inputs)) < 1e-12


def test_bad_inputs_raise_clear_errors(monkeypatch):
    q, k_pool, v_pool, table, _, _ = paged_case([5, 9], 4)
    lengths = [5, 9]
    call = paged_call
    cases = [
        ((q[0], k_pool, v_pool, table, lengths), ValueError, "q must be a 4-D float"),
        ((q, k_pool.float(), v_pool, table, lengths), TypeError, "share one dtype"),
        ((q, k_pool, v_pool[:, :3], table, lengths), ValueError, "v_pool must be"),
        ((q, k_pool[..., :3], v_pool, table, lengths), ValueError, "head_dim 7"),
        ((q[:, :3], k_pool, v_pool, table, lengths), ValueError, "multiple of"),
        ((q, k_pool, v_pool, table[:1], lengths), ValueError, "block_table must be a"),
        ((q, k_pool, v_pool, table.float(), lengths), TypeError, "integer block ids"),
        ((q, k_pool, v_pool, table, [5]), ValueError, "seq_lens must hold 2"),
        ((q, k_pool, v_pool, table, [5, 17]), ValueError, r"seq_lens must be in 0\.\.16"),
        ((q, k_pool, v_pool, table, torch.tensor([5.0, 9.0])), TypeError, "seq_lens must be"),
        ((q, k_pool, v_pool, table + 100, lengths), ValueError, "block_table's blocks"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            call(*args)
    for kwargs, message in (
        ({"backend": "sdpa"}, "backend 'sdpa' cannot serve.*paged"),
        ({"backend": "tiled"}, "backend must be 'auto' or one of"),
        ({"window": -1}, "left must be"),
        ({"scale": -1.0}, "scale must be"),
        ({"bias": torch.zeros(1)}, "takes no bias"),
        ({"return_lse": True}, "got return_lse"),
    ):
        with pytest.raises(ValueError, match=message):
            call(q, k_pool, v_pool, table, lengths, **kwargs)
    # one query sees every key causal or not; two must be causal
    assert torch.equal(
        call(q, k_pool, v_pool, table, lengths, causal=False),
        call(q, k_pool, v_pool, table, lengths),
    )
    with pytest.raises(ValueError, match="attends causally"):
        call(torch.cat([q, q], dim=2), k_pool, v_pool, table, lengths, causal=False)
    with pytest.raises(ValueError, match="attends causally"):  # a pattern other than a window
        mhsa.attention(q, k_pool, v_pool, SlidingWindow(2, 2), block_table=table, seq_lens=lengths)
    with pytest.raises(ValueError, match="block_table needs seq_lens"):
        mhsa.attention(q, k_pool, v_pool, causal=True, block_table=table)
    with pytest.raises(ValueError, match="seq_lens goes with block_table"):
        mhsa.attention(q, k_pool, v_pool, causal=True, seq_lens=lengths)
    monkeypatch.setattr(paged_kernels, "TILE_SIZE", 0)
    with pytest.raises(ValueError, match="tile_size must be"):
        call(q, k_pool, v_pool, table, lengths, backend="flash")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (2, 1)], ids=["gqa3", "mha", "mqa2"])
def test_each_query_rows_result_is_independent_of_the_others_in_the_call(heads, threads):
    """float32 on the fused CPU kernel: a query row gives bitwise the same output
    computed alone (a decoding step), in a verification of a few drafts, in a prefill
    after a cached prefix or in a whole prompt (the kernel computes blocks of fewer than
    4 rows another way, and splits rows by the thread count: fused_row_blocks pads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_rows_independent(*heads)
    finally:
        torch.set_num_threads(before)


def _check_rows_independent(num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    length, block_size = 300, 16
    k_pool = torch.randn(24, block_size, num_kv_heads, 64)
    v_pool = torch.randn(24, block_size, num_kv_heads, 64)
    table = torch.randperm(24)[:19].view(1, -1)
    q = torch.randn(1, num_heads, 80, 64)  # queries at positions 220..299

    def rows(first: int, count: int) -> torch.Tensor:
        call = paged_kernels.PagedCall(
            q[:, :, first : first + count],
            k_pool,
            v_pool,
            table,
            [length - 80 + first + count],
            0.125,
        )
        return paged_kernels.paged_tiled(call)

    alone = torch.cat([rows(i, 1) for i in range(80)], dim=2)
    for first, count in ((0, 80), (0, 33), (5, 2), (40, 3), (70, 10), (79, 1), (11, 45)):
        assert torch.equal(rows(first, count), alone[:, :, first : first + count])
