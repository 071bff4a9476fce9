"""mhsa.flex.flex_attention: FlexAttention's recipes equal torch's flex_attention (run
eagerly, forward only: torch has no CPU backward) and the float64 formula written out
here (dense scores, score_mod, mask, softmax) in forward and backward, gradients of
captured tensors included; and bad input is a clear error."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mhsa.core.scores import ALiBi, Softcap
from mhsa.flex import available, create_block_mask, flex_attention
from mhsa.integrations import flex_blocks

flex_api = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def formula(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """(out, lse) in float64 from the definition: scores q k^T * scale, score_mod on
    each (b, h, q_idx, kv_idx) with indices from 0 (top-left), -inf where mask_mod
    forbids, softmax; a row with no allowed key gives 0 and lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    batch, heads, q_len, kv_len = scores.shape
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    i = torch.arange(q_len).view(1, 1, -1, 1)
    j = torch.arange(kv_len).view(1, 1, 1, -1)
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j).expand(scores.shape)
    if mask_mod is not None:
        allowed = mask_mod(b, h, i, j).expand(scores.shape)
        scores = scores.masked_fill(~allowed, -torch.inf)
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    safe = scores.masked_fill(dead, 0.0)
    probs = torch.softmax(safe, dim=-1).masked_fill(dead, 0.0)
    lse = torch.logsumexp(safe, dim=-1).masked_fill(dead.squeeze(-1), -torch.inf)
    return probs @ v, lse


def torch_flex(q, k, v, score_mod=None, block_mask=None, enable_gqa=False):
    """torch's own flex_attention, eagerly (forward only on CPU), with its lse."""
    aux = getattr(flex_api, "AuxRequest", None)
    with torch.no_grad():
        if aux is None:
            return flex_api.flex_attention(
                q, k, v, score_mod, block_mask, enable_gqa=enable_gqa, return_lse=True
            )
        out, extra = flex_api.flex_attention(
            q, k, v, score_mod, block_mask, enable_gqa=enable_gqa, return_aux=aux(lse=True)
        )
        return out, extra.lse


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx >= 0) & (q_idx - kv_idx <= 40)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 50) | (q_idx >= kv_idx)


DOCUMENTS = torch.tensor([0] * 37 + [1] * 90 + [2] * 10 + [3] * 66)  # 203 positions


def documents(b, h, q_idx, kv_idx):
    return (DOCUMENTS[q_idx] == DOCUMENTS[kv_idx]) & (q_idx >= kv_idx)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def causal_by_score(score, b, h, q_idx, kv_idx):  # masking inside a score_mod, -inf
    return torch.where(q_idx >= kv_idx, score, -torch.inf)


# (name, score_mod, mask_mod, L, S)
RECIPES = [
    ("causal", None, causal, 203, 203),
    ("causal L < S (top-left)", None, causal, 113, 203),
    ("sliding window", None, window, 203, 203),
    ("prefix-LM", None, prefix_lm, 203, 203),
    ("document, causal", None, documents, 203, 203),
    ("ALiBi", alibi, None, 203, 203),
    ("ALiBi, causal, L > S", alibi, causal, 150, 97),
    ("softcap, causal", softcap, causal, 203, 203),
    ("softcap, window", softcap, window, 113, 203),
    ("causal as a score_mod", causal_by_score, None, 113, 203),
]


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize(
    ("name", "score_mod", "mask_mod", "q_len", "kv_len"), RECIPES, ids=[r[0] for r in RECIPES]
)
def test_recipes_equal_torch_and_the_formula(name, score_mod, mask_mod, q_len, kv_len, block):
    q, k, v = (torch.randn(2, 4, n, 16) for n in (q_len, kv_len, kv_len))
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, "cpu", block)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flex_attention(*leaves, score_mod, block_mask, return_lse=True)
    theirs, their_lse = torch_flex(q, k, v, score_mod, block_mask)
    assert (out - theirs).abs().max() < 1e-5
    finite = torch.isfinite(their_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse - their_lse)[finite].abs().max() < 1e-5
    # backward against the float64 formula
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = formula(*ref_leaves, score_mod, mask_mod)
    assert (out.double() - ref).abs().max() < 2e-5
    assert (lse.double() - ref_lse)[finite].abs().max() < 1e-5
    (ref * grad_out.double()).sum().backward()
    for mine, expected in zip(leaves, ref_leaves, strict=True):
        assert (mine.grad.double() - expected.grad).abs().max() < 1e-4


