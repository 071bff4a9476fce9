"""The band kernels (dense, causal, sliding windows) in Triton's CPU interpreter,
against the float64 golden formula: which calls they serve, outputs, lse and
gradients at awkward shapes (L != S, dead rows, GQA and MQA, D not a power of two,
non-contiguous inputs, lengths off the tiles), score functions and sinks, the lse's
gradient, and the blocks where the band's edges fall (every masked/unmasked split)."""

from __future__ import annotations

import pytest
import torch

from optional import needs

needs("triton")  # the interpreter is switched on in conftest.py

import triton
import triton.language as tl

from helpers import assert_matches_golden, golden_attention
from mhsa.core.kernels.triton import triton_attention
from mhsa.core.kernels.triton.band import _query_block
from mhsa.core.kernels.triton.band_launch import BIG, BandPlan, band_plan, mask_band
from mhsa.core.kernels.triton.function import _prepare
from mhsa.core.masks import Causal, Dilated, SlidingWindow, bigbird
from mhsa.core.scores import ALiBi, Compose, RelativeBias, Softcap
from mhsa.nn.positional import alibi_slopes

# (L, S, causal, mask, H_kv, D)
SHAPES = {
    "square-causal": (48, 48, True, None, 4, 32),
    "wide-dense-gqa-d40": (37, 70, False, None, 2, 40),
    "tall-causal-dead-rows-mqa": (70, 40, True, None, 1, 16),
    "window-gqa": (67, 67, False, SlidingWindow(9, 4), 2, 32),
    "window-causal-wide": (33, 80, True, SlidingWindow(20, 20), 4, 16),
    "narrow-window": (50, 50, False, SlidingWindow(0, 0), 2, 16),
}


def _inputs(q_len, kv_len, kv_heads, dim, contiguous=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, q_len, dim, generator=generator)
    k, v = (torch.randn(2, kv_heads, kv_len, dim, generator=generator) for _ in "kv")
    if not contiguous:  # (B, L, H, D) storage, as projections leave it
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return [t.requires_grad_() for t in (q, k, v)]


def _check(q, k, v, mask, causal, score=None, modify=None, sinks=None, lse_weight=0.0):
    out, lse = triton_attention(q, k, v, mask, causal=causal, score=score, sinks=sinks)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref_sinks = ref_inputs[3] if sinks is not None else None
    ref_out, ref_lse = golden_attention(
        *ref_inputs[:3], mask, causal=causal, modify=modify, sinks=ref_sinks
    )
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(out.shape, generator=generator)
    finite = torch.isfinite(lse)
    loss = (out * grad).sum() + lse_weight * torch.where(finite, lse, 0).sum()
    grads = torch.autograd.grad(loss, inputs)
    ref_finite = torch.isfinite(ref_lse)
    ref_loss = (ref_out * grad.double()).sum()
    ref_loss = ref_loss + lse_weight * torch.where(ref_finite, ref_lse, 0).sum()
    ref_grads = torch.autograd.grad(ref_loss, ref_inputs)
    names = ["q", "k", "v", "sinks"][: len(inputs)]
    assert_matches_golden(out, lse, grads, ref_out, ref_lse, ref_grads, names)


@pytest.mark.parametrize("name", SHAPES)
def test_band_calls_match_the_golden_forward_and_backward(name):
    q_len, kv_len, causal, mask, kv_heads, dim = SHAPES[name]
    q, k, v = _inputs(q_len, kv_len, kv_heads, dim)
    plan = _prepare(q, k, v, mask, None, causal, None, None, band=True)[0]
    assert isinstance(plan, BandPlan)  # the band kernels serve it
    _check(q, k, v, mask, causal, lse_weight=0.5)


def test_dk_dv_run_per_query_head_where_kv_heads_leave_the_gpu_idle():
    from mhsa.core.kernels.triton.band_launch import dkv_per_head

    assert dkv_per_head((1, 4, 4096, 128), 16, 64)  # gpu_hf's Llama: 256 programs
    assert not dkv_per_head((1, 16, 4096, 128), 16, 64)  # no grouped heads
    assert not dkv_per_head((4, 4, 4096, 128), 16, 64)  # 1024 programs already
    assert not dkv_per_head((1, 1, 65536 - 64, 128), 32, 64)  # shares of 2 GiB


