"""mhsa.attention_varlen: packed sequences give what each sequence alone gives (a loop
of mhsa.attention calls, and the float64 formula of helpers.golden_alone, forward
and backward), on every CPU engine, with awkward lengths (1, 0, not block multiples,
longer than the window), cross-attention, GQA, score functions at per-sequence
positions and sinks; bad input is refused with the argument's name; the plan of a
thousand sequences follows the blocks, never total x total."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import expect_error, golden_attention, max_error
from mhsa.core.kernels.plan import build_plan
from mhsa.core.masks import Segments
from mhsa.core.scores import ALiBi, RelativeBias, ScoreMod, Softcap
from mhsa.core.varlen import attention_varlen

LENGTHS = [1, 0, 37, 130, 5, 0, 64]
KEY_LENGTHS = [3, 2, 50, 129, 0, 4, 64]  # cross-attention: q and k segments differ
BACKENDS = ["reference", "flash", "sdpa"]


def offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(q_lengths, k_lengths, heads=4, kv_heads=2, dim=16, dtype=torch.float64):
    total_q, total_k = sum(q_lengths), sum(k_lengths)
    q = torch.randn(total_q, heads, dim, dtype=dtype, requires_grad=True)
    k = torch.randn(total_k, kv_heads, dim, dtype=dtype, requires_grad=True)
    v = torch.randn(total_k, kv_heads, dim, dtype=dtype, requires_grad=True)
    return q, k, v


def one_by_one(q, k, v, q_lengths, k_lengths, attend, **kwargs):
    """out (total_q, H, D_v) and lse (H, total_q) of attend(q_s, k_s, v_s) on every
    sequence alone, in the (1, H, L, D) layout."""
    cu_q, cu_k = offsets(q_lengths).tolist(), offsets(k_lengths).tolist()
    outs, lses = [], []
    for s in range(len(q_lengths)):
        rows = slice(cu_q[s], cu_q[s + 1])
        keys = slice(cu_k[s], cu_k[s + 1])
        q_s, k_s, v_s = (t.transpose(0, 1).unsqueeze(0) for t in (q[rows], k[keys], v[keys]))
        out, lse = attend(q_s, k_s, v_s, **kwargs)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def golden_alone(q, k, v, **kwargs):
    """helpers.golden_alone, and for a sequence without keys what the conventions
    say: output 0, lse -inf (its sink's logit with sinks)."""
    if k.shape[2]:
        return golden_attention(q, k, v, **kwargs)
    out = q.new_zeros(*q.shape[:3], v.shape[-1]).double() + 0 * q.sum()
    sinks = kwargs.get("sinks")
    lse = torch.full(q.shape[:3], -torch.inf, dtype=torch.float64)
    return out, lse if sinks is None else lse.clone().copy_(sinks.double().view(1, -1, 1))


def looped(backend="reference"):
    def attend(q, k, v, **kwargs):
        return mhsa.attention(q, k, v, backend=backend, return_lse=True, **kwargs)

    return attend


def grads(out, inputs, seed=1):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, grad_out.to(out.dtype), allow_unused=True)


def varlen(q, k, v, q_lengths, k_lengths, **kwargs):
    return attention_varlen(
        q,
        k,
        v,
        offsets(q_lengths),
        offsets(k_lengths),
        max(q_lengths),
        max(k_lengths),
        return_lse=True,
        **kwargs,
    )


