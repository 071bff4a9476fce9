"""mhsa.attention over paged keys (block_table=, seq_lens=): the reference backend and
flash's tiled paged engine equal dense causal attention (bottom-right per sequence) over
each sequence's gathered keys; the registry says which backends serve paged keys."""

from __future__ import annotations

import math

import pytest
import torch

import mhsa
from helpers import golden_attention, max_error
from mhsa.core.backends import AttentionSpec, get, names
from mhsa.core.kernels import paged as paged_kernels
from mhsa.core.masks import SlidingWindow
from mhsa.core.scores import ALiBi, RelativeBias, Softcap
from mhsa.nn.positional import alibi_slopes


def _paged(
    lengths,
    block_size,
    num_heads=4,
    num_kv_heads=2,
    q_len=1,
    head_dim=7,
    value_dim=5,
    dtype=torch.float64,
    num_blocks=None,
):
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
        outs.append(
            golden_attention(
                q[n : n + 1], keys[n], values[n], mask, causal=True, modify=modify, scale=scale
            )[0]
        )
    return torch.cat(outs)


CASES = {
    "block 16, decode": (16, [1, 17, 40, 33, 113], 1),
    "block 5, decode": (5, [5, 7, 203, 33], 1),
    "block 5, 3 new tokens": (5, [7, 17, 40, 4], 3),
    "block 16, a prefill chunk": (16, [113], 40),
    "block 16, chunks of different prompts": (16, [30, 90, 57], 30),
}


def paged(q, k_pool, v_pool, table, lengths, window=None, **options):
    """mhsa.attention over the pages, causal, within SlidingWindow(window, 0) if given."""
    mask = None if window is None else SlidingWindow(window, 0)
    options = {"causal": True, **options}
    return mhsa.attention(q, k_pool, v_pool, mask, block_table=table, seq_lens=lengths, **options)


@pytest.mark.parametrize("backend", ["reference", "flash"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_equals_dense_causal_attention(backend, case, num_kv_heads, monkeypatch):
    block_size, lengths, q_len = CASES[case]
    q, k_pool, v_pool, table, keys, values = _paged(
        lengths, block_size, q_len=q_len, num_kv_heads=num_kv_heads
    )
    for tile_size in (256, 16):  # one tile and many (whole pages: 16 keys, or 15 of 5)
        monkeypatch.setattr(paged_kernels, "TILE_SIZE", tile_size)
        out = paged(q, k_pool, v_pool, table, torch.tensor(lengths), backend=backend)
        assert out.shape == (len(lengths), 4, q_len, 5) and out.dtype == torch.float64
        assert max_error(out, _golden(q, keys, values, lengths)) < 1e-12


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_window_scale_and_score_functions_at_each_sequences_positions(backend, monkeypatch):
    monkeypatch.setattr(paged_kernels, "TILE_SIZE", 10)
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
        from mhsa.core.scores import t5_bucket as bucket

        return bucket(offsets, 8, 16, False)

    for score, modify in ((alibi, alibi_softcap), (t5, t5_bias)):
        for window in (None, 0, 6):
            out = paged(
                q, k_pool, v_pool, table, lengths, window, scale=0.3, score=score, backend=backend
            )
            want = _golden(q, keys, values, lengths, window, modify, scale=0.3)
            assert max_error(out, want) < 1e-12


def test_long_prefills_go_through_in_query_chunks(monkeypatch):
    monkeypatch.setattr(paged_kernels, "QUERY_CHUNK", 7)
    monkeypatch.setattr(paged_kernels, "TILE_SIZE", 10)
    lengths = [50, 31]
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 5, q_len=30)
    for window in (None, 8):
        out = paged(q, k_pool, v_pool, table, lengths, window, backend="flash")
        assert max_error(out, _golden(q, keys, values, lengths, window)) < 1e-12


@pytest.mark.parametrize("q_len", [1, 3, 40])
def test_nan_in_unwritten_slots_never_reaches_the_fused_kernels_answer(q_len):
    """D == D_v without a score function runs PyTorch's fused kernel, which adds its
    -inf mask to the scores: nan keys past a sequence's end must not get there."""
    lengths = [45, 7, 30]
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 16, q_len=q_len, value_dim=7)
    out = paged(q, k_pool, v_pool, table, lengths, backend="flash")
    assert max_error(out, _golden(q, keys, values, lengths)) < 1e-12


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
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 4, q_len=3)
    for backend in ("reference", "flash"):
        out = paged(q, k_pool, v_pool, table, lengths, backend=backend)
        assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))
        assert max_error(out[1:], _golden(q[1:], keys[1:], values[1:], lengths[1:])) < 1e-12
    lengths = [30, 3, 17]
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 16, q_len=2)
    want = _golden(q, keys, values, lengths)
    pools = [t.float().nan_to_num() for t in (q, k_pool, v_pool)]
    for backend in ("reference", "flash"):
        out = paged(*pools, table, lengths, backend=backend)
        assert out.dtype == torch.float32 and max_error(out, want) < 1e-5