@pytest.mark.parametrize("name", ["wide-dense-gqa-d40", "tall-causal-dead-rows-mqa", "window-gqa"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dq_atomic", [False, True])
def test_dk_dv_per_kv_or_query_head_and_dq_by_atomics_match_the_golden_gradients(
    name, per_head, dq_atomic
):
    """The dK/dV kernel summing a group's query heads itself (one program per KV head)
    and one program per query head, the group summed after it, each with dQ from its
    own kernel and added by the dK/dV kernel's atomics: all give the golden gradients
    (the automatic choice takes per query head at these small shapes)."""
    from mhsa.core.kernels.triton.band_launch import band_backward, band_forward
    from mhsa.core.kernels.triton.scores import KernelScore

    q_len, kv_len, causal, mask, kv_heads, dim = SHAPES[name]
    q, k, v = (t.detach() for t in _inputs(q_len, kv_len, kv_heads, dim))
    plan, scale = band_plan(q, k, v, mask, None, causal), dim**-0.5
    out, lse = band_forward(q, k, v, plan, scale, KernelScore(), (None,) * 3)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    delta = (grad * out).sum(-1)
    score = KernelScore()
    grads = band_backward(
        q, k, v, grad, delta, lse, plan, scale, score, (None,) * 3, None, per_head, dq_atomic
    )
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = golden_attention(*ref_inputs, mask, causal=causal)
    ref_grads = torch.autograd.grad((ref_out * grad.double()).sum(), ref_inputs)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got.double() - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_dq_takes_atomics_only_where_asked_and_never_under_deterministic_algorithms(
    monkeypatch,
):
    from mhsa.core.kernels.triton import band_launch

    monkeypatch.setattr(band_launch, "DQ_IN_DKV", False)  # (off until a device run times it)
    assert not band_launch.dq_atomic_default()
    monkeypatch.setattr(band_launch, "DQ_IN_DKV", True)
    assert band_launch.dq_atomic_default()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert not band_launch.dq_atomic_default()
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


@pytest.mark.parametrize("score_name", ["alibi-then-softcap", "sinks"])
def test_dq_by_atomics_through_autograd_with_score_functions_and_sinks(monkeypatch, score_name):
    """With DQ_IN_DKV on, attention's backward takes dQ from the dK/dV kernel's atomics:
    the golden gradients with ALiBi then Softcap (its 1 - tanh**2 on the atomic path),
    and with sinks."""
    from mhsa.core.kernels.triton import band_launch

    monkeypatch.setattr(band_launch, "DQ_IN_DKV", True)

    class NotLaunched:  # the dQ kernel, which this backward must not launch
        def __getitem__(self, grid):
            raise AssertionError("the dQ kernel ran")

    monkeypatch.setattr(band_launch, "_band_bwd_dq", NotLaunched())
    q, k, v = _inputs(45, 60, 2, 16)
    slopes = alibi_slopes(4)

    def alibi_softcap(s, i, j):
        s = s - slopes.double().view(1, -1, 1, 1) * (i - j).abs()
        return 20.0 * torch.tanh(s / 20.0)

    if score_name == "sinks":
        score, modify = None, None
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)).requires_grad_()
    else:
        score, modify, sinks = Compose(ALiBi(slopes), Softcap(20.0)), alibi_softcap, None
    _check(q, k, v, SlidingWindow(12, 3), True, score, modify, sinks)


def test_non_contiguous_inputs_and_the_lse_alone():
    q, k, v = _inputs(35, 35, 2, 16, contiguous=False)
    _check(q, k, v, None, True)
    _, lse = triton_attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(lse.sum(), [q])  # out unused: its gradient is None
    ref_q = q.detach().double().requires_grad_()
    ref_lse = golden_attention(ref_q, k.detach().double(), v.detach().double(), causal=True)[1]
    (ref_dq,) = torch.autograd.grad(ref_lse.sum(), [ref_q])
    assert (dq.double() - ref_dq).abs().max() < 1e-4


