"""The Triton paged kernel (mhsa.core.kernels.triton.paged), run in Triton's CPU
interpreter: equal to the float64 paged reference and to paged_attention's CPU answer
(flash's tile engine), on awkward shapes (odd lengths and page sizes, GQA, empty and
length-1 sequences, several new queries, windows, score functions), with and without
split-K; and the dispatch: backend="triton" takes it, CPU `auto` is unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from optional import needs

needs("triton")  # the interpreter is switched on in conftest.py

import mhsa
from helpers import max_error
from mhsa.core.kernels.merge import merge_partials
from mhsa.core.kernels.paged import PagedCall, paged_reference
from mhsa.core.kernels.triton.checks import interpreting
from mhsa.core.kernels.triton.paged import (
    _merge_splits,
    prepare_paged_launch,
    triton_paged_attention,
)
from mhsa.core.masks import SlidingWindow
from mhsa.core.scores import ALiBi, RelativeBias, ScoreMod, Softcap
from mhsa.nn.positional import alibi_slopes

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="CPU tensors in the interpreter (tests/cuda runs the GPU's)"
)


def _call(
    lengths,
    block_size,
    heads=(4, 2),
    q_len=1,
    dims=(16, 16),
    dtype=torch.float64,
    window=None,
    score=None,
) -> PagedCall:
    """A PagedCall over a shuffled pool whose slots past each sequence's keys (and its
    unused blocks) hold NaN, the table's unused entries -1 clamped to block 0, as
    PagedStep keeps them."""
    (num_heads, num_kv_heads), (head_dim, value_dim) = heads, dims
    counts = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(counts) + 2
    k_pool = torch.full((num_blocks, block_size, num_kv_heads, head_dim), torch.nan)
    v_pool = torch.full((num_blocks, block_size, num_kv_heads, value_dim), torch.nan)
    table = torch.zeros(len(lengths), max(counts, default=0) + 1, dtype=torch.long)
    ids = torch.randperm(num_blocks).tolist()
    for n, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        blocks, ids = ids[:count], ids[count:]
        table[n, :count] = torch.tensor(blocks, dtype=torch.long)
        for j in range(length):
            k_pool[blocks[j // block_size], j % block_size] = torch.randn(num_kv_heads, head_dim)
            v_pool[blocks[j // block_size], j % block_size] = torch.randn(num_kv_heads, value_dim)
    q = torch.randn(len(lengths), num_heads, q_len, head_dim)
    q, k_pool, v_pool = (t.to(dtype) for t in (q, k_pool, v_pool))
    return PagedCall(q, k_pool, v_pool, table, lengths, head_dim**-0.5, score, window)


def _float64(call: PagedCall) -> PagedCall:
    return call._replace(
        q=call.q.double(), k_pool=call.k_pool.double(), v_pool=call.v_pool.double()
    )


# name -> (block_size, lengths, options of _call)
CASES = {
    "decode, block 16, GQA 2": (16, [1, 17, 40, 33, 113], {}),
    "decode, block 5, MQA 3": (5, [5, 7, 0, 33], {"heads": (3, 1)}),
    "3 new tokens, block 5": (5, [7, 17, 40, 4], {"q_len": 3}),
    "prefill chunk, GQA 4, D 59": (16, [70], {"q_len": 37, "heads": (8, 2), "dims": (59, 23)}),
    "chunks of prompts, block 7": (7, [30, 61, 2], {"q_len": 20}),
    "MHA, D 64, block 64": (64, [100, 1], {"heads": (2, 2), "dims": (64, 64)}),
    "window 9": (8, [50, 3, 21], {"q_len": 4, "window": 9}),
    "window 0": (4, [13, 9], {"q_len": 2, "window": 0}),
}


@pytest.mark.parametrize("split_keys", [None, 16], ids=["one partition", "split-K"])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_float64_reference_and_the_cpu_engine(case, split_keys):
    torch.manual_seed(1)
    block_size, lengths, options = CASES[case]
    call = _call(lengths, block_size, **options)
    got = triton_paged_attention(call, split_keys=split_keys)
    assert got.shape == (*call.q.shape[:3], call.v_pool.shape[3]) and got.dtype == call.q.dtype
    assert max_error(got, paged_reference(call)) < 1e-10
    assert not got.isnan().any()
    # paged_attention's CPU answer (flash's tile engine) in float32, on the sequences
    # that hold keys (that engine mis-shapes a batch with an empty sequence)
    keep = torch.tensor([n for n, length in enumerate(lengths) if length])
    call32 = call._replace(
        q=call.q[keep].float(),
        k_pool=call.k_pool.float(),
        v_pool=call.v_pool.float(),
        block_table=call.block_table[keep],
        lengths=[lengths[n] for n in keep],
    )
    mask = None if call.window is None else SlidingWindow(call.window, 0)
    step = _step_of(call32)
    cpu = mhsa.paged_attention(call32.q, call32.k_pool, call32.v_pool, step, mask)
    assert max_error(triton_paged_attention(call32, split_keys=split_keys), cpu) < 1e-5


def test_rows_with_no_key_get_zero():
    """Empty sequences, and queries before a sequence's first key (T > length)."""
    call = _call([0, 2, 0], 4, q_len=3)
    got = triton_paged_attention(call, split_keys=4)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.equal(got[2], got[0])
    assert torch.equal(got[1, :, 0], torch.zeros_like(got[1, :, 0]))  # at position -1
    assert max_error(got, paged_reference(call)) < 1e-12