@pytest.mark.parametrize("lengths", [[5, 7, 0, 33], [0, 0], [0, 9]])
def test_empty_sequences_in_a_batch_get_zero_and_the_others_their_answer(lengths):
    """(Before: the fused kernel sized its output from the first tile's sequences, so a
    batch holding an empty one came out (N, H, T, 12) instead of (N, H, T, 16).)"""
    q, k_pool, v_pool, table, keys, values = _paged(
        [max(n, 1) for n in lengths], 4, num_heads=3, num_kv_heads=1, head_dim=16, value_dim=16
    )
    for backend in ("reference", "flash"):
        out = paged(q, k_pool, v_pool, table, lengths, backend=backend)
        assert out.shape == (len(lengths), 3, 1, 16)
        for n, length in enumerate(lengths):
            if length == 0:
                assert torch.equal(out[n], torch.zeros_like(out[n])), backend
            else:
                want = _golden(q[n : n + 1], keys[n : n + 1], values[n : n + 1], [length])
                assert max_error(out[n : n + 1], want) < 1e-12, backend


def test_reference_backend_is_differentiable():
    lengths = [6, 3]
    q, k_pool, v_pool, table, _, _ = _paged(lengths, 4, q_len=2, head_dim=3, value_dim=2)
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()
    inputs = [t.clone().requires_grad_() for t in (q, k_pool, v_pool)]

    def call(q, k, v):
        return paged(q, k, v, table, lengths, backend="reference")

    assert torch.autograd.gradcheck(call, inputs)
    assert torch.equal(paged(*inputs, table, lengths), call(*inputs))  # auto
    with pytest.raises(ValueError, match="inference"):
        paged(*inputs, table, lengths, backend="flash")
    with torch.no_grad():  # without gradients auto takes flash's tiled engine
        assert max_error(paged(*inputs, table, lengths), call(*inputs)) < 1e-12


def test_bad_inputs_raise_clear_errors(monkeypatch):
    q, k_pool, v_pool, table, _, _ = _paged([5, 9], 4)
    lengths = [5, 9]
    call = paged
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


def test_each_backend_says_whether_it_serves_paged_keys():
    spec = AttentionSpec.example(paged=True, causal=True)
    grads = AttentionSpec.example(paged=True, causal=True, needs_grad=True)
    assert get("reference").supports(spec) is None and get("reference").supports(grads) is None
    assert get("flash").supports(spec) is None
    assert "inference" in get("flash").supports(grads)
    # triton: its paged kernel (interpreted here), for inference
    assert "inference" in get("triton").supports(grads)
    for name in names():
        backend = get(name)
        if name not in ("reference", "flash", "triton"):  # why not, each in its own words
            assert backend.available() or backend.supports(spec)
    assert "paged" in get("sdpa").supports(spec)
    assert get("sdpa").supports(AttentionSpec.example()) is None  # (unpaged: unchanged)


def test_a_block_table_changed_in_place_is_checked_again():
    """attention(block_table=) checks the table at each call: a table changed in place or
    another table with the same values is checked again. A PagedStep keeps the table it
    checked (its own copy): changing the caller's table after changes none of its
    answers, and a step made from the changed table refuses it."""
    q, k_pool, v_pool, table, _, _ = _paged([5, 9], 4)
    lengths = [5, 9]
    first = paged(q, k_pool, v_pool, table, lengths)
    assert torch.equal(paged(q, k_pool, v_pool, table, lengths), first)
    step = _step(table, lengths, k_pool)
    table[1, 0] = k_pool.shape[0]  # a block holding keys that is no block
    with pytest.raises(ValueError, match="block_table's blocks"):
        paged(q, k_pool, v_pool, table, lengths)
    with pytest.raises(ValueError, match="block_table's blocks"):
        paged(q, k_pool, v_pool, table.clone(), lengths)
    assert torch.equal(mhsa.paged_attention(q, k_pool, v_pool, step), first)
    with pytest.raises(ValueError, match="block_table's blocks"):
        _step(table, lengths, k_pool)