@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 203), (2, 3), (203, 1), (129, 128)])
def test_awkward_shapes_and_strides(q_len, kv_len):
    """L = 1, tiny calls (no score_mod probe), L > S and non-contiguous inputs made as
    (B, L, H, D), with head_dim 59."""
    q = torch.randn(2, q_len, 4, 59).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, kv_len, 4, 59).transpose(1, 2).requires_grad_() for _ in range(2))
    block_mask = create_block_mask(prefix_lm, None, None, q_len, kv_len, "cpu", 64)
    out, lse = flex_attention(q, k, v, alibi, block_mask, return_lse=True)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = formula(*ref_inputs, alibi, prefix_lm)
    assert (out.double() - ref).abs().max() < 2e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5
    out.sum().backward()
    ref.sum().backward()
    for mine, expected in zip((q, k, v), ref_inputs, strict=True):
        assert (mine.grad.double() - expected.grad).abs().max() < 1e-4


def test_a_tensor_indexed_score_mod_trains_its_table():
    """A learned relative-position table indexed by kv_idx - q_idx: gradients reach it,
    and equal the float64 formula's."""
    q_len, kv_len, heads = 70, 90, 4
    table = torch.randn(heads, q_len + kv_len - 1, requires_grad=True)

    def relative(bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h, kv_idx - q_idx + q_len - 1]

        return score_mod

    q, k, v = (torch.randn(2, heads, n, 16, requires_grad=True) for n in (q_len, kv_len, kv_len))
    block_mask = create_block_mask(causal, None, None, q_len, kv_len, "cpu", 32)
    out = flex_attention(q, k, v, relative(table), block_mask)
    theirs, _ = torch_flex(q.detach(), k.detach(), v.detach(), relative(table.detach()), block_mask)
    assert (out - theirs).abs().max() < 1e-5
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()
    table64 = table.detach().double().requires_grad_()
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = formula(*ref_inputs, relative(table64), causal)
    (ref * grad_out.double()).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    assert (table.grad.double() - table64.grad).abs().max() < 1e-4
    for mine, expected in zip((q, k, v), ref_inputs, strict=True):
        assert (mine.grad.double() - expected.grad).abs().max() < 1e-4


def test_a_module_parameter_closed_over_gets_its_gradient():
    bias = nn.Embedding(8, 2)  # per head, per distance bucket (distance // 16, capped)

    def score_mod(score, b, h, q_idx, kv_idx):
        bucket = ((q_idx - kv_idx).abs() // 16).clamp(max=7)
        return score + bias.weight[bucket, h]

    q, k, v = (torch.randn(1, 2, 100, 8, requires_grad=True) for _ in range(3))
    flex_attention(q, k, v, score_mod).sum().backward()
    weight64 = bias.weight.detach().double().requires_grad_()

    def score_mod64(score, b, h, q_idx, kv_idx):
        return score + weight64[((q_idx - kv_idx).abs() // 16).clamp(max=7), h]

    ref, _ = formula(q.detach(), k.detach(), v.detach(), score_mod64)
    ref.sum().backward()
    assert (bias.weight.grad.double() - weight64.grad).abs().max() < 1e-4


def test_grouped_query_attention_with_a_per_head_mask():
    windows = torch.tensor([4, 9, 17, 40])

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])

    q = torch.randn(2, 4, 150, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 150, 16, requires_grad=True) for _ in range(2))
    block_mask = create_block_mask(per_head, None, 4, 150, 150, "cpu", 32)
    for score_mod in (alibi, None):  # unfused tiles and the fused kernel
        out, lse = flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True)
        theirs, their_lse = torch_flex(
            q.detach(), k.detach(), v.detach(), score_mod, block_mask, enable_gqa=True
        )
        assert (out - theirs).abs().max() < 1e-5 and (lse - their_lse).abs().max() < 1e-5
        for t in (q, k, v):
            t.grad = None
        out.sum().backward()
        ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = formula(*ref_inputs, score_mod, per_head)
        ref.sum().backward()
        for mine, expected in zip((q, k, v), ref_inputs, strict=True):
            assert (mine.grad.double() - expected.grad).abs().max() < 1e-4