@pytest.mark.parametrize(
    "dtype, floor", [(torch.float16, 1e-3), (torch.bfloat16, 1e-2), (torch.float32, 1e-6)]
)
def test_low_precision_within_twice_the_reference_error(dtype, floor):
    """FlashAttention's rule: error(kernel) <= 2 * error(reference in the same dtype) +
    a small floor, both against the float64 reference of the same inputs."""
    torch.manual_seed(2)
    call = _call([37, 80, 1], 16, heads=(4, 1), q_len=2, dims=(32, 32), dtype=dtype)
    golden = paged_reference(_float64(call))
    error = max_error(triton_paged_attention(call, split_keys=32), golden)
    assert error <= 2 * max_error(paged_reference(call), golden) + floor


def _t5_bias(num_heads: int) -> RelativeBias:
    return RelativeBias(torch.randn(32, num_heads, dtype=torch.float64), 32, 20, False)


SCORES = {
    "ALiBi": lambda h: ALiBi(alibi_slopes(h).double()),
    "Softcap": lambda h: Softcap(0.5),
    "T5 bias": _t5_bias,
    "ALiBi then Softcap": lambda h: ALiBi(alibi_slopes(h).double()).then(Softcap(2.0)),
}


@pytest.mark.parametrize("name", list(SCORES))
def test_score_functions_at_each_sequences_own_positions(name):
    torch.manual_seed(3)
    call = _call([9, 40, 23], 8, heads=(6, 2), q_len=3, score=SCORES[name](6))
    for split_keys in (None, 16):
        got = triton_paged_attention(call, split_keys=split_keys)
        assert max_error(got, paged_reference(call)) < 1e-10


def test_a_rows_result_does_not_depend_on_the_rest_of_the_call():
    """Fixed partitions and tiles: a sequence alone or batched with longer ones (more
    partitions, the split path) gives the same bits, float32."""
    torch.manual_seed(4)
    call = _call([45, 130, 7], 8, heads=(4, 2), dtype=torch.float32)
    batched = triton_paged_attention(call, split_keys=32)
    for n in range(3):
        alone = call._replace(
            q=call.q[n : n + 1], block_table=call.block_table[n : n + 1], lengths=[call.lengths[n]]
        )
        assert torch.equal(triton_paged_attention(alone, split_keys=32)[0], batched[n])


def test_the_merge_kernel_is_merge_partials():
    torch.manual_seed(5)
    rows, splits, value_dim = 6, 19, 12  # more partitions than one step of the merge
    part = torch.randn(rows, splits, value_dim, dtype=torch.float64)
    lse = torch.randn(rows, splits, dtype=torch.float64)
    lse[0] = -torch.inf  # a row that sees no key
    lse[1, 3:] = -torch.inf
    out = torch.empty(rows, value_dim, dtype=torch.float64)
    _merge_splits[(rows,)](part, lse, out, splits, value_dim, BLOCK_S=16, BLOCK_DV=16)
    want, _ = merge_partials([(part[:, s], lse[:, s]) for s in range(splits)])
    assert max_error(out, want) < 1e-12 and torch.equal(out[0], torch.zeros(value_dim))


def test_the_launch_is_planned_from_shapes_and_lengths():
    call = _call([300, 5], 16, heads=(8, 2), q_len=40, dtype=torch.float32)
    launch = prepare_paged_launch(call, split_keys=100)
    assert (launch.block_m, launch.m_blocks) == (64, 3)  # 4 heads x 40 rows = 160 rows
    assert (launch.split_keys, launch.splits) == (112, 3)  # rounded up to the key block
    assert prepare_paged_launch(call).splits == 1  # off CUDA: one partition by default
    assert launch.lens.tolist() == [300, 5] and launch.lens.dtype == torch.int32
    with pytest.raises(ValueError, match="split_keys must be an int >= 1"):
        prepare_paged_launch(call, split_keys=0)


def _step_of(call: PagedCall) -> mhsa.PagedStep:
    num_blocks, block_size = call.k_pool.shape[:2]
    return mhsa.PagedStep(
        call.block_table, call.lengths, num_blocks=num_blocks, block_size=block_size
    )


def test_backend_triton_takes_the_kernel_and_cpu_auto_is_unchanged():
    torch.manual_seed(6)
    call = _call([33, 6], 5, heads=(4, 2), q_len=2, dtype=torch.float32)
    step = _step_of(call)
    got = mhsa.paged_attention(call.q, call.k_pool, call.v_pool, step, backend="triton")
    auto = mhsa.paged_attention(call.q, call.k_pool, call.v_pool, step)
    assert [plan.backend.name for plan in step.plans.values()] == ["triton", "flash"]
    assert max_error(got, auto) < 1e-5
    with mhsa.use_backend("triton"):
        forced = mhsa.attention(
            call.q,
            call.k_pool,
            call.v_pool,
            causal=True,
            block_table=call.block_table,
            seq_lens=[33, 6],
        )
    assert torch.equal(forced, got)


def test_backend_triton_refuses_what_the_kernel_cannot_serve():
    call = _call([10, 4], 4, dtype=torch.float32)
    step = _step_of(call)
    q, k_pool, v_pool = call.q, call.k_pool, call.v_pool
    custom = ScoreMod(lambda s, b, h, i, j: s * 0.5)
    with pytest.raises(ValueError, match="backend 'triton' cannot serve this call: .*ScoreMod"):
        mhsa.paged_attention(q, k_pool, v_pool, step, backend="triton", score=custom)
    with pytest.raises(ValueError, match="cannot serve this call: paged keys with gradients"):
        mhsa.paged_attention(q.requires_grad_(), k_pool, v_pool, step, backend="triton")
    call64 = _float64(call)
    with pytest.raises(ValueError, match="cannot serve this call: .*float64"):
        mhsa.paged_attention(call64.q, call64.k_pool, call64.v_pool, step, backend="triton")