@pytest.mark.parametrize("score_name", ["alibi", "softcap", "alibi-then-softcap", "sinks"])
def test_score_functions_and_sinks(score_name):
    q, k, v = _inputs(45, 60, 2, 16)
    slopes = alibi_slopes(4)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)).requires_grad_()

    def alibi(s, i, j):
        return s - slopes.double().view(1, -1, 1, 1) * (i - j).abs()

    def softcap(s, i, j):
        return 20.0 * torch.tanh(s / 20.0)

    cases = {
        "alibi": (ALiBi(slopes), alibi, None),
        "softcap": (Softcap(20.0), softcap, None),
        "alibi-then-softcap": (
            Compose(ALiBi(slopes), Softcap(20.0)),
            lambda s, i, j: softcap(alibi(s, i, j), i, j),
            None,
        ),
        "sinks": (None, None, sinks),
    }
    score, modify, sink_tensor = cases[score_name]
    mask = SlidingWindow(12, 3)
    plan = _prepare(q, k, v, mask, None, True, None, None, score, sink_tensor, band=True)[0]
    assert isinstance(plan, BandPlan)
    _check(q, k, v, mask, True, score, modify, sink_tensor)


@pytest.mark.parametrize("window", [(0, 0), (15, 0), (16, 0), (17, 1), (31, 16), (100, 100)])
@pytest.mark.parametrize("lengths", [(64, 64), (50, 64), (64, 50)])
def test_every_edge_split_of_the_band_forward(window, lengths):
    """16 x 16 tiles: edges on, before and after tile boundaries, and past both ends."""
    q, k, v = (t.detach() for t in _inputs(*lengths, 2, 16))
    mask = SlidingWindow(*window)
    out, lse = triton_attention(q, k, v, mask)
    ref_out, ref_lse = golden_attention(q.double(), k.double(), v.double(), mask)
    assert (out.double() - ref_out).abs().max() < 2e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


def test_which_calls_are_band_calls():
    assert mask_band(None, False) == (BIG, BIG)
    assert mask_band(None, True) == (BIG, 0)
    assert mask_band(Causal(), False) == (BIG, 0)
    assert mask_band(SlidingWindow(5, 7), False) == (5, 7)
    assert mask_band(SlidingWindow(5, 7), True) == (5, 0)
    assert mask_band(Dilated(4, 2), False) is None  # dilation: the tile lists
    assert mask_band(bigbird(16, 3, 1, 1), False) is None
    assert mask_band(torch.ones(4, 4, dtype=torch.bool), False) is None
    q, k, v = (t.detach() for t in _inputs(8, 8, 4, 16))
    assert band_plan(q, k, v, None, torch.zeros(8, 8), True) is None  # a bias
    assert band_plan(q, k, v[..., :8], None, None, True) is None  # D_v != D
    assert band_plan(q, k, v, None, None, True) == BandPlan(BIG, 0, 0)


def test_alibi_calls_past_2_24_positions_go_to_the_tile_lists():
    """The band kernels form ALiBi's offsets from float32 positions, exact below 2**24:
    a longer call with ALiBi gets no band plan (the tile kernels keep integer offsets);
    without ALiBi, or at the limit, it does."""
    from mhsa.core.kernels.triton.band_launch import ALIBI_POSITIONS

    def qkv(length):
        return [torch.empty(1, 1, length, 16, device="meta") for _ in "qkv"]

    assert band_plan(*qkv(ALIBI_POSITIONS + 1), None, None, True, alibi=True) is None
    assert band_plan(*qkv(ALIBI_POSITIONS + 1), None, None, True) is not None
    assert band_plan(*qkv(ALIBI_POSITIONS), None, None, True, alibi=True) is not None