def assert_close(got, want, tol=1e-10):
    assert max_error(got, want) < tol, max_error(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_packed_equals_each_sequence_alone(backend, causal, cross):
    k_lengths = KEY_LENGTHS if cross else LENGTHS
    q, k, v = packed(LENGTHS, k_lengths)
    kwargs = dict(causal=causal)
    if backend == "sdpa":  # it returns no lse
        out = attention_varlen(
            q, k, v, offsets(LENGTHS), offsets(k_lengths), 130, 130, backend="sdpa", **kwargs
        )
    else:
        out, lse = varlen(q, k, v, LENGTHS, k_lengths, backend=backend, **kwargs)
    want, want_lse = one_by_one(q, k, v, LENGTHS, k_lengths, looped(), **kwargs)
    golden, golden_lse = one_by_one(q, k, v, LENGTHS, k_lengths, golden_alone, **kwargs)
    assert out.shape == (sum(LENGTHS), 4, 16)
    assert_close(out, want)
    assert_close(out, golden)
    if backend != "sdpa":
        assert lse.shape == (4, sum(LENGTHS))
        assert torch.equal(torch.isneginf(lse), torch.isneginf(golden_lse))
        finite = torch.isfinite(golden_lse)
        assert_close(lse[finite], golden_lse[finite])
        assert_close(lse[finite], want_lse[finite])
    for got, expected in zip(grads(out, (q, k, v)), grads(golden, (q, k, v)), strict=True):
        assert_close(got, expected)


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_float32_and_the_auto_backend(backend):
    q, k, v = packed(LENGTHS, LENGTHS, dtype=torch.float32)
    for chosen in (backend, "auto"):
        out, _ = varlen(q, k, v, LENGTHS, LENGTHS, causal=True, backend=chosen)
        golden, _ = one_by_one(q, k, v, LENGTHS, LENGTHS, golden_alone, causal=True)
        assert out.dtype == torch.float32
        assert max_error(out, golden) < 1e-5


def windowed_golden(left, right, causal):
    """golden_attention on one sequence with a bottom-right window (left, right)."""

    def attend(q, k, v):
        q_len, kv_len = q.shape[2], k.shape[2]
        position = torch.arange(q_len).view(-1, 1) + kv_len - q_len
        offset = torch.arange(kv_len).view(1, -1) - position
        mask = (offset >= -left) & (offset <= right)
        return golden_alone(q, k, v, mask=mask, causal=causal)

    return attend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,causal", [((8, 0), True), ((5, 3), False), (4, True)])
def test_a_window_inside_each_sequence(backend, window, causal):
    """Sequences longer than the window (130, 64), shorter (1, 5), and empty."""
    q, k, v = packed(LENGTHS, LENGTHS)
    out = attention_varlen(
        q,
        k,
        v,
        offsets(LENGTHS),
        offsets(LENGTHS),
        130,
        130,
        causal=causal,
        window=window,
        backend=backend,
    )
    left, right = (window, window) if isinstance(window, int) else window
    golden, _ = one_by_one(q, k, v, LENGTHS, LENGTHS, windowed_golden(left, right, causal))
    assert_close(out, golden)
    for got, expected in zip(grads(out, (q, k, v)), grads(golden, (q, k, v)), strict=True):
        assert_close(got, expected)


@pytest.mark.parametrize("backend", ["flash", "auto"])
def test_offsets_refilled_before_backward_leave_the_gradients_alone(backend):
    """A caller reusing its int64 cu_seqlens buffer: the pattern kept the caller's own
    tensor, so the tiled backward read the new offsets (gradients 3 off)."""
    q, k, v = packed([100, 200], [100, 200])
    cu = torch.tensor([0, 100, 300])  # int64, on the CPU: .to(int64) was no copy
    out = attention_varlen(q, k, v, cu, cu, 200, 200, window=(5, 5), backend=backend)
    grad_out = torch.randn(out.shape, dtype=out.dtype)
    expected = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    cu[1] = 150
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["key padding", "documents"])
def test_patterns_keep_their_own_tensors_when_the_caller_refills_them(kind):
    """KeyPadding and Document held the caller's tensors: a refill before backward
    changed the flash backward's mask."""
    q, k, v = (
        t.detach().view(1, 300, 4, 16).transpose(1, 2).requires_grad_()
        for t in packed([300], [300], heads=4, kv_heads=4)
    )
    # a boundary inside a block (a partial one, whose elements backward reads again)
    if kind == "key padding":
        source = torch.arange(300).view(1, -1) < 250
        pattern = mhsa.masks.KeyPadding(source)
    else:
        source = (torch.arange(300) >= 145).long()  # two documents
        pattern = mhsa.masks.Document(source)
    out = mhsa.attention(q, k, v, pattern, backend="flash")
    grad_out = torch.randn(out.shape, dtype=out.dtype)
    expected = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    source[..., 140:150] = False if kind == "key padding" else 1
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), expected, strict=True):
        assert torch.equal(got, want)


