"""Score functions and sinks: every backend that takes them equals the float64 golden
formula (written out here) in outputs, logsumexp and gradients, including gradients
to the function's own tensors; bad input fails at the first call."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import assert_matches_golden, golden_attention, max_error
from mhsa.core.kernels import unfused as unfused_kernel
from mhsa.core.masks import SlidingWindow, bigbird
from mhsa.core.scores import ALiBi, Compose, RelativeBias, ScoreMod, Softcap, t5_bucket
from mhsa.nn.positional import alibi_slopes
from optional import needs

HEADS = 4
# (L, S, causal, mask, H_kv, D): L == S, L < S with a window and GQA, L > S with
# dead rows and MQA, a BigBird pattern at D = 128
SHAPES = {
    "square-causal": (37, 37, True, None, 4, 16),
    "wide-window-gqa": (20, 45, False, SlidingWindow(8, 3), 2, 59),
    "tall-causal-mqa": (45, 20, True, None, 1, 16),
    "bigbird-d128": (64, 64, False, bigbird(8, seed=1), 2, 128),
}


def hf_bucket(offsets, bidirectional=True, num_buckets=32, max_distance=128):
    needs("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(offsets, bidirectional, num_buckets, max_distance)


def make_case(name: str, dtype=torch.float32):
    """(score for mhsa, sinks or None, golden modify(scores, i, j), learnable tensors)."""
    generator = torch.Generator().manual_seed(3)
    slopes = alibi_slopes(HEADS).to(dtype).requires_grad_()
    table = (torch.randn(32, HEADS, generator=generator) * 0.5).to(dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(HEADS, generator=generator)).to(dtype).requires_grad_()
    sinks = torch.randn(HEADS, generator=generator).to(dtype).requires_grad_()

    def alibi(s, i, j):
        return s - slopes.double().view(1, -1, 1, 1) * (i - j).abs()

    def relative(s, i, j):
        return s + table.double()[hf_bucket(j - i)].permute(2, 0, 1).unsqueeze(0)

    def softcap(s, i, j, cap=2.0):
        return cap * torch.tanh(s / cap)

    def mod(s, i, j):
        return s * weight.double().view(1, -1, 1, 1) + 0.01 * (i - j)

    mod_fn = ScoreMod(lambda s, b, h, qi, ki: s * weight[h].to(s.dtype) + 0.01 * (qi - ki))
    cases = {
        "alibi": (ALiBi(slopes), None, alibi, [slopes]),
        "relative": (RelativeBias(table), None, relative, [table]),
        "softcap": (Softcap(2.0), None, softcap, []),
        "score_mod": (mod_fn, None, mod, [weight]),
        "sinks": (None, sinks, None, [sinks]),
        "alibi-then-softcap": (
            [ALiBi(slopes), Softcap(1.5)],
            None,
            lambda s, i, j: softcap(alibi(s, i, j), i, j, 1.5),
            [slopes],
        ),
        "relative-softcap-sinks": (
            RelativeBias(table).then(Softcap(3.0)),
            sinks,
            lambda s, i, j: softcap(relative(s, i, j), i, j, 3.0),
            [table, sinks],
        ),
    }
    return cases[name]


CASES = [
    "alibi",
    "relative",
    "softcap",
    "score_mod",
    "sinks",
    "alibi-then-softcap",
    "relative-softcap-sinks",
]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "flash"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", CASES)
def test_scores_and_sinks_match_the_golden_formula(case, shape, backend):
    q_len, kv_len, causal, mask, kv_heads, dim = SHAPES[shape]
    torch.manual_seed(0)
    q = torch.randn(2, HEADS, q_len, dim, requires_grad=True)
    k = torch.randn(2, kv_heads, kv_len, dim, requires_grad=True)
    v = torch.randn(2, kv_heads, kv_len, dim, requires_grad=True)
    score, sinks, modify, learned = make_case(case)
    grad_out, grad_lse = torch.randn(2, HEADS, q_len, dim), torch.randn(2, HEADS, q_len)

    def loss(out, lse):
        return (out * grad_out.to(out.dtype)).sum() + (lse.nan_to_num(0, 0, 0) * grad_lse).sum()

    out, lse = mhsa.attention(
        q, k, v, mask, causal=causal, score=score, sinks=sinks, backend=backend, return_lse=True
    )
    inputs = [q, k, v, *learned]
    got = torch.autograd.grad(loss(out, lse), inputs)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = golden_attention(
        *ref_inputs, mask, causal=causal, modify=modify, sinks=sinks
    )
    want = torch.autograd.grad(loss(ref_out, ref_lse), [*ref_inputs, *learned])
    names = ["q", "k", "v"] + [f"learned {i}" for i in range(len(learned))]
    assert_matches_golden(out, lse, got, ref_out, ref_lse, want, names)


def test_a_row_with_no_allowed_key_and_a_sink_gives_zero_and_the_sinks_logit():
    q = torch.randn(1, 2, 5, 8)
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    for backend in ("reference", "flash"):
        out, lse = mhsa.attention(
            q, k, v, causal=True, sinks=sinks, backend=backend, return_lse=True
        )
        assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 8))  # rows 0, 1 see no key
        assert torch.equal(lse[0, :, :2], sinks.detach().view(2, 1).expand(2, 2))
        (grad,) = torch.autograd.grad(lse[:, :, :2].sum(), sinks)
        assert torch.allclose(grad, torch.full((2,), 2.0))  # d lse / d sink = 1 there
    # a sink of -inf (a head's sink switched off): its gradient was nan beside a dead row
    off = torch.tensor([-torch.inf, -1.0], requires_grad=True)
    for backend in ("reference", "flash", "auto"):
        out = mhsa.attention(q, k, v, causal=True, sinks=off, backend=backend)
        (grad,) = torch.autograd.grad(out.sum(), off)
        assert torch.isfinite(grad).all() and grad[0] == 0, backend


@pytest.mark.parametrize("case", CASES)
def test_flash_gradcheck_in_float64(case):
    """Both autograd paths: the tile math (gradients to the function's tensors) and,
    for additive functions without learned tensors, the fused kernel's backward."""
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, 4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    score, sinks, _, learned = make_case(case, torch.float64)

    def run(*tensors):
        out, lse = mhsa.attention(
            *tensors[:3], causal=True, score=score, sinks=sinks, backend="flash", return_lse=True
        )
        return out, lse.nan_to_num(0, 0, 0)

    assert torch.autograd.gradcheck(run, (q, k, v, *learned), fast_mode=True)
    for t in learned:
        t.requires_grad_(False)
    assert torch.autograd.gradcheck(run, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("case", ["alibi-then-softcap", "relative-softcap-sinks"])
def test_dropout_with_scores_equals_the_reference_given_the_same_keep_mask(case):
    q, k, v = (
        torch.randn(2, HEADS, 30, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    score, sinks, _, learned = make_case(case, torch.float64)
    results = []
    for backend in ("reference", "flash"):
        torch.manual_seed(7)  # the same dropout seed for both
        out = mhsa.attention(
            q, k, v, causal=True, score=score, sinks=sinks, dropout_p=0.3, backend=backend
        )
        results.append([out, *torch.autograd.grad(out.square().sum(), [q, k, v, *learned])])
    for got, want in zip(*results, strict=True):
        assert max_error(got, want) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_within_twice_attention_computed_in_that_dtype(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, 70, 32) for _ in range(3))
    slopes = alibi_slopes(HEADS)
    score = [ALiBi(slopes), Softcap(5.0)]
    expected, _ = golden_attention(
        q,
        k,
        v,
        causal=True,
        modify=lambda s, i, j: (
            5.0 * torch.tanh((s - slopes.double().view(1, -1, 1, 1) * (i - j).abs()) / 5.0)
        ),
    )
    low = [t.to(dtype) for t in (q, k, v)]
    out = mhsa.attention(*low, causal=True, score=score, backend="flash")
    scores = low[0] @ low[1].transpose(-1, -2) * 32**-0.5  # all in the low dtype
    distance = (torch.arange(70).view(-1, 1) - torch.arange(70)).abs().to(dtype)
    scores = 5.0 * torch.tanh((scores - slopes.to(dtype).view(1, -1, 1, 1) * distance) / 5.0)
    scores = scores.masked_fill(torch.ones(70, 70, dtype=torch.bool).triu(1), -torch.inf)
    naive = torch.softmax(scores, dim=-1) @ low[2]
    assert max_error(out, expected) <= 2 * max_error(naive, expected)


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_attention_weights_of_selected_heads_and_rows_with_scores_and_sinks(backend):
    """With v = identity the golden output is the probability matrix itself."""
    torch.manual_seed(0)
    q, k = torch.randn(2, HEADS, 9, 8), torch.randn(2, 2, 12, 8)
    score, sinks, modify, _ = make_case("relative-softcap-sinks")
    heads, rows = [1, 3], [0, 4, 8]
    probs = mhsa.attention_weights(
        q,
        k,
        causal=True,
        score=score,
        sinks=sinks.detach(),
        heads=heads,
        rows=rows,
        backend=backend,
    )
    eye = torch.eye(12).expand(2, 2, 12, 12)
    expected, _ = golden_attention(q, k, eye, causal=True, modify=modify, sinks=sinks.detach())
    assert max_error(probs, expected[:, heads][:, :, rows]) < 1e-6


def test_empty_calls_with_sinks_give_the_sinks_as_lse():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 0, 8)
    sinks = torch.tensor([0.5, -2.0], requires_grad=True)
    out, lse = mhsa.attention(q, k, k, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 2, 3, 8))
    assert torch.equal(lse, sinks.detach().view(1, 2, 1).expand(1, 2, 3))
    assert torch.equal(torch.autograd.grad(lse.sum(), sinks)[0], torch.full((2,), 3.0))


def test_t5_buckets_equal_transformers():
    offsets = torch.arange(-300, 301).view(-1, 1)
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 20)):
            assert torch.equal(
                t5_bucket(offsets, buckets, distance, bidirectional),
                hf_bucket(offsets, bidirectional, buckets, distance),
            )