def test_tile_lists_serve_what_the_band_kernels_do_not():
    q, k, v = _inputs(20, 20, 4, 16)
    table = RelativeBias(torch.randn(32, 4, requires_grad=True), 32, 128)
    for call in (
        dict(q=q.double(), band=True),  # float64: the tile kernels accumulate in float64
        dict(q=q, band=False),  # dropout (the caller says so)
        dict(q=q, band=True, score=table),  # a table that wants its gradient
        dict(q=q, band=True, blocks=(16, 16)),  # blocks name the tile lists' tiles
        dict(q=q, band=True, scale=-0.5),  # the band forward's raw row max needs scale > 0
    ):
        qq = call["q"]
        kk, vv = (t.to(qq.dtype) for t in (k, v))
        plan = _prepare(
            qq,
            kk,
            vv,
            None,
            None,
            True,
            call.get("scale"),
            call.get("blocks"),
            call.get("score"),
            band=call["band"],
        )[0]
        assert not isinstance(plan, BandPlan)


def test_large_scores_keep_their_row_max_and_their_rows():
    """Scores of +-100 and more, through the band kernels: the row max taken over the
    raw products and scaled once must be the scaled scores' max (else exp2 overflows),
    and a row whose first key block holds none of its keys must keep its max at -inf
    (set to 0, exp2 of scores near -140 underflows and the row reads as empty)."""
    q, k, v = (t.detach() for t in _inputs(33, 40, 2, 16))
    generator = torch.Generator().manual_seed(3)
    far_q = torch.full((1, 1, 64, 16), -35.0)  # scores about -140 with these keys
    far_k = 1.0 + 0.01 * torch.randn(1, 1, 64, 16, generator=generator)
    far_v = torch.randn(1, 1, 64, 16, generator=generator)
    for q_, k_, v_, mask in ((q * 30, k, v, None), (far_q, far_k, far_v, SlidingWindow(20, 0))):
        plan = _prepare(q_, k_, v_, mask, None, True, None, None, band=True)[0]
        assert isinstance(plan, BandPlan)
        out, lse = triton_attention(q_, k_, v_, mask, causal=True)
        ref = golden_attention(*(t.double() for t in (q_, k_, v_)), mask, causal=True)
        assert torch.isfinite(lse).all() and (lse.double() - ref[1]).abs().max() < 1e-3
        assert (out.double() - ref[0]).abs().max() < 1e-4


def test_a_negative_scale_matches_the_golden_formula():
    """scale < 0 turns the scores' order around: the band forward, which takes the row
    max before scaling, leaves such calls to the tile kernels."""
    q, k, v = _inputs(33, 40, 2, 16)
    q = q * 30  # scores of +-100: a max taken the wrong way round would overflow exp2
    out, lse = triton_attention(q, k, v, causal=True, scale=-0.3)
    ref_out, ref_lse = golden_attention(
        *(t.detach().double() for t in (q, k, v)), causal=True, scale=-0.3
    )
    assert (out.double() - ref_out).abs().max() < 1e-4
    assert (lse.double() - ref_lse).abs().max() < 1e-4


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("variant", ["tma", "ahead", "tma+ahead", "last first"])
def test_the_forwards_variants_give_the_plain_forwards_bits(name, variant):
    """The forward's TMA path (tensor descriptors) reads what the pointer loads read,
    its loop with each block's scores issued before the previous block's softmax
    (ahead) does the same arithmetic in the same order, and each program of the
    launch with the query blocks from the last computes the block it is given (all off
    by default until a GPU run times them): the same out and lse to the bit, on
    (B, L, H, D) storage as
    projections leave it, D=40 (reads past D as 0) and keys off the tiles (past S as 0),
    with the golden forward's accuracy."""
    import math

    from mhsa.core.kernels.triton.band_launch import band_forward, tma_descriptors
    from mhsa.core.kernels.triton.scores import KernelScore

    q_len, kv_len, causal, mask, kv_heads, dim = SHAPES[name]
    q, k, v = (t.detach() for t in _inputs(q_len, kv_len, kv_heads, dim, contiguous=False))
    assert tma_descriptors(k, v, 16, 64)[0] is not None
    plan, scale, score = band_plan(q, k, v, mask, None, causal), 1 / math.sqrt(dim), KernelScore()
    plain = band_forward(
        q, k, v, plan, scale, score, (None,) * 3, tma=False, ahead=False, last_first=False
    )
    chosen = dict(tma="tma" in variant, ahead="ahead" in variant, last_first="last" in variant)
    found = band_forward(q, k, v, plan, scale, score, (None,) * 3, **chosen)
    assert all(torch.equal(a, b) for a, b in zip(plain, found, strict=True))
    ref_out, _ = golden_attention(q.double(), k.double(), v.double(), mask, causal=causal)
    assert (found[0].double() - ref_out).abs().max() < 1e-5