def test_per_sequence_documents_with_a_batch_mask():
    ids = torch.stack([DOCUMENTS, DOCUMENTS.flip(0)])  # (B, S): each sequence its own packing

    def packed(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    q, k, v = (torch.randn(2, 2, 203, 16) for _ in range(3))
    block_mask = create_block_mask(packed, 2, None, 203, 203, "cpu", 32)
    out = flex_attention(q, k, v, block_mask=block_mask)
    assert (out - torch_flex(q, k, v, None, block_mask)[0]).abs().max() < 1e-5
    assert (out.double() - formula(q, k, v, None, packed)[0]).abs().max() < 2e-5


def test_rows_with_no_allowed_key_give_zero_and_lse_minus_inf():
    def holes(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx % 7 != 3)

    q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))
    block_mask = create_block_mask(holes, None, None, 64, 64, "cpu", 16)
    for score_mod in (None, softcap):  # the fused kernel and the unfused tiles
        out, lse = flex_attention(q, k, v, score_mod, block_mask, return_lse=True)
        dead = torch.arange(64) % 7 == 3
        assert torch.isneginf(lse[..., dead]).all() and torch.isfinite(lse[..., ~dead]).all()
        assert (out[..., dead, :] == 0).all()
        q.grad = None
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and (q.grad[..., dead, :] == 0).all()


def test_the_lse_is_differentiable():
    q, k, v = (torch.randn(1, 2, 50, 8, requires_grad=True) for _ in range(3))
    _, lse = flex_attention(q, k, v, alibi, return_lse=True)
    lse.sum().backward()
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    formula(*ref_inputs, alibi)[1].sum().backward()
    for mine, expected in zip((q, k), ref_inputs[:2], strict=True):
        assert (mine.grad.double() - expected.grad).abs().max() < 1e-4
    assert v.grad is None or (v.grad == 0).all()  # the lse does not depend on v


def test_scale_and_a_different_value_dim():
    q, k = torch.randn(1, 2, 33, 16), torch.randn(1, 2, 47, 16)
    v = torch.randn(1, 2, 47, 24)
    block_mask = create_block_mask(causal, None, None, 33, 47, "cpu", 16)
    out = flex_attention(q, k, v, softcap, block_mask, scale=0.3)
    assert out.shape == (1, 2, 33, 24)
    assert (out.double() - formula(q, k, v, softcap, causal, scale=0.3)[0]).abs().max() < 2e-5


def test_mhsa_score_functions_are_applied_at_flex_indices():
    """ALiBi (additive: the fused kernel) and Softcap as score_mod equal the same
    function written as a Flex score_mod, with L != S (where the indices differ)."""
    q, k, v = (torch.randn(1, 4, n, 16) for n in (40, 72, 72))
    block_mask = create_block_mask(causal, None, None, 40, 72, "cpu", 16)
    for ours, theirs in ((ALiBi(SLOPES), alibi), (Softcap(5.0), softcap)):
        expected = formula(q, k, v, theirs, causal)[0]
        assert (flex_attention(q, k, v, ours, block_mask).double() - expected).abs().max() < 2e-5


def test_torchs_own_block_mask_is_accepted():
    mask = flex_api.create_block_mask(window, None, None, 203, 203, device="cpu", BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 2, 203, 16) for _ in range(3))
    ours = create_block_mask(window, None, None, 203, 203, "cpu", 32)
    assert torch.equal(
        flex_attention(q, k, v, block_mask=mask), flex_attention(q, k, v, block_mask=ours)
    )
    assert (
        flex_attention(q, k, v, block_mask=mask).double() - formula(q, k, v, None, window)[0]
    ).abs().max() < 2e-5


