"""Score functions (ALiBi, RelativeBias, Softcap, compositions) and sinks inside the
triton kernels, run in Triton's CPU interpreter, against the float64 golden formula
(helpers.golden_attention): outputs, lse and gradients of q, k, v, slopes, table and
sinks; dead rows, GQA, patterns, dropout; triton == flash; what the backend declines."""

from __future__ import annotations

import pytest
import torch

from optional import needs

needs("triton")  # the interpreter is switched on in conftest.py

import mhsa
from helpers import assert_matches_golden, golden_attention, max_error
from mhsa.core.backends import AttentionSpec
from mhsa.core.backends.reference import attention_probs
from mhsa.core.backends.triton import TritonBackend
from mhsa.core.kernels.dense import apply_dropout, probs_times_v
from mhsa.core.kernels.triton import triton_attention
from mhsa.core.kernels.triton.scores import bucket_lookup, kernel_score
from mhsa.core.masks import SlidingWindow, bigbird
from mhsa.core.scores import ALiBi, RelativeBias, ScoreMod, Softcap, as_score, kinds, t5_bucket
from mhsa.nn.positional import alibi_slopes

HEADS = 4
# (L, S, causal, mask, H_kv, D, blocks): L == S causal at D 64; L < S with a window,
# GQA and D 59; L > S causal with dead rows (the first L - S rows, and a bool mask's
# first rows) and MQA; a BigBird pattern on 16 x 32 tiles (its blocks are 16)
SHAPES = {
    "square-causal-d64": (64, 64, True, None, 4, 64, (32, 32)),
    "wide-window-gqa-d59": (40, 70, False, SlidingWindow(9, 4), 2, 59, (32, 32)),
    "tall-dead-rows-mqa": (70, 40, True, "dead-rows", 1, 16, (32, 32)),
    "bigbird-16": (80, 80, False, bigbird(16, 3, 1, 1), 2, 16, (16, 32)),
}


def make_score(name: str, dtype=torch.float32):
    """(score, sinks or None, golden modify(scores, i, j), learnable tensors)."""
    generator = torch.Generator().manual_seed(3)
    slopes = alibi_slopes(HEADS).to(dtype).requires_grad_()
    table = (torch.randn(32, HEADS, generator=generator) * 0.5).to(dtype).requires_grad_()
    short = (torch.randn(8, HEADS, generator=generator) * 0.5).to(dtype).requires_grad_()
    sinks = torch.randn(HEADS, generator=generator).to(dtype).requires_grad_()

    def alibi(s, i, j):
        return s - slopes.double().view(1, -1, 1, 1) * (i - j).abs()

    def relative(s, i, j, t=table, buckets=32, distance=128, bidirectional=True):
        bucket = t5_bucket(j - i, buckets, distance, bidirectional)
        return s + t.double()[bucket].permute(2, 0, 1).unsqueeze(0)

    def causal_short(s, i, j):  # 8 buckets up to distance 20: saturates within the calls
        return relative(s, i, j, short, 8, 20, False)

    def softcap(s, cap):
        return cap * torch.tanh(s / cap)

    cases = {
        "alibi": (ALiBi(slopes), None, alibi, [slopes]),
        "relative": (RelativeBias(table), None, relative, [table]),
        "softcap": (Softcap(2.0), None, lambda s, i, j: softcap(s, 2.0), []),
        "sinks": (None, sinks, None, [sinks]),
        "alibi-then-softcap": (
            [ALiBi(slopes), Softcap(1.5)],
            None,
            lambda s, i, j: softcap(alibi(s, i, j), 1.5),
            [slopes],
        ),
        "relative-softcap-sinks": (
            RelativeBias(table).then(Softcap(3.0)),
            sinks,
            lambda s, i, j: softcap(relative(s, i, j), 3.0),
            [table, sinks],
        ),
        "softcap-alibi-short-relative-sinks": (
            [Softcap(2.5), ALiBi(slopes), RelativeBias(short, 8, 20, bidirectional=False)],
            sinks,
            lambda s, i, j: causal_short(alibi(softcap(s, 2.5), i, j), i, j),
            [slopes, short, sinks],
        ),
    }
    return cases[name]