def test_positions_are_global_and_aligned_bottom_right():
    """Decoding the last query against a cache equals the last row of the full call."""
    q, k, v = (torch.randn(1, HEADS, 12, 8) for _ in range(3))
    score = ALiBi(alibi_slopes(HEADS)).then(Softcap(4.0))
    full = mhsa.attention(q, k, v, causal=True, score=score, backend="flash")
    last = mhsa.attention(q[:, :, -1:], k, v, score=score, backend="flash")
    assert max_error(last, full[:, :, -1:]) < 1e-6


def test_backends_without_score_functions_say_so():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with pytest.raises(ValueError, match="sdpa.*no score functions or sinks"):
        mhsa.attention(q, k, v, score=Softcap(1.0), backend="sdpa")
    with pytest.raises(ValueError, match="sdpa.*no score functions or sinks"):
        mhsa.attention(q, k, v, sinks=torch.zeros(2), backend="sdpa")
    out = mhsa.attention(q, k, v, score=Softcap(1.0))  # auto picks one that serves it
    assert max_error(out, mhsa.attention(q, k, v, score=Softcap(1.0), backend="reference")) < 1e-6


def test_bad_score_functions_and_sinks_fail_at_the_first_call():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))

    def call(**kwargs):
        return mhsa.attention(q, k, v, backend="flash", **kwargs)

    with pytest.raises(ValueError, match=r"must return the scores' shape \(1, 2, 3, 4\)"):
        call(score=ScoreMod(lambda s, b, h, qi, ki: s.sum(-1)))
    with pytest.raises(ValueError, match="scores' dtype torch.float32, got torch.int64"):
        call(score=ScoreMod(lambda s, b, h, qi, ki: qi - ki + 0 * b))
    with pytest.raises(ValueError, match="is not elementwise"):
        call(score=ScoreMod(lambda s, b, h, qi, ki: s - s.amax(-1, keepdim=True)))
    with pytest.raises(ValueError, match="failed on a"):
        call(score=ScoreMod(lambda s, b, h, qi, ki: s @ s))
    with pytest.raises(TypeError, match="ScoreMod needs a callable"):
        ScoreMod(3)
    with pytest.raises(TypeError, match="score must be an mhsa.core.scores function"):
        call(score=lambda s: s)
    with pytest.raises(TypeError, match="score functions must be mhsa.core.scores objects"):
        Compose(Softcap(1.0), "tanh")
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        call(sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        call(sinks=torch.zeros(2, dtype=torch.long))
    for cap in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="cap must be a finite number > 0"):
            Softcap(cap)
    with pytest.raises(ValueError, match=r"table must be a float tensor \(num_buckets 32, H\)"):
        RelativeBias(torch.zeros(16, 2))
    # log(max_distance / exact) must be positive: 16 exact buckets need max_distance > 16
    beyond = r"^max_distance must be an int >= 17 \(beyond the 16 offsets bucketed one by one\)"
    with pytest.raises(ValueError, match=beyond + ", got 16$"):
        RelativeBias(torch.zeros(32, 2), max_distance=16, bidirectional=False)
    with pytest.raises(ValueError, match=r"^num_buckets must be an int >= 4, got 3$"):
        RelativeBias(torch.zeros(3, 2), num_buckets=3)
    with pytest.raises(ValueError, match="have 3 heads but the call has 2 query heads"):
        call(score=RelativeBias(torch.zeros(32, 3)))
    with pytest.raises(ValueError, match="have 4 heads but the call has 2 query heads"):
        call(score=ALiBi(alibi_slopes(4)))
    with pytest.raises(ValueError, match="ALiBi slopes must be a 1-D float tensor"):
        ALiBi(torch.ones(2, 2))


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_bfloat16_alibi_slopes_keep_exact_distances(backend):
    """A model cast to bfloat16 casts its slopes: positions went to bfloat16 with them,
    rounding distances past 256 (outputs 0.5 off at L=600; the bias at distance 2 read
    as 4)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 600, 16, dtype=torch.bfloat16) for _ in range(3))
    slopes = alibi_slopes(4)  # (powers of two: exact in bfloat16)
    exact, halved = (
        mhsa.attention(q, k, v, causal=True, score=ALiBi(s), backend=backend)
        for s in (slopes, slopes.bfloat16())
    )
    assert torch.equal(exact, halved)
    at = torch.tensor(599).view(1, 1, 1, 1), torch.tensor(597).view(1, 1, 1, 1)
    assert ALiBi(slopes.bfloat16()).bias(None, torch.tensor(0), *at).item() == -0.5


@pytest.mark.parametrize("learned", [False, True], ids=["frozen", "learned"])
@pytest.mark.parametrize(("q_len", "kv_len"), [(1300, 1300), (300, 1400)])
def test_long_causal_alibi_runs_left_of_the_diagonal_as_key_and_row_terms(
    q_len, kv_len, learned, monkeypatch
):
    """A causal ALiBi call long enough for runs left of the diagonal: the fused kernel
    reads one row of values per run (frozen slopes); learned slopes and an lse gradient
    take the unfused backward, which cuts the fused plan's long runs into pieces."""
    monkeypatch.setattr(unfused_kernel, "UNFUSED_KEYS", 512)  # pieces across keys too
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, q_len, 16, requires_grad=True)
    k, v = (torch.randn(1, HEADS, kv_len, 16, requires_grad=True) for _ in range(2))
    slopes = alibi_slopes(HEADS).requires_grad_(learned)
    grad_out = torch.randn(1, HEADS, q_len, 16)
    grad_lse = torch.randn(1, HEADS, q_len) if learned else torch.zeros(1, HEADS, q_len)
    out, lse = mhsa.attention(
        q, k, v, causal=True, score=ALiBi(slopes), backend="flash", return_lse=True
    )
    inputs = [q, k, v] + ([slopes] if learned else [])
    got = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), inputs)
    ref = [t.detach().double().requires_grad_() for t in inputs]

    ref_slopes = ref[3] if learned else slopes.double()

    def alibi(s, i, j):
        return s - ref_slopes.view(1, -1, 1, 1) * (i - j).abs()

    ref_out, ref_lse = golden_attention(*ref[:3], None, causal=True, modify=alibi)
    want = torch.autograd.grad((ref_out * grad_out).sum() + (ref_lse * grad_lse).sum(), ref)
    assert max_error(out, ref_out) < 2e-5
    assert max_error(lse, ref_lse) < 2e-5
    for g, w in zip(got, want, strict=True):
        assert max_error(g, w) < 1e-4 * max(1.0, w.abs().max().item())


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_score_mod_tables_reached_through_a_method_or_a_partial_get_gradients(backend):
    """A bound method of a module, or a functools.partial, reads its table outside the
    function's closure: its gradient once was lost without a word (flash, auto)."""
    import functools

    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(2, 9))

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.table[h, kv_idx]

    def add(score, b, h, q_idx, kv_idx, table):
        return score + table[h, kv_idx]

    module, table = Bias(), torch.randn(2, 9, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    for fn, leaf in (
        (module.score_mod, module.table),
        (functools.partial(add, table=table), table),
    ):
        mhsa.attention(q, k, v, score=ScoreMod(fn), backend=backend).sum().backward()
        expected = leaf.detach().clone().requires_grad_()
        scores = (q @ k.transpose(-1, -2)) / 8**0.5 + expected[:, :6].view(1, 2, 1, 6)
        (torch.softmax(scores, -1) @ v).sum().backward()
        assert leaf.grad is not None and torch.allclose(leaf.grad, expected.grad, atol=1e-5)


def test_a_score_mod_is_tried_within_a_short_call():
    """L = S = 2 with a table of 2 keys: the first-call check once tried positions 0..3
    and refused the call (index 2 out of bounds)."""
    key_bias = torch.tensor([0.5, -1.0])
    q, k, v = (torch.randn(1, 2, 2, 8) for _ in range(3))
    score = ScoreMod(lambda s, b, h, q_idx, kv_idx: s + key_bias[kv_idx])
    out = mhsa.attention(q, k, v, score=score, backend="flash")
    scores = (q @ k.transpose(-1, -2)) / 8**0.5 + key_bias
    assert torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-6)