@triton.jit
def _query_blocks(Out, LAST_FIRST: tl.constexpr):
    """Out (heads, query blocks): the query block of each program."""
    tl.store(
        Out + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), _query_block(LAST_FIRST)
    )


def test_last_first_gives_program_i_of_n_the_query_block_n_minus_1_minus_i():
    """The mapping itself (the kernels' outputs cannot show it: each program computes
    the block it is given, so the bits are the same either way)."""
    for last_first, expected in ((False, [0, 1, 2, 3, 4]), (True, [4, 3, 2, 1, 0])):
        out = torch.full((2, 5), -1, dtype=torch.int32)
        _query_blocks[(5, 2)](out, LAST_FIRST=last_first)
        assert out.tolist() == [expected, expected]


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_dq_kernel_with_its_query_blocks_from_the_last_gives_the_same_gradients(name):
    """band_backward with the dQ kernel's query blocks launched from the last: the
    same dq, dk, dv to the bit (and so the golden gradients, which the plain launch
    matches), with ALiBi, for every band shape."""
    import math

    from mhsa.core.kernels.triton.band_launch import band_backward, band_forward
    from mhsa.core.kernels.triton.scores import kernel_score

    q_len, kv_len, causal, mask, kv_heads, dim = SHAPES[name]
    q, k, v = (t.detach() for t in _inputs(q_len, kv_len, kv_heads, dim))
    plan, scale = band_plan(q, k, v, mask, None, causal), 1 / math.sqrt(dim)
    score, slopes, _ = kernel_score(ALiBi(alibi_slopes(4)))
    tensors = (slopes, None, None)
    out, lse = band_forward(q, k, v, plan, scale, score, tensors)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    delta = (grad * out).sum(-1)
    found = [
        band_backward(
            q,
            k,
            v,
            grad,
            delta,
            lse,
            plan,
            scale,
            score,
            tensors,
            dq_atomic=False,
            last_first=last_first,
        )
        for last_first in (False, True)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*found, strict=True))


@pytest.mark.parametrize("window", [(0, 0), (60, 0), (40, 8), (BIG, BIG)])
def test_scores_a_block_ahead_give_the_same_bits_with_score_functions_and_sinks(window):
    """ALiBi, Softcap and sinks with the scores a block ahead, for windows whose rows
    hold no, one and several unmasked blocks: the plain forward's bits."""
    from mhsa.core.kernels.triton.band_launch import band_forward
    from mhsa.core.kernels.triton.scores import kernel_score

    q, k, v = (t.detach() for t in _inputs(70, 90, 2, 16))
    plan = BandPlan(window[0], window[1], 20)
    score, slopes, _ = kernel_score(Compose(ALiBi(alibi_slopes(4)), Softcap(20.0)))
    tensors = (slopes, None, torch.randn(4, generator=torch.Generator().manual_seed(2)))
    outs = [band_forward(q, k, v, plan, 0.25, score, tensors, ahead=a) for a in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_tma_descriptors_refuse_what_tma_cannot_read():
    """A last dimension that is not contiguous, or a stride off 16 bytes: (None, None),
    and the forward reads by pointers."""
    from mhsa.core.kernels.triton.band_launch import tma_descriptors

    k = torch.randn(1, 2, 8, 16)
    assert tma_descriptors(k.transpose(2, 3), k.transpose(2, 3), 16, 16) == (None, None)
    odd = torch.randn(1, 2, 8, 18)[..., :17]  # rows of 18 floats: 72 bytes
    assert tma_descriptors(odd, odd, 16, 32) == (None, None)
    assert tma_descriptors(k, k, 16, 16)[0] is not None