def alibi_modify(slopes):
    def modify(scores, i, j):
        return scores - slopes.double().view(1, -1, 1, 1) * (i - j).abs()

    return modify


def test_alibi_sees_positions_within_each_sequence():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)
    for k_lengths in (LENGTHS, KEY_LENGTHS):  # relative as is, and remapped
        q, k, v = packed(LENGTHS, k_lengths)
        for backend in ("flash", "reference"):
            out, _ = varlen(
                q, k, v, LENGTHS, k_lengths, causal=True, score=ALiBi(slopes), backend=backend
            )
            golden, _ = one_by_one(
                q,
                k,
                v,
                LENGTHS,
                k_lengths,
                golden_alone,
                causal=True,
                modify=alibi_modify(slopes),
            )
            assert_close(out, golden)
            inputs = (q, k, v, slopes)
            for got, want in zip(grads(out, inputs), grads(golden, inputs), strict=True):
                assert_close(got, want)


@pytest.mark.parametrize(
    "make_score",
    [
        lambda: RelativeBias(torch.randn(8, 4, dtype=torch.float64), 8, 20),
        lambda: ScoreMod(lambda s, b, h, i, j: s + 0.05 * i - 0.02 * j),  # absolute positions
        lambda: [ALiBi(torch.full((4,), 0.3, dtype=torch.float64)), Softcap(2.0)],
    ],
    ids=["t5", "score-mod-absolute", "alibi-softcap"],
)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_score_functions_restart_at_each_sequence(make_score, cross):
    k_lengths = KEY_LENGTHS if cross else LENGTHS
    q, k, v = packed(LENGTHS, k_lengths)
    score = make_score()
    for backend in ("flash", "reference"):
        out, lse = varlen(q, k, v, LENGTHS, k_lengths, score=score, backend=backend)
        want, want_lse = one_by_one(q, k, v, LENGTHS, k_lengths, looped(), score=score)
        assert_close(out, want)
        finite = torch.isfinite(want_lse)
        assert_close(lse[finite], want_lse[finite])
        for got, expected in zip(grads(out, (q, k, v)), grads(want, (q, k, v)), strict=True):
            assert_close(got, expected)


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_sinks(backend):
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    q, k, v = packed(LENGTHS, KEY_LENGTHS)
    out, lse = varlen(q, k, v, LENGTHS, KEY_LENGTHS, causal=True, sinks=sinks, backend=backend)
    golden, golden_lse = one_by_one(
        q, k, v, LENGTHS, KEY_LENGTHS, golden_alone, causal=True, sinks=sinks
    )
    assert_close(out, golden)
    assert_close(lse, golden_lse)  # rows without a key: their sink's logit
    inputs = (q, k, v, sinks)
    for got, want in zip(grads(out, inputs), grads(golden, inputs), strict=True):
        assert_close(got, want)