# every score on the dead-rows shape; each shape with at least two compositions
RUNS = [
    *[(case, "tall-dead-rows-mqa") for case in ("alibi", "relative", "softcap", "sinks")],
    *[
        (case, shape)
        for case in (
            "alibi-then-softcap",
            "relative-softcap-sinks",
            "softcap-alibi-short-relative-sinks",
        )
        for shape in SHAPES
    ],
]


def make_inputs(shape: str):
    q_len, kv_len, causal, mask, kv_heads, dim, blocks = SHAPES[shape]
    torch.manual_seed(0)
    q = torch.randn(2, HEADS, q_len, dim, requires_grad=True)
    k = torch.randn(2, kv_heads, kv_len, dim, requires_grad=True)
    v = torch.randn(2, kv_heads, kv_len, dim, requires_grad=True)
    if mask == "dead-rows":
        mask = torch.rand(2, HEADS, q_len, kv_len) > 0.3
        mask[:, :, :3] = False  # rows that causal alignment keeps alive see nothing here
        mask[1, 2, 50] = False
    return q, k, v, mask, causal, blocks


def loss_of(out, lse, grad_out, grad_lse):
    """sum(out * grad_out) + sum(lse * grad_lse) over finite lse."""
    return (out * grad_out.to(out.dtype)).sum() + (lse.nan_to_num(0, 0, 0) * grad_lse).sum()


