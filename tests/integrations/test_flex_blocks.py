"""mhsa.flex.create_block_mask builds torch's BlockMask, field for field, without an
L x S mask; and a BlockMask lowers to block kinds the flash engine can plan with."""

from __future__ import annotations

import inspect

import pytest
import torch

from mhsa.core.masks import EMPTY, FULL
from mhsa.core.masks.blocks import reduce_blocks
from mhsa.integrations import flex_blocks
from mhsa.integrations.flex_blocks import BlockMaskPattern, block_kinds, create_block_mask

flex_api = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)
IDS = torch.tensor([0] * 30 + [1] * 50 + [2] * 20)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def per_head_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 8 * (h + 1)


def per_sequence(b, h, q_idx, kv_idx):
    return (IDS[q_idx] == IDS[kv_idx]) | (kv_idx < 5 * b)


def everything(b, h, q_idx, kv_idx):
    return kv_idx >= 0


CASES = [
    ("causal", causal, None, None, 100, 100, 16),
    ("causal L != S, uneven blocks", causal, None, None, 70, 100, (32, 16)),
    ("per head", per_head_window, None, 3, 100, 100, 16),
    ("per sequence", per_sequence, 2, None, 100, 100, 32),
    ("everything, one block", everything, None, None, 100, 100, 128),
]


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize(
    ("name", "mask_mod", "batch", "heads", "q_len", "kv_len", "block"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_fields_equal_torchs(name, mask_mod, batch, heads, q_len, kv_len, block, separate):
    # torch before 2.12 has no separate_full_blocks: it always separates them
    if "separate_full_blocks" in inspect.signature(flex_api.create_block_mask).parameters:
        options = {"separate_full_blocks": separate}
    elif separate:
        options = {}
    else:
        pytest.skip(f"torch {torch.__version__}'s create_block_mask always separates full blocks")
    ours = create_block_mask(
        mask_mod, batch, heads, q_len, kv_len, "cpu", block, separate_full_blocks=separate
    )
    theirs = flex_api.create_block_mask(
        mask_mod, batch, heads, q_len, kv_len, "cpu", block, **options
    )
    assert isinstance(ours, flex_api.BlockMask)
    assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    assert ours.mask_mod is mask_mod
    for field in FIELDS:
        mine, expected = getattr(ours, field), getattr(theirs, field)
        assert (mine is None) == (expected is None), field
        if mine is not None:
            assert mine.dtype == expected.dtype and torch.equal(mine, expected), field


def test_mask_mod_is_evaluated_in_chunks_never_l_by_s(monkeypatch):
    sizes = []

    def recording(b, h, q_idx, kv_idx):
        sizes.append(q_idx.numel() * kv_idx.numel())
        return q_idx >= kv_idx

    monkeypatch.setattr(flex_blocks, "CHUNK_ENTRIES", 1 << 14)
    ours = create_block_mask(recording, None, None, 1000, 1000, "cpu", 32)
    assert len(sizes) > 1 and max(sizes) <= 1 << 14
    theirs = flex_api.create_block_mask(causal, None, None, 1000, 1000, "cpu", 32)
    assert torch.equal(ours.kv_indices, theirs.kv_indices)
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)


def test_block_kinds_read_the_index_tensors():
    mask = create_block_mask(per_head_window, None, 2, 64, 64, "cpu", 16)
    kinds = block_kinds(mask, 4, 4)
    dense = flex_api.create_mask(per_head_window, 1, 2, 64, 64, "cpu")
    assert kinds.shape == (1, 2, 4, 4)
    for head in range(2):
        expected = reduce_blocks(dense[:, head], 64, 64, 16, 16)
        assert torch.equal(kinds[0, head], expected)


@pytest.mark.parametrize(("block_q", "block_k"), [(16, 16), (32, 32), (48, 20), (128, 128)])
def test_kinds_at_any_tile_size_are_safe(block_q, block_k):
    """At the BlockMask's own block size the kinds are its blocks (conservative over
    heads); at any other tile size a FULL tile is all allowed and an EMPTY one all
    forbidden."""
    mask = create_block_mask(per_head_window, None, 2, 100, 90, "cpu", 16)
    pattern = BlockMaskPattern(mask, 1, 2, 100, 90)
    kinds = pattern.kinds(100, 90, block_q, block_k)
    dense = pattern.dense(100, 90).expand(1, 2, 100, 90)
    exact = reduce_blocks(dense, 100, 90, block_q, block_k)
    assert kinds.shape == exact.shape
    assert ((kinds == FULL) <= (exact == FULL)).all() and (
        (kinds == EMPTY) <= (exact == EMPTY)
    ).all()
    if (block_q, block_k) == (16, 16):  # its own blocks, lengths their multiples: exact
        mask = create_block_mask(per_head_window, None, 2, 96, 96, "cpu", 16)
        even = BlockMaskPattern(mask, 1, 2, 96, 96)
        exact = reduce_blocks(even.dense(96, 96), 96, 96, 16, 16)
        assert torch.equal(even.kinds(96, 96, 16, 16), exact)


def test_the_pattern_is_the_block_mask_semantics():
    """Listed partial blocks take mask_mod, full ones everything, unlisted ones nothing,
    whatever mask_mod says there."""
    mask = create_block_mask(causal, None, None, 64, 64, "cpu", 16)
    counts = torch.tensor([1, 0, 0, 0], dtype=torch.int32).view(1, 1, 4)
    mask.full_kv_num_blocks = counts.clone()
    mask.full_kv_indices = torch.tensor([[3, 0, 0, 0]] * 4, dtype=torch.int32).view(1, 1, 4, 4)
    dense = BlockMaskPattern(mask, 1, 1, 64, 64).dense(64, 64)[0, 0]
    rows, cols = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
    expected = (rows >= cols) & (cols // 16 == rows // 16)  # partial: the diagonal blocks
    expected[:16, 48:] = True  # row block 0 lists key block 3 as full
    assert torch.equal(dense, expected)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: create_block_mask(3, None, None, 8, 8, "cpu"), TypeError, "mask_mod must be"),
        (lambda: create_block_mask(causal, 0, None, 8, 8, "cpu"), ValueError, "B must be"),
        (lambda: create_block_mask(causal, None, 1.5, 8, 8, "cpu"), ValueError, "H must be"),
        (lambda: create_block_mask(causal, None, None, 0, 8, "cpu"), ValueError, "Q_LEN"),
        (lambda: create_block_mask(causal, None, None, 8, 8, "cpu", (0, 4)), ValueError, "BLOCK"),
        (
            lambda: create_block_mask(lambda b, h, q, kv: q - kv, None, None, 8, 8, "cpu"),
            ValueError,
            "must return a bool tensor",
        ),
        (
            lambda: create_block_mask(
                lambda b, h, q, kv: (q >= kv) and (q < 4), None, None, 8, 8, "cpu"
            ),
            ValueError,
            "not under vmap",
        ),
        (
            lambda: create_block_mask(
                lambda b, h, q, kv: torch.ones(3, 3, dtype=torch.bool), None, None, 8, 8, "cpu"
            ),
            ValueError,
            "does not broadcast",
        ),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_causal_block_mask_is_one_triangle_and_a_near_causal_one_is_not():
    """Flex's causal mask makes the whole call one lower triangle (the fused kernel's
    causal mode, no mask tile); a causal mask missing one entry, on or below the
    diagonal blocks, does not."""
    from mhsa.core.kernels.plan import build_plan

    def missing(q0, k0):
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & ~((q_idx == q0) & (kv_idx == k0))

        return mask_mod

    for q_len, kv_len in ((100, 100), (70, 100), (100, 70)):
        mask = create_block_mask(causal, None, None, q_len, kv_len, "cpu", 32)
        pattern = BlockMaskPattern(mask, 1, 1, q_len, kv_len)
        assert pattern.lower_triangular(0, q_len, 0, kv_len, q_len, kv_len)
        plan = build_plan(pattern, q_len, kv_len, block_q=32, block_k=32, gather=True)
        assert [
            (r.q0, r.q1, [(run.k0, run.k1, run.triangle) for run in r.runs]) for r in plan.rows
        ] == [(0, q_len, [(0, kv_len, "lower")])]
    for hole in ((40, 35), (90, 10)):  # in a diagonal block, below the diagonal
        mask = create_block_mask(missing(*hole), None, None, 100, 100, "cpu", 32)
        pattern = BlockMaskPattern(mask, 1, 1, 100, 100)
        assert not pattern.lower_triangular(0, 100, 0, 100, 100, 100)
        dense = pattern.dense(100, 100)[0, 0]
        expected = torch.ones(100, 100, dtype=torch.bool).tril()
        expected[hole] = False
        assert torch.equal(dense, expected)


def test_a_sliding_window_block_mask_is_the_engines_band():
    """A BlockMask that is exactly a sliding window (every batch and head alike, L = S)
    says so, and the engine runs its band fast path; anything else is not a band."""
    from mhsa.core.masks import Band

    def window(left, right):
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx - q_idx >= -left) & (kv_idx - q_idx <= right)

        return mask_mod

    def band_of(mask_mod, q_len=200, kv_len=200, heads=None, block=32):
        mask = create_block_mask(mask_mod, None, heads, q_len, kv_len, "cpu", block)
        return BlockMaskPattern(mask, 1, heads or 1, q_len, kv_len).band()

    assert band_of(window(40, 0)) == Band(40, 0)
    assert band_of(window(3, 70), block=16) == Band(3, 70)
    assert band_of(window(300, 0)) is None  # wider than the middle row sees: causal-like
    assert band_of(causal) is None
    assert band_of(window(40, 0), 150, 200) is None  # L != S: Flex indices differ
    assert band_of(per_head_window, heads=2) is None  # differs per head

    def with_hole(b, h, q_idx, kv_idx):
        return window(40, 0)(b, h, q_idx, kv_idx) & ~((q_idx == 150) & (kv_idx == 130))

    assert band_of(with_hole) is None
    # and flex_attention on it is not the window's
    from mhsa.flex import flex_attention

    q, k, v = (torch.randn(1, 2, 200, 8) for _ in range(3))
    mask = create_block_mask(with_hole, None, None, 200, 200, "cpu", 32)
    dense = flex_api.create_mask(with_hole, 1, 1, 200, 200, "cpu")
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert (flex_attention(q, k, v, block_mask=mask) - expected).abs().max() < 1e-5