def test_nothing_to_attend():
    q, k, v = packed([0, 0], [0, 0])
    out, lse = varlen(q, k, v, [0, 0], [0, 0])
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    empty = torch.zeros(1, dtype=torch.int32)
    assert attention_varlen(q, k, v, empty, empty, 0, 0).shape == (0, 4, 16)
    q, k, v = packed([3, 2], [0, 0])  # queries without keys: 0, and zero gradients
    out, lse = varlen(q, k, v, [3, 2], [0, 0], causal=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_dropout_stays_inside_each_sequence():
    q, k, v = packed(LENGTHS, LENGTHS)
    torch.manual_seed(3)
    out = attention_varlen(
        q, k, v, offsets(LENGTHS), offsets(LENGTHS), 130, 130, dropout_p=0.3, backend="flash"
    )
    changed = v.detach().clone()
    changed[1:38] += 1.0  # the values of sequences 0 and 2 (rows 0..37)
    torch.manual_seed(3)
    again = attention_varlen(
        q,
        k,
        changed,
        offsets(LENGTHS),
        offsets(LENGTHS),
        130,
        130,
        dropout_p=0.3,
        backend="flash",
    )
    assert torch.equal(out[38:], again[38:])
    assert not torch.equal(out[1:38], again[1:38])


CU = torch.tensor([0, 2, 5], dtype=torch.int32)


@pytest.mark.parametrize(
    "changes,fragment",
    [
        (
            dict(cu_seqlens_q=torch.tensor([0, 4, 3, 5], dtype=torch.int32)),
            "cu_seqlens_q must not decrease",
        ),
        (
            dict(cu_seqlens_k=torch.tensor([1, 2, 5], dtype=torch.int32)),
            "cu_seqlens_k must start at 0",
        ),
        (
            dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0])),
            "cu_seqlens_q must be an int32 or int64",
        ),
        (dict(cu_seqlens_q=[0, 2, 5]), "cu_seqlens_q must be an int32 or int64"),
        (dict(cu_seqlens_q=torch.tensor([0, 2, 4])), "cu_seqlens_q ends at 4 but the packed"),
        (
            dict(cu_seqlens_k=torch.tensor([0, 5])),
            "cu_seqlens_q has 2 segments but cu_seqlens_k has 1",
        ),
        (dict(max_seqlen_q=2), "max_seqlen_q=2 is smaller than sequence 1, of length 3"),
        (dict(max_seqlen_k=2.0), "max_seqlen_k must be an int"),
        (dict(q=torch.randn(1, 5, 2, 8)), "q must be 3-D (total, num_heads, head_dim)"),
        (dict(window=(-1, 0)), "window's left must be an int >= 0"),
    ],
)
def test_bad_input_names_the_argument(changes, fragment):
    args = dict(
        q=torch.randn(5, 2, 8),
        k=torch.randn(5, 1, 8),
        v=torch.randn(5, 1, 8),
        cu_seqlens_q=CU,
        cu_seqlens_k=CU,
        max_seqlen_q=3,
        max_seqlen_k=3,
    )
    args.update(changes)
    message = expect_error(lambda: attention_varlen(**args))
    assert message is not None and fragment in message, message
    assert "\n" not in message


def test_mhsa_exports_it():
    assert mhsa.attention_varlen is attention_varlen
    assert "attention_varlen" in mhsa.__all__


def test_planning_a_thousand_sequences_follows_the_blocks():
    """A million tokens in 1000 sequences: a total x total mask (10^12 entries) or even
    the grid of all block pairs (61 million) would not be built here; the plan visits
    only the blocks on the diagonal."""
    lengths = [(i * 7919) % 1991 + 9 for i in range(1000)]
    cu = offsets(lengths)
    total = int(cu[-1])
    assert total > 10**6

    class NoGrid(Segments):
        def kinds(self, *args):  # the dense grid of block kinds
            raise AssertionError("the plan asked for the (query blocks x key blocks) grid")

    for causal in (False, True):
        pattern = NoGrid(cu, causal=causal)
        # the block plan of the plain and triton engines
        plan = build_plan(
            pattern, total, total, block_q=128, block_k=128, max_run_keys=1024, merge_rows=False
        )
        num_q = -(-total // 128)
        assert len(plan.rows) == num_q
        tiles = sum(-(-(run.k1 - run.k0) // 128) for rows in plan.rows for run in rows.runs)
        # each query block reaches its own sequences' keys: a few blocks each
        assert tiles <= num_q * (2 + max(lengths) // 128 + 1)
        assert plan.visited_fraction < 0.01
        # the fused engine's: one piece per sequence, no element mask anywhere
        plan = build_plan(pattern, total, total, block_q=128, block_k=128, gather=True)
        assert [(rows.q0, rows.q1) for rows in plan.rows] == list(
            zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
        )
        kinds = {(run.full, run.triangle) for rows in plan.rows for run in rows.runs}
        assert kinds == ({(False, "lower")} if causal else {(True, None)})


def test_triton_names_per_sequence_positions_not_the_wrapper_that_holds_them():
    """attention_varlen wraps a score for packed cross-attention in AtPositions; the
    refusal said triton evaluates ALiBi "but not AtPositions" for a call given ALiBi."""
    from mhsa.core.backends.triton import score_reason

    reason = score_reason(("AtPositions",))
    assert "not at per-sequence ones" in reason and "AtPositions" not in reason