@pytest.mark.slow
@pytest.mark.parametrize("case, shape", RUNS)
def test_scores_and_sinks_match_the_golden_formula(case, shape):
    q, k, v, mask, causal, blocks = make_inputs(shape)
    score, sinks, modify, learned = make_score(case)
    out, lse = triton_attention(
        q, k, v, mask, causal=causal, score=as_score(score), sinks=sinks, blocks=blocks
    )
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad(loss_of(out, lse, grad_out, grad_lse), [q, k, v, *learned])
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = golden_attention(
        *ref_inputs, mask, causal=causal, modify=modify, sinks=sinks
    )
    want = torch.autograd.grad(
        loss_of(ref_out, ref_lse, grad_out, grad_lse), [*ref_inputs, *learned]
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    names = ["q", "k", "v"] + [f"learned {i}" for i in range(len(learned))]
    assert_matches_golden(out, lse, got, ref_out, ref_lse, want, names)


def test_dead_rows_with_sinks_give_zero_and_the_sinks_logit():
    q, k, v = (torch.randn(1, 2, n, 16) for n in (6, 3, 3))
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse = triton_attention(q, k, v, causal=True, sinks=sinks, score=Softcap(2.0))
    assert torch.equal(out[:, :, :3], torch.zeros(1, 2, 3, 16))  # rows 0-2 see no key
    assert torch.equal(lse[0, :, :3], sinks.detach().view(2, 1).expand(2, 3))
    (grad,) = torch.autograd.grad(lse[:, :, :3].sum(), sinks)
    assert torch.allclose(grad, torch.full((2,), 3.0))  # d lse / d sink = 1 there
    empty = triton_attention(q, k[:, :, :0], v[:, :, :0], sinks=sinks)[1]
    assert torch.equal(empty, sinks.detach().view(1, 2, 1).expand(1, 2, 6))


def test_triton_equals_flash_on_a_composed_case():
    q, k, v, mask, causal, _ = make_inputs("wide-window-gqa-d59")
    score, sinks, _, learned = make_score("relative-softcap-sinks")
    results = []
    for backend in ("triton", "flash"):
        out, lse = mhsa.attention(
            q, k, v, mask, causal=True, score=score, sinks=sinks, backend=backend, return_lse=True
        )
        grads = torch.autograd.grad(
            loss_of(out, lse, torch.ones_like(out), 0.5), [q, k, v, *learned]
        )
        results.append([out, lse, *grads])
    for got, want in zip(*results, strict=True):
        assert max_error(got, want) < 2e-5 * max(1.0, want.abs().max().item())


def test_bucket_lookup_equals_t5_bucket():
    """The kernels read bucket(offset) from a vector over -max_distance..max_distance,
    clamping the offset: exactly torch's float-log bucketing, at any distance."""
    offsets = torch.arange(-5000, 5001)
    for buckets, distance in ((32, 128), (8, 20), (16, 9), (4, 3), (64, 1000)):
        for bidirectional in (True, False):
            if (buckets // 2 if bidirectional else buckets) // 2 >= distance:
                continue  # check_t5_buckets refuses it
            lookup = bucket_lookup(buckets, distance, bidirectional, "cpu")
            clamped = offsets.clamp(-distance, distance) + distance
            assert torch.equal(
                lookup[clamped].long(), t5_bucket(offsets, buckets, distance, bidirectional)
            )


def test_dropout_with_scores_equals_the_reference_given_the_same_keep_mask():
    q, k, v = (torch.randn(2, HEADS, 40, 16, requires_grad=True) for _ in range(3))
    score, sinks, _, learned = make_score("relative-softcap-sinks")
    p, seed = 0.3, 1234
    out, _ = triton_attention(
        q,
        k,
        v,
        SlidingWindow(12, 3),
        causal=True,
        score=as_score(score),
        sinks=sinks,
        dropout_p=p,
        seed=seed,
        blocks=(32, 32),
    )
    got = torch.autograd.grad(out.square().sum(), [q, k, v, *learned])
    t64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    probs, _ = attention_probs(
        t64[0],
        t64[1],
        mask=SlidingWindow(12, 3),
        bias=None,
        causal=True,
        scale=0.25,
        score=as_score(score),
        sinks=sinks,
    )
    ref = probs_times_v(apply_dropout(probs, p, seed), t64[2])
    want = torch.autograd.grad(ref.square().sum(), [*t64, *learned])
    assert max_error(out, ref) < 2e-5
    for g, w in zip(got, want, strict=True):
        assert max_error(g, w) < 1e-4 * max(1.0, w.abs().max().item())


def test_gradcheck_float64():
    """float64 runs only under the interpreter: gradcheck of the kernels' backward."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 4, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    table = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, slopes, table, sinks):
        score = as_score([ALiBi(slopes), Softcap(1.5), RelativeBias(table, 4, 3)])
        out, lse = triton_attention(q, k, v, causal=True, score=score, sinks=sinks)
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v, slopes, table, sinks), fast_mode=True)


def test_low_precision_within_twice_attention_in_that_dtype():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, 48, 32) for _ in range(3))
    slopes = alibi_slopes(HEADS)
    score = as_score([ALiBi(slopes), Softcap(5.0)])
    expected, _ = golden_attention(
        q,
        k,
        v,
        causal=True,
        modify=lambda s, i, j: (
            5.0 * torch.tanh((s - slopes.double().view(1, -1, 1, 1) * (i - j).abs()) / 5.0)
        ),
    )
    for dtype in (torch.float16, torch.bfloat16):
        low = [t.to(dtype) for t in (q, k, v)]
        out, _ = triton_attention(*low, causal=True, score=score, blocks=(32, 32))
        scores = low[0] @ low[1].transpose(-1, -2) * 32**-0.5  # all in the low dtype
        distance = (torch.arange(48).view(-1, 1) - torch.arange(48)).abs().to(dtype)
        scores = 5.0 * torch.tanh((scores - slopes.to(dtype).view(1, -1, 1, 1) * distance) / 5.0)
        scores = scores.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), -torch.inf)
        naive = torch.softmax(scores, dim=-1) @ low[2]
        assert out.dtype == dtype
        assert max_error(out, expected) <= 2 * max_error(naive, expected)


def test_attention_weights_with_scores_and_sinks():
    torch.manual_seed(0)
    q, k = torch.randn(2, HEADS, 9, 8), torch.randn(2, 2, 12, 8)
    score, sinks, modify, _ = make_score("relative-softcap-sinks")
    heads, rows = [1, 3], [0, 4, 8]
    probs = mhsa.attention_weights(
        q,
        k,
        causal=True,
        score=score,
        sinks=sinks.detach(),
        heads=heads,
        rows=rows,
        backend="triton",
    )
    eye = torch.eye(12).expand(2, 2, 12, 12)
    expected, _ = golden_attention(q, k, eye, causal=True, modify=modify, sinks=sinks.detach())
    assert max_error(probs, expected[:, heads][:, :, rows]) < 1e-6


def test_backend_serves_kernel_scores_and_declines_the_rest():
    backend = TritonBackend()

    def reason(score, **changes):
        spec = AttentionSpec.example(
            has_score=score is not None, score_kinds=kinds(as_score(score)), **changes
        )
        return backend.supports(spec)

    slopes, table = alibi_slopes(8), torch.zeros(32, 8)
    for score in (
        ALiBi(slopes),
        [RelativeBias(table), Softcap(3.0)],
        [Softcap(2.0), ALiBi(slopes), RelativeBias(table)],
    ):
        assert reason(score) is None
    assert reason(None, has_sinks=True) is None
    mod = ScoreMod(lambda s, b, h, qi, ki: s)
    assert "not ScoreMod (flash and reference take any" in reason([ALiBi(slopes), mod])
    assert "Softcap twice" in reason([Softcap(1.0), Softcap(2.0)])
    assert "not named" in backend.supports(AttentionSpec.example(has_score=True))
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    with pytest.raises(ValueError, match="triton' cannot serve.*not ScoreMod"):
        mhsa.attention(q, k, v, score=mod, backend="triton")
    with pytest.raises(ValueError, match="each at most once"):
        kernel_score(as_score([Softcap(1.0), Softcap(2.0)]))
    with pytest.raises(ValueError, match=r"sinks must be one logit per query head, shape \(2,\)"):
        triton_attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="have 8 heads but the call has 2"):
        triton_attention(q, k, v, score=ALiBi(slopes))


def test_softcap_takes_the_hardware_tanh_only_for_bfloat16_on_a_gpu(monkeypatch):
    """SOFTCAP 2 (tanh.approx.f32, error about 2**-11) only where the inputs' own
    rounding is coarser: bf16 (2**-9) on CUDA outside the interpreter; 1 (tanh from
    exp) for fp16 (2**-11) and fp32, elsewhere, or when asked; 0 without a softcap."""
    from types import SimpleNamespace

    from mhsa.core.kernels.triton import scores

    capped = kernel_score(Softcap(30.0))[0]
    monkeypatch.setattr(scores, "interpreting", lambda: False)
    for dtype, on_gpu, want in [
        (torch.bfloat16, True, 2),
        (torch.float16, True, 1),
        (torch.float32, True, 1),
        (torch.bfloat16, False, 1),
    ]:
        q = SimpleNamespace(is_cuda=on_gpu, dtype=dtype)
        assert capped.constants(q)["SOFTCAP"] == want, (dtype, on_gpu)
    gpu_bf16 = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    exp_only = scores.KernelScore(cap=30.0, hardware_tanh=False)
    assert exp_only.constants(gpu_bf16)["SOFTCAP"] == 1
    assert kernel_score(None)[0].constants(gpu_bf16)["SOFTCAP"] == 0
    monkeypatch.setattr(scores, "interpreting", lambda: True)  # no inline PTX there
    assert capped.constants(gpu_bf16)["SOFTCAP"] == 1