def test_a_block_mask_from_blocks_alone_allows_exactly_its_blocks():
    """BlockMask.from_kv_blocks without a mask_mod: listed blocks attend whole, others not
    at all (FlexAttention's compiled semantics)."""
    layout = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)  # 3 x 3 blocks
    counts = layout.sum(-1).int().view(1, 1, 3)
    indices = torch.argsort(layout.int(), dim=-1, descending=True, stable=True).int()
    mask = flex_api.BlockMask.from_kv_blocks(counts, indices.view(1, 1, 3, 3), BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, 2, 48, 8) for _ in range(3))

    def blocks(b, h, q_idx, kv_idx):
        return layout[q_idx // 16, kv_idx // 16]

    expected = formula(q, k, v, None, blocks)[0]
    assert (flex_attention(q, k, v, block_mask=mask).double() - expected).abs().max() < 2e-5


def test_mask_mod_runs_on_partial_blocks_only():
    """A causal mask of 4 x 4 blocks of 128 (FlexAttention's default): flex_attention,
    forward and backward, calls mask_mod only inside the diagonal blocks (the others
    are skipped or full), on the fused kernel's path and on the unfused tiles'."""
    seen = []

    def recording(b, h, q_idx, kv_idx):
        seen.append((q_idx.flatten() // 128, kv_idx.flatten() // 128))
        return q_idx >= kv_idx

    block_mask = create_block_mask(recording, None, None, 512, 512, "cpu")
    q, k, v = (torch.randn(1, 2, 512, 16, requires_grad=True) for _ in range(3))
    for score_mod in (None, softcap):
        seen.clear()
        flex_attention(q, k, v, score_mod, block_mask).sum().backward()
        assert len(seen) >= 4
        for rows, cols in seen:
            assert len(rows.unique()) == 1 and torch.equal(rows.unique(), cols.unique())


def test_no_block_mask_and_the_noop_block_mask_attend_everything():
    q, k, v = (torch.randn(1, 2, 30, 8) for _ in range(3))
    expected = formula(q, k, v)[0]
    assert (flex_attention(q, k, v).double() - expected).abs().max() < 2e-5
    noop = flex_api._create_empty_block_mask(q, k)
    assert (flex_attention(q, k, v, block_mask=noop).double() - expected).abs().max() < 2e-5


def test_a_key_batch_of_one_is_shared_with_a_block_mask():
    q = torch.randn(3, 2, 20, 8)
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    block_mask = create_block_mask(causal, 3, None, 20, 20, "cpu", 16)
    out = flex_attention(q, k, v, block_mask=block_mask)
    expected = formula(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), None, causal)[0]
    assert (out.double() - expected).abs().max() < 2e-5


def test_available(monkeypatch):
    usable, why = available()
    assert usable is True and "backward" in why

    def missing():
        raise ImportError("no flex_attention")

    monkeypatch.setattr("mhsa.integrations.flex.flex_module", missing)
    assert available() == (
        False,
        "needs torch.nn.attention.flex_attention (torch >= 2.5) for its BlockMask",
    )


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda q, k, v: flex_attention(q[0], k, v), ValueError, "query must be 4-D"),
        (lambda q, k, v: flex_attention(q, k, v[..., 0]), ValueError, "value must be 4-D"),
        (lambda q, k, v: flex_attention(q.numpy(), k, v), TypeError, "query must be a torch"),
        (lambda q, k, v: flex_attention(q, k[:, :2], v[:, :2]), ValueError, "enable_gqa=True"),
        (
            lambda q, k, v: flex_attention(q, k[:, :3], v[:, :3], enable_gqa=True),
            ValueError,
            "multiple of key/value heads",
        ),
        (lambda q, k, v: flex_attention(q, k[:1], v[:1]), ValueError, "batch 2 but key has 1"),
        (lambda q, k, v: flex_attention(q, k, v, score_mod=3), TypeError, "score_mod must be"),
        (lambda q, k, v: flex_attention(q, k, v, block_mask="causal"), TypeError, "BlockMask"),
        (
            lambda q, k, v: flex_attention(
                q, k, v, block_mask=create_block_mask(causal, None, None, 16, 16, "cpu")
            ),
            ValueError,
            r"made for \(Q_LEN, KV_LEN\) = \(16, 16\) but query has L=12",
        ),
        (
            lambda q, k, v: flex_attention(
                q, k, v, block_mask=create_block_mask(causal, 3, None, 12, 12, "cpu")
            ),
            ValueError,
            r"block_mask is for \(B, H\) = \(3, 1\)",
        ),
        (
            lambda q, k, v: flex_attention(
                q,
                k,
                v,
                block_mask=create_block_mask(causal, None, None, 12, 12, "cpu", 4)[:, :, :1],
            ),
            ValueError,
            "query block rows",
        ),
        (
            lambda q, k, v: flex_attention(
                q, k, v, lambda s, b, h, qi, ki: s - s.amax(-1, keepdim=True)
            ),
            ValueError,
            "not elementwise",
        ),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    q, k, v = (torch.randn(2, 4, 12, 8) for _ in range(3))
    with pytest.raises(error, match=match):
        call(q, k, v)


def test_a_block_mask_changed_after_use_is_lowered_again():
    """Lowered BlockMasks are reused across calls, but not after an in-place edit of its
    tensors, of a tensor its mask_mod reads, or a new mask_mod."""
    q, k, v = (torch.randn(1, 2, 48, 8) for _ in range(3))
    mask = create_block_mask(causal, None, None, 48, 48, "cpu", 16)
    assert torch.equal(
        flex_attention(q, k, v, block_mask=mask), flex_attention(q, k, v, block_mask=mask)
    )
    mask.full_kv_num_blocks.zero_()  # only the diagonal blocks are left

    def diagonal_blocks(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // 16 == kv_idx // 16)

    expected = formula(q, k, v, None, diagonal_blocks)[0]
    assert (flex_attention(q, k, v, block_mask=mask).double() - expected).abs().max() < 2e-5
    mask.mask_mod = lambda b, h, q_idx, kv_idx: q_idx == kv_idx
    expected = formula(q, k, v, None, lambda b, h, q_idx, kv_idx: q_idx == kv_idx)[0]
    assert (flex_attention(q, k, v, block_mask=mask).double() - expected).abs().max() < 2e-5
    window = torch.tensor(20)  # a window a training loop narrows, read by the mask_mod

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    mask = create_block_mask(sliding, None, None, 48, 48, "cpu", 16, separate_full_blocks=False)
    flex_attention(q, k, v, block_mask=mask)
    window.fill_(5)
    expected = formula(q, k, v, None, sliding)[0]
    assert (flex_attention(q, k, v, block_mask=mask).double() - expected).abs().max() < 2e-5

    class Windowed(nn.Module):  # the window as a module's buffer, read by its method
        def __init__(self):
            super().__init__()
            self.register_buffer("window", torch.tensor(20))

        def mask_mod(self, b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < self.window)

    module = Windowed()
    mask = create_block_mask(
        module.mask_mod, None, None, 48, 48, "cpu", 16, separate_full_blocks=False
    )
    flex_attention(q, k, v, block_mask=mask)
    module.window.fill_(5)
    expected = formula(q, k, v, None, module.mask_mod)[0]
    assert (flex_attention(q, k, v, block_mask=mask).double() - expected).abs().max() < 2e-5


def test_bfloat16_within_twice_the_naive_error():
    """Low precision: the error against float64 is at most twice that of the same
    formula computed in bfloat16, plus a small floor (the house rule)."""
    q, k, v = (torch.randn(1, 4, 150, 32, dtype=torch.bfloat16) for _ in range(3))
    block_mask = create_block_mask(window, None, None, 150, 150, "cpu", 32)
    expected = formula(q, k, v, alibi, window)[0]
    scores = (q @ k.transpose(-1, -2)) * 32**-0.5
    index = [torch.arange(n).view(shape) for n, shape in ((150, (-1, 1)), (150, (1, -1)))]
    scores = alibi(scores, 0, torch.arange(4).view(-1, 1, 1), *index)
    scores = scores.masked_fill(~window(0, 0, *index), -torch.inf).to(torch.bfloat16)
    naive = torch.softmax(scores, dim=-1) @ v
    for score_mod in (alibi, ALiBi(SLOPES)):  # unfused tiles and the fused kernel
        out = flex_attention(q, k, v, score_mod, block_mask)
        assert out.dtype == torch.bfloat16
        error = (out.double() - expected).abs().max()
        assert error <= 2 * (naive.double() - expected).abs().max() + 1e-3


@pytest.mark.parametrize("block", [(32, 16), (16, 48), (256, 256)])
def test_any_block_shape(block):
    """BlockMasks whose blocks differ from the engine's tiles (non-square, or larger
    than the sequence) give the same result."""
    q, k, v = (torch.randn(2, 2, n, 16, requires_grad=True) for n in (113, 203, 203))
    mask = create_block_mask(documents, None, None, 113, 203, "cpu", block)
    for score_mod in (None, softcap):
        out = flex_attention(q, k, v, score_mod, mask)
        ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = formula(*ref_inputs, score_mod, documents)[0]
        assert (out.double() - ref).abs().max() < 2e-5
        for t in (q, k, v):
            t.grad = None
        out.sum().backward()
        ref.sum().backward()
        for mine, expected in zip((q, k, v), ref_inputs, strict=True):
            assert (mine.grad.double() - expected.grad).abs().max() < 1e-4


def test_torchs_helpers_and_return_aux_make_it_a_drop_in():
    """`from mhsa.flex import ...` serves what FlexAttention code imports: and_masks,
    or_masks, noop_mask, BlockMask, AuxRequest; return_aux and kernel_options are taken."""
    from mhsa import flex

    assert flex.BlockMask is flex_api.BlockMask and flex.noop_mask is flex_api.noop_mask
    sliding = flex.and_masks(causal, lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 20)
    mask = create_block_mask(flex.or_masks(sliding, prefix_lm), None, None, 100, 100, "cpu", 32)
    q, k, v = (torch.randn(1, 2, 100, 8) for _ in range(3))

    def expected_mask(b, h, q_idx, kv_idx):
        return ((q_idx >= kv_idx) & (q_idx - kv_idx <= 20)) | prefix_lm(b, h, q_idx, kv_idx)

    expected, expected_lse = formula(q, k, v, None, expected_mask)
    out = flex_attention(q, k, v, block_mask=mask, kernel_options={"BLOCK_M": 64})
    assert (out.double() - expected).abs().max() < 2e-5
    if hasattr(flex_api, "AuxRequest"):
        out, aux = flex_attention(q, k, v, block_mask=mask, return_aux=flex.AuxRequest(lse=True))
        assert isinstance(aux, flex_api.AuxOutput) and aux.max_scores is None
        assert (aux.lse.double() - expected_lse).abs().max() < 1e-5
        with pytest.raises(ValueError, match="max_scores"):
            flex_attention(q, k, v, return_aux=flex.AuxRequest(lse=True, max_scores=True))
        with pytest.raises(ValueError, match="not both"):
            flex_attention(q, k, v, return_lse=True, return_aux=flex.AuxRequest(lse=True))
    with pytest.raises(AttributeError, match="no attribute 'create_mask_of'"):
        flex.create_mask_of  # noqa: B018
    # torch's 8th parameter, _compile (gpt-fast, modded-nanogpt), by name or place
    for compiled in (
        create_block_mask(causal, 1, 1, 64, 64, "cpu", 32, True),
        create_block_mask(causal, 1, 1, 64, 64, "cpu", 32, _compile=True),
    ):
        assert compiled.full_kv_num_blocks is not None  # (False once meant no full blocks)


@pytest.mark.parametrize("with_score_mod", [False, True])
def test_gradcheck_in_float64(with_score_mod):
    """torch.autograd.gradcheck through flex_attention, the captured table included."""
    table = torch.randn(2, 13, dtype=torch.float64, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return 3 * torch.tanh(score / 3) + table[h, kv_idx - q_idx + 5]

    mask = create_block_mask(prefix_lm, None, None, 6, 8, "cpu", 4)
    inputs = [torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (6, 8, 8)]

    def fn(q, k, v, table):
        return flex_attention(q, k, v, relative if with_score_mod else None, mask)

    assert torch.autograd.gradcheck(fn, (*inputs, table))


def test_a_tensor_whose_gradient_would_be_lost_is_an_error():
    """A table held in a dict the score_mod closes over is not found: rather than drop
    its gradient, flex_attention says so. Tables passed through functools.partial, or
    read from a module whose method is the score_mod, are found and trained; a table
    computed from a parameter (not a leaf) closed over directly passes its gradient on."""
    import functools

    base = torch.randn(2, 2 * 40 - 1, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx, table):
        return score + table[h, kv_idx - q_idx + 39]

    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    held = {"table": base}

    def from_a_dict(score, b, h, q_idx, kv_idx):
        return relative(score, b, h, q_idx, kv_idx, held["table"])

    with pytest.raises(
        ValueError, match=r"requires grad but is held where mhsa does not look \(in a dict"
    ):
        flex_attention(q, k, v, from_a_dict)
    with torch.no_grad():  # no gradient wanted: nothing to lose
        flex_attention(q, k, v, from_a_dict)
    base64 = base.detach().double().requires_grad_()
    formula(q, k, v, lambda *args: relative(*args, base64))[0].sum().backward()

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(base.detach().clone())

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return relative(score, b, h, q_idx, kv_idx, self.table)

    module = Table()
    for score_mod, table in (
        (functools.partial(relative, table=base), base),
        (module.score_mod, module.table),
    ):
        flex_attention(q, k, v, score_mod).sum().backward()  # (both once an error)
        assert (table.grad.double() - base64.grad).abs().max() < 1e-4
    base.grad = base64.grad = None
    doubled = base * 2

    def closed_over(score, b, h, q_idx, kv_idx):
        return relative(score, b, h, q_idx, kv_idx, doubled)

    flex_attention(q, k, v, closed_over).sum().backward()
    base64 = base.detach().double().requires_grad_()
    formula(q, k, v, lambda *args: relative(*args, base64 * 2))[0].sum().backward()
    assert (base.grad.double() - base64.grad).abs().max() < 1e-4


def test_a_sliced_block_mask_needs_its_mask_mod_back():
    """torch's BlockMask[...] resets mask_mod; using it says how to fix that, and with
    the mask_mod set again the slice works."""
    mask = create_block_mask(causal, 2, None, 64, 64, "cpu", 16)[1:2]
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    with pytest.raises(ValueError, match="sliced.mask_mod to the original"):
        flex_attention(q, k, v, block_mask=mask)
    mask.mask_mod = causal
    expected = formula(q, k, v, None, causal)[0]
    assert (flex_attention(q, k, v, block_mask=mask).double() - expected).abs().max() < 2e-5


def test_create_block_mask_builds_on_the_cpu_where_no_gpu_is_usable(monkeypatch):
    """A CUDA build of torch on a machine without a GPU reports cuda as its accelerator;
    torch's default device="cuda" fails there ("Found no NVIDIA driver"), ours builds
    on the CPU. With a GPU, the default is cuda, as torch's."""
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda")
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mask = create_block_mask(causal, None, None, 8, 8)
    assert mask.kv_num_blocks.device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flex_blocks._default_device() == torch.device("cuda")


def test_decoding_with_a_sliced_block_mask_as_gpt_fast_does():
    """One query at position p against a cache of S slots: the causal BlockMask's row
    of p's block, with mask_mod shifted by p and seq_lengths (1, S)."""
    slots, position = 300, 211
    full = create_block_mask(causal, None, None, slots, slots, "cpu")
    step = full[:, :, position // 128 : position // 128 + 1]

    def shifted(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx + position, kv_idx)

    step.mask_mod, step.seq_lengths = shifted, (1, slots)
    q = torch.randn(1, 2, 1, 16)
    k, v = (torch.randn(1, 2, slots, 16) for _ in range(2))
    expected = formula(q, k, v, None, shifted)[0]
    assert (flex_attention(q, k, v, block_mask=step).double() - expected).abs().max() < 2e-5