def _step(table, lengths, k_pool) -> mhsa.PagedStep:
    return mhsa.PagedStep(table, lengths, num_blocks=k_pool.shape[0], block_size=k_pool.shape[1])


@torch.no_grad()
def test_the_layers_of_a_step_reuse_one_checked_plan_and_nothing_stale(monkeypatch):
    """A step checks and plans each kind of call once: the later calls of a kind (other
    layers: their own q and pools, the same shapes and options) skip the checks; a call
    of another kind (another scale, a forced backend) is checked and planned for itself,
    and every answer equals the checked one."""
    from mhsa.core.paged_step import PagedStep

    q, k_pool, v_pool, table, keys, values = _paged([5, 9], 4)
    lengths = [5, 9]
    step = _step(table, lengths, k_pool)
    checks = []
    check = PagedStep.check
    monkeypatch.setattr(PagedStep, "check", lambda *args: checks.append(1) or check(*args))
    want = _golden(q, keys, values, lengths)
    for _ in range(3):  # the second and third reuse the first's plan
        assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
    assert len(checks) == 1 and len(step.plans) == 1
    other_q = torch.randn_like(q)  # another layer: its own q and pools, the same shapes
    other_k, other_v = torch.randn_like(k_pool), torch.randn_like(v_pool)
    other_keys, other_values = (gathered(pool, table, lengths) for pool in (other_k, other_v))
    other_want = _golden(other_q, other_keys, other_values, lengths)
    out = mhsa.paged_attention(other_q, other_k, other_v, step)
    assert max_error(out, other_want) < 1e-12 and len(checks) == 1
    half = _golden(q, keys, values, lengths, scale=0.5)
    assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step, scale=0.5), half) < 1e-12
    assert len(checks) == 2 and len(step.plans) == 2
    with pytest.raises(ValueError, match="forward_paged|paged keys"), mhsa.use_backend("sdpa"):
        mhsa.paged_attention(q, k_pool, v_pool, step)
    with pytest.raises(ValueError, match="seq_lens"):  # a step's lengths are checked once
        _step(table, [5, table.shape[1] * 4 + 1], k_pool)
    with pytest.raises(ValueError, match="made for"):  # pools of other blocks: not its own
        mhsa.paged_attention(q, k_pool[:-1], v_pool[:-1], step)
    with pytest.raises(ValueError, match="PagedStep 2"):  # q of other sequences
        mhsa.paged_attention(q[:1], k_pool, v_pool, step)
    with pytest.raises(TypeError, match="step must be an mhsa.PagedStep"):
        mhsa.paged_attention(q, k_pool, v_pool, table)


