"""The Triton paged kernel on the GPU: against the float64 paged reference of the same
inputs (FlashAttention's rule: at most twice the error of the reference run in the same
dtype, plus a small floor), split-K against one partition, `auto`'s choice on CUDA, a
row's bits alone and batched, score functions, and a CUDA graph replay.

Marked `cuda`: skipped where there is no GPU (tests/core/test_triton_paged.py runs the
same kernel in Triton's interpreter on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch

import mhsa
from mhsa.core.kernels.paged import PagedCall, paged_reference
from mhsa.core.scores import ALiBi, RelativeBias, Softcap
from mhsa.nn.positional import alibi_slopes
from optional import needs

pytestmark = pytest.mark.cuda


def triton_paged_attention(call: PagedCall, launch=None, **options) -> torch.Tensor:
    needs("triton")
    from mhsa.core.kernels.triton.paged import triton_paged_attention as kernel

    return kernel(call, launch, **options)


def prepare_paged_launch(call: PagedCall):
    needs("triton")
    from mhsa.core.kernels.triton.paged import prepare_paged_launch as prepare

    return prepare(call)


def _call(
    lengths,
    block_size,
    heads=(32, 8),
    q_len=1,
    dims=(128, 128),
    dtype=torch.bfloat16,
    window=None,
    score=None,
) -> PagedCall:
    """A PagedCall on the GPU over a shuffled pool whose slots past each sequence's keys
    and unused blocks hold NaN; the table's unused entries clamped to block 0."""
    torch.manual_seed(0)
    (num_heads, num_kv_heads), (head_dim, value_dim) = heads, dims
    counts = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(counts) + 3
    k_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda")
    v_pool = torch.randn(num_blocks, block_size, num_kv_heads, value_dim, device="cuda")
    table = torch.zeros(len(lengths), max(counts) + 1, dtype=torch.long)
    used = torch.zeros(num_blocks, dtype=torch.bool)
    ids = torch.randperm(num_blocks).tolist()
    for n, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        blocks, ids = ids[:count], ids[count:]
        table[n, :count] = torch.tensor(blocks, dtype=torch.long)
        used[blocks] = True
        if length % block_size:
            k_pool[blocks[-1], length % block_size :] = torch.nan
            v_pool[blocks[-1], length % block_size :] = torch.nan
    k_pool[~used.cuda()] = torch.nan
    v_pool[~used.cuda()] = torch.nan
    q = torch.randn(len(lengths), num_heads, q_len, head_dim, device="cuda")
    q, k_pool, v_pool = (t.to(dtype) for t in (q, k_pool, v_pool))
    return PagedCall(q, k_pool, v_pool, table.cuda(), lengths, head_dim**-0.5, score, window)


def _as(call: PagedCall, dtype: torch.dtype) -> PagedCall:
    return call._replace(
        q=call.q.to(dtype), k_pool=call.k_pool.to(dtype), v_pool=call.v_pool.to(dtype)
    )


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max())


def _check(call: PagedCall, **options) -> torch.Tensor:
    """The kernel's answer, asserted within twice the same-dtype reference's error."""
    golden = paged_reference(_as(call, torch.float64))
    naive = _error(paged_reference(call), golden)
    got = triton_paged_attention(call, **options)
    assert not got.isnan().any()
    floor = max(2 * torch.finfo(call.q.dtype).eps, 1e-5)
    error = _error(got, golden)
    assert error <= 2 * naive + floor, f"error {error:.3g}, the reference's {naive:.3g}"
    return got


CASES = {
    "decode, 32/8 heads, D 128, page 16": (16, [1, 17, 300, 1000, 0], {}),
    "decode, D 64, page 64": (64, [64, 65, 2000], {"dims": (64, 64)}),
    "prefill chunk, D 80, page 5": (5, [230, 41], {"q_len": 40, "heads": (8, 2), "dims": (80, 80)}),
    "drafts, window 100": (16, [700, 90], {"q_len": 4, "window": 100}),
    "MQA, D_v 64": (32, [513, 3], {"heads": (8, 1), "dims": (128, 64)}),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_is_within_twice_the_reference_error(case, dtype):
    block_size, lengths, options = CASES[case]
    _check(_call(lengths, block_size, dtype=dtype, **options))


def test_split_k_on_a_long_context_equals_one_partition():
    call = _call([20000, 300], 16)
    split = _check(call)  # partitions of SPLIT_KEYS keys
    assert prepare_paged_launch(call).splits > 1
    whole = _check(call, split_keys=1 << 20)
    assert _error(split, whole) <= 2e-2


SCORES = {
    "ALiBi": lambda: ALiBi(alibi_slopes(32).cuda()),
    "Softcap": lambda: Softcap(20.0),
    "T5": lambda: RelativeBias(torch.randn(32, 32).cuda() * 0.5),
    "ALiBi+Softcap": lambda: ALiBi(alibi_slopes(32).cuda()).then(Softcap(20.0)),
}


@pytest.mark.parametrize("score", list(SCORES))
def test_score_functions(score):
    _check(_call([700, 33, 1], 16, q_len=3, score=SCORES[score]()))


def test_a_rows_bits_do_not_depend_on_the_batch():
    call = _call([300, 5000, 17], 16)
    batched = triton_paged_attention(call)
    for n in range(3):
        alone = call._replace(
            q=call.q[n : n + 1], block_table=call.block_table[n : n + 1], lengths=[call.lengths[n]]
        )
        assert torch.equal(triton_paged_attention(alone)[0], batched[n])


def test_auto_takes_the_kernel_on_cuda():
    call = _call([100, 37], 16)
    step = mhsa.PagedStep(
        call.block_table, call.lengths, num_blocks=call.k_pool.shape[0], block_size=16
    )
    with torch.no_grad():
        out = mhsa.paged_attention(call.q, call.k_pool, call.v_pool, step)
    assert [plan.backend.name for plan in step.plans.values()] == ["triton"]
    assert torch.equal(out, triton_paged_attention(call))
    q = call.q.detach().requires_grad_()  # gradients: the differentiable reference
    mhsa.paged_attention(q, call.k_pool, call.v_pool, step).sum().backward()
    assert "reference" in [plan.backend.name for plan in step.plans.values()]


def test_a_cuda_graph_replays_the_kernel():
    call = _call([300, 4000], 16)
    launch = prepare_paged_launch(call)
    static_q = call.q.clone()
    step_call = call._replace(q=static_q)
    triton_paged_attention(step_call, launch)  # compiles before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_paged_attention(step_call, launch)
    new_q = torch.randn_like(static_q)
    static_q.copy_(new_q)
    graph.replay()
    assert torch.equal(out, triton_paged_attention(call._replace(q=new_q), launch))