def gathered(pool, table, lengths):
    """Each sequence's keys (1, H_kv, len, D) of pool, gathered by hand."""
    size = pool.shape[1]
    return [
        torch.stack([pool[table[n, j // size], j % size] for j in range(length)], 1)[None]
        for n, length in enumerate(lengths)
    ]


@torch.no_grad()
def test_a_step_plans_each_kind_of_layer_for_itself():
    """One step serves layers of several kinds (windowed and global, as Gemma alternates
    them; another scale; other head counts): each kind gets its own plan, and each
    layer's answer is its own, called in any order."""
    lengths = [9, 40, 23]
    q, k_pool, v_pool, table, keys, values = _paged(lengths, 5, q_len=2, value_dim=7)
    q8 = torch.randn(3, 8, 2, 7, dtype=torch.float64)
    step = _step(table, lengths, k_pool)
    kinds = [
        (q, {}, _golden(q, keys, values, lengths)),
        (q, {"mask": SlidingWindow(6, 0)}, _golden(q, keys, values, lengths, window=6)),
        (q, {"mask": SlidingWindow(0, 0)}, _golden(q, keys, values, lengths, window=0)),
        (q, {"scale": 0.3}, _golden(q, keys, values, lengths, scale=0.3)),
        (q8, {}, _golden(q8, keys, values, lengths)),
    ]
    for _ in range(2):
        for queries, options, want in kinds + kinds[::-1]:
            out = mhsa.paged_attention(queries, k_pool, v_pool, step, backend="flash", **options)
            assert max_error(out, want) < 1e-12
    assert len(step.plans) == len(kinds)


@torch.no_grad()
@pytest.mark.parametrize("lengths", [[9, 5, 2], [2, 9, 5]], ids=["longest first", "unsorted"])
def test_a_short_calls_kept_layout_never_keeps_the_pages(lengths):
    """The flash engine's layout (positions, masks), made once per step and kind of
    call, reads no page: the layers of one step, each with other pools, read their own
    keys; a call with the same lengths and shapes but other pages (another table, the
    same table changed in place) reads its own."""
    # D == D_v: the fused kernel (unwritten slots hold nan, as _paged makes them)
    first, second = (_paged(lengths, 4, q_len=2, value_dim=7, num_blocks=12) for _ in "ab")
    for q, k_pool, v_pool, table, keys, values in (first, second, first):
        want = _golden(q, keys, values, lengths)
        assert max_error(paged(q, k_pool, v_pool, table, lengths, backend="flash"), want) < 1e-12
    q, k_pool, v_pool, table, keys, values = second
    step = _step(table, lengths, k_pool)
    for _ in range(2):  # layers of one step: their own pools, the same table
        for pools, (layer_keys, layer_values) in (
            ((k_pool, v_pool), (keys, values)),
            ((v_pool, k_pool), (values, keys)),
        ):
            want = _golden(q, layer_keys, layer_values, lengths)
            out = mhsa.paged_attention(q, *pools, step, backend="flash")
            assert max_error(out, want) < 1e-12
    assert len(step.plans) == 1 and step.plans[next(iter(step.plans))].prepared is not None
    other = torch.randperm(k_pool.shape[0])  # the same table's ids moved in place
    moved_k, moved_v = torch.empty_like(k_pool), torch.empty_like(v_pool)
    moved_k[other], moved_v[other] = k_pool, v_pool
    table[table >= 0] = other[table[table >= 0]]
    want = _golden(q, keys, values, lengths)
    assert max_error(paged(q, moved_k, moved_v, table, lengths, backend="flash"), want) < 1e-12
    moved = _step(table, lengths, k_pool)
    assert max_error(mhsa.paged_attention(q, moved_k, moved_v, moved), want) < 1e-12


def test_the_registry_refuses_paged_keys_for_backends_without_forward_paged():
    from mhsa.core.backends.registry import PAGED_REASON, reason_unusable, serves_paged

    spec = AttentionSpec.example(paged=True, causal=True)
    for name in names():
        backend = get(name)
        assert serves_paged(backend) == (name in ("reference", "flash", "triton"))
        if not serves_paged(backend):
            assert reason_unusable(backend, spec) == PAGED_REASON


def test_the_paged_choice_follows_use_backend_and_the_registry(monkeypatch):
    """select answers a paged spec from the registry as it is now (nothing kept between
    calls); a step plans a call under a forced backend as another kind, with that
    backend, and goes back to its own plan outside it."""
    from mhsa.core.backends import registry

    spec = AttentionSpec.example(paged=True, causal=True)
    assert registry.select(spec, "auto").name == "flash"
    with mhsa.use_backend("reference"):
        assert registry.select(spec, "auto").name == "reference"
    assert registry.select(spec, "auto").name == "flash"
    q, k_pool, v_pool, table, keys, values = _paged([5, 9], 4)
    step, want = _step(table, [5, 9], k_pool), _golden(q, keys, values, [5, 9])
    with torch.no_grad():
        assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
        with mhsa.use_backend("reference"):
            assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
        assert max_error(mhsa.paged_attention(q, k_pool, v_pool, step), want) < 1e-12
    chosen = [plan.backend.name for plan in step.plans.values()]
    assert chosen == ["flash", "reference"]
    others = {name: b for name, b in registry._BACKENDS.items() if name != "flash"}
    monkeypatch.setattr(registry, "_BACKENDS", others)  # (the order stays the registry's)
    assert registry.select(spec, "auto").name == "reference"


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
