"""Patterns: dense vs block layout, attention with patterns on every backend, composition."""

from __future__ import annotations

import pytest
import torch

import mhsa
from helpers import make_qkv, max_error
from mhsa import masks
from mhsa.core.masks import EMPTY, FULL

BATCH = 2


def make_patterns(q_len: int, kv_len: int) -> dict[str, masks.Pattern]:
    """One of each pattern (and some compositions) for these lengths."""
    generator = torch.Generator().manual_seed(1)
    layout = torch.rand(-(-q_len // 16), -(-kv_len // 16), generator=generator) > 0.6
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([3, 40, 1, 90, kv_len - 134]))
    return {
        "full": masks.Full(),
        "causal": masks.Causal(),
        "window": masks.SlidingWindow(17, 5),
        "local-causal": masks.SlidingWindow(30, 0),
        "dilated": masks.Dilated(4, 3),
        "block-sparse": masks.BlockSparse(layout, 16),
        "global": masks.GlobalTokens([0, 5, kv_len - 1]),
        "random": masks.RandomBlocks(2, 16, seed=3),
        "padding": masks.KeyPadding([kv_len - 50, kv_len]),
        "padding-bool": masks.KeyPadding(torch.rand(BATCH, kv_len, generator=generator) > 0.2),
        "document": masks.Document(ids),
        "prefix": masks.PrefixLM(20),
        "longformer": masks.longformer(8, [1, 100]),
        "bigbird": masks.bigbird(16, seed=2),
        "window&padding": masks.SlidingWindow(40, 40) & masks.KeyPadding([kv_len - 7, 9]),
        "dilated|causal": masks.Dilated(2, 5) | masks.Causal(),
    }


LENGTHS = [(203, 203), (113, 203), (1, 203)]


@pytest.mark.parametrize("q_len, kv_len", LENGTHS)
@pytest.mark.parametrize("block", [(16, 16), (32, 64), (7, 13)])
def test_dense_agrees_with_block_layout(q_len, kv_len, block):
    for name, pattern in make_patterns(q_len, kv_len).items():
        dense = pattern.dense(q_len, kv_len)
        dense = dense.reshape(-1, q_len, kv_len)
        layout = pattern.block_layout(q_len, kv_len, *block)
        block_q, block_k = block
        assert layout.shape == (-(-q_len // block_q), -(-kv_len // block_k)), name
        for (qi, kj), kind in zip(
            torch.cartesian_prod(torch.arange(layout.shape[0]), torch.arange(layout.shape[1])),
            layout.flatten(),
            strict=True,
        ):
            tile = dense[:, qi * block_q : (qi + 1) * block_q, kj * block_k : (kj + 1) * block_k]
            if kind == EMPTY:
                assert not tile.any(), (name, qi, kj)
            elif kind == FULL:
                assert tile.all(), (name, qi, kj)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("q_len, kv_len", LENGTHS)
def test_attention_with_pattern_equals_reference_with_dense_mask(backend, q_len, kv_len):
    for name, pattern in make_patterns(q_len, kv_len).items():
        q, k, v = make_qkv(BATCH, 4, 2, q_len, kv_len, 16, requires_grad=True)
        out = mhsa.attention(q, k, v, pattern, backend=backend)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        dense = pattern.dense(q_len, kv_len)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = mhsa.attention(q64, k64, v64, dense, backend="reference")
        ref.backward(grad_out.double())
        assert max_error(out, ref) < 2e-5, name
        for got, want in ((q, q64), (k, k64), (v, v64)):
            assert max_error(got.grad, want.grad) < 1e-4, name


def test_flash_plans_only_the_allowed_blocks():
    pattern = masks.SlidingWindow(256, 256)
    source = pattern
    from mhsa.core.kernels.plan import build_plan

    plan = build_plan(source, 16384, 16384, block_q=256, block_k=256, gather=True)
    assert plan.visited_fraction < 3 * 256 / 16384 + 1e-9
    bird = masks.bigbird(64)
    plan = build_plan(bird, 8192, 8192, block_q=64, block_k=64, gather=True)
    allowed = bird.dense(8192, 8192).float().mean().item()
    assert plan.visited_fraction == pytest.approx(allowed, rel=1e-6)  # block aligned: exact


def test_composition():
    L = S = 64
    window, globals_ = masks.SlidingWindow(4, 4), masks.GlobalTokens([0, 7])
    assert torch.equal((window | globals_).dense(L, S), masks.longformer(4, [0, 7]).dense(L, S))
    assert torch.equal((window | globals_).dense(L, S), window.dense(L, S) | globals_.dense(L, S))
    assert torch.equal((window & masks.Causal()).dense(L, S), masks.SlidingWindow(4, 0).dense(L, S))
    assert torch.equal(masks.Dilated(4, 1).dense(L, S), window.dense(L, S))
    assert torch.equal(masks.PrefixLM(0).dense(L, S), masks.Causal().dense(L, S))
    assert masks.Full().dense(3, 5).all()
    lengths = masks.KeyPadding([3, 5]).dense(4, 5)
    as_bool = masks.KeyPadding(torch.arange(5).view(1, -1) < torch.tensor([[3], [5]]))
    assert lengths.shape == (2, 1, 4, 5) and torch.equal(lengths, as_bool.dense(4, 5))


def test_pattern_semantics():
    dense = masks.SlidingWindow(2, 1).dense(4, 10)  # queries at positions 6..9
    assert dense[0].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert dense[3].nonzero().flatten().tolist() == [7, 8, 9]
    dilated = masks.Dilated(2, 3).dense(20, 20)
    assert dilated[10].nonzero().flatten().tolist() == [4, 7, 10, 13, 16]
    glob = masks.GlobalTokens([2]).dense(5, 5)
    assert glob[2].all() and glob[:, 2].all() and glob.sum() == 9
    doc = masks.Document([0, 0, 1, 1, 1]).dense(5, 5)
    assert doc[1].tolist() == [True, True, False, False, False]
    assert doc[4].tolist() == [False, False, True, True, True]
    prefix = masks.PrefixLM(3).dense(5, 5)
    assert prefix[0].tolist() == [True, True, True, False, False]
    assert prefix[4].all()
    random = masks.RandomBlocks(3, 8, seed=5)
    layout = random.layout_for(64, 80)  # over the blocks of positions 0..79
    assert layout.sum(1).tolist() == [3] * 10
    assert torch.equal(layout, masks.RandomBlocks(3, 8, seed=5).layout_for(64, 80))
    assert not torch.equal(layout, masks.RandomBlocks(3, 8, seed=6).layout_for(64, 80))


def test_pattern_validation():
    with pytest.raises(ValueError, match="left must be an int >= 0"):
        masks.SlidingWindow(-1, 0)
    with pytest.raises(ValueError, match="dilation must be an int >= 1"):
        masks.Dilated(3, 0)
    with pytest.raises(ValueError, match=r"layout has shape \(2, 2\).*need .* = \(3, 2\)"):
        masks.BlockSparse(torch.ones(2, 2, dtype=torch.bool), 16).dense(40, 32)
    with pytest.raises(TypeError, match="layout must be a 2-D bool tensor"):
        masks.BlockSparse(torch.ones(2, 2), 16)
    with pytest.raises(ValueError, match="global token index 40 is out of range"):
        masks.GlobalTokens([1, 40]).dense(40, 40)
    with pytest.raises(ValueError, match="indices must be >= 0"):
        masks.GlobalTokens([-1])
    with pytest.raises(ValueError, match="exceeds S = 8"):
        masks.KeyPadding([3, 9]).dense(8, 8)
    with pytest.raises(ValueError, match="window_blocks must be odd"):
        masks.bigbird(16, window_blocks=2)
    with pytest.raises(ValueError, match="^random_blocks must be an int >= 0, got -1$"):
        masks.bigbird(16, random_blocks=-1)
    with pytest.raises(TypeError, match="^seed must be an int, got 0.5$"):
        masks.bigbird(16, seed=0.5)  # (was taken, and raised inside torch at the first call)
    with pytest.raises(ValueError, match=r"^block must be an int >= 1, got 0$"):
        masks.Causal().block_layout(8, 8, 0)
    with pytest.raises(ValueError, match=r"^block_k must be an int >= 1, got True$"):
        masks.Causal().block_layout(8, 8, 4, True)  # (a bool was taken as 1)
    q, k, v = make_qkv(3, 2, 2, 8, 8, 4)
    with pytest.raises(ValueError, match="built for batch size 2, but q has batch size 3"):
        mhsa.attention(q, k, v, masks.KeyPadding([3, 4]))
    with pytest.raises(ValueError, match="ids cover 5 positions"):
        mhsa.attention(q, k, v, masks.Document([0, 0, 1, 1, 1]))


def test_a_bool_mask_pattern_for_other_lengths_is_refused():
    """Its rows were read from 0: a decoding step over an (8, 8) causal BoolMask saw
    only key 0."""
    pattern = masks.BoolMask(torch.ones(8, 8, dtype=torch.bool).tril())
    q, k, v = make_qkv(1, 1, 1, 1, 8, 4)
    for backend in ("reference", "flash"):
        with pytest.raises(
            ValueError, match=r"BoolMask of shape \(8, 8\) does not fit .* \(1, 8\)"
        ):
            mhsa.attention(q, k, v, pattern, backend=backend)
    keys_only = masks.BoolMask(torch.ones(2, 1, 1, 8, dtype=torch.bool))  # broadcast rows
    q, k, v = make_qkv(2, 1, 1, 3, 8, 4)
    assert mhsa.attention(q, k, v, keys_only).shape == (2, 1, 3, 4)


def test_a_batch_1_pattern_combines_with_a_per_sequence_one():
    """Batch 1 broadcasts over every sequence, in `|` and `&` as in a call."""
    q, k, v = make_qkv(2, 2, 2, 16, 16, 8)
    shared = masks.SelectedBlocks(torch.rand(1, 2, 4, 4) < 0.5, 4)
    padding = masks.KeyPadding([16, 10])
    for pattern in (shared & padding, masks.KeyPadding([16]) | padding):
        assert pattern.batch_size == 2
        expected = mhsa.attention(q, k, v, pattern.dense(16, 16), backend="reference")
        assert max_error(mhsa.attention(q, k, v, pattern, backend="flash"), expected) < 1e-5
    assert (masks.KeyPadding([3]) | masks.Causal()).batch_size == 1
    with pytest.raises(ValueError, match="different batch sizes cannot combine"):
        masks.KeyPadding([1, 2]) | masks.KeyPadding([1, 2, 3])


def test_module_combines_pattern_with_key_padding():
    mha = mhsa.nn.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 30, 16)
    padding = torch.ones(2, 30, dtype=torch.bool)
    padding[0, 20:] = False
    pattern = masks.SlidingWindow(5, 0)
    dense = pattern.dense(30, 30)
    expected = mha(x, mask=dense, key_padding_mask=padding)
    assert max_error(mha(x, mask=pattern, key_padding_mask=padding), expected) < 1e-5


def test_attention_weights_with_pattern_rows():
    q, k, _ = make_qkv(2, 4, 2, 113, 113, 16)
    pattern = masks.longformer(6, [0])
    full = mhsa.attention_weights(q, k, pattern.dense(113, 113))
    part = mhsa.attention_weights(q, k, pattern, rows=[0, 50, 112], heads=[3])
    assert max_error(part, full[:, [3]][:, :, [0, 50, 112]]) < 1e-6


@pytest.mark.parametrize(
    "pattern",
    [masks.SlidingWindow(32, 32), masks.SlidingWindow(40, 0)],
    ids=["band", "local-causal"],
)
def test_triangular_window_tiles_run_unmasked_in_causal_mode(pattern):
    from mhsa.core.kernels.flash import flash_attention
    from mhsa.core.kernels.plan import build_plan

    q, k, v = make_qkv(2, 4, 2, 203, 203, 16, requires_grad=True)
    plan = build_plan(pattern, 203, 203, block_q=32, block_k=32, gather=True)
    triangles = {run.triangle for row in plan.rows for run in row.runs}
    assert "lower" in triangles and ("upper" in triangles) == (pattern.right > 0)
    out, _ = flash_attention(q, k, v, plan, scale=0.25, fused=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = mhsa.attention(q64, k64, v64, pattern.dense(203, 203), scale=0.25, backend="reference")
    ref.backward(grad_out.double())
    assert max_error(out, ref) < 2e-5
    for got, want in ((q, q64), (k, k64), (v, v64)):
        assert max_error(got.grad, want.grad) < 1e-4


def test_fingerprint_compares_content_not_repr():
    keys_a, keys_b = masks.KeyPadding([8] * 40), masks.KeyPadding([8] * 39 + [7])
    assert repr(keys_a) == repr(keys_b) and keys_a.fingerprint() != keys_b.fingerprint()
    assert keys_a.fingerprint() == masks.KeyPadding([8] * 40).fingerprint()
    eye = torch.eye(2, dtype=torch.bool)
    assert masks.BlockSparse(eye, 4).fingerprint() != masks.BlockSparse(~eye, 4).fingerprint()
    assert masks.BlockSparse(eye, 4).fingerprint() != masks.BlockSparse(eye, 8).fingerprint()
    window = masks.SlidingWindow(4, 0) & masks.GlobalTokens([0, 1])
    same = masks.SlidingWindow(4, 0) & masks.GlobalTokens([0, 1])
    assert window.fingerprint() == same.fingerprint()
    assert (
        window.fingerprint()
        != (masks.SlidingWindow(4, 0) & masks.GlobalTokens([0, 2])).fingerprint()
    )


@pytest.mark.parametrize(("q_len", "kv_len"), [(40, 40), (1, 1), (5, 9), (9, 5), (33, 70)])
def test_presets_work_on_sequences_shorter_than_their_blocks(q_len, kv_len):
    patterns = [
        masks.bigbird(32),
        masks.bigbird(64, 1, 1, 1),
        masks.BlockBand(64, 1),
        masks.RandomBlocks(2, 64),
        masks.Dilated(3, 50),
    ]
    q, k, v = make_qkv(1, 2, q_len=q_len, kv_len=kv_len, head_dim=8)
    for pattern in patterns:
        want = mhsa.attention(q, k, v, pattern, backend="reference")
        assert max_error(mhsa.attention(q, k, v, pattern, backend="flash"), want) < 1e-5
    assert masks.bigbird(32).dense(40, 40)[:, :32].all()  # the global blocks that exist


def test_explicit_global_tokens_past_the_keys_are_still_an_error():
    with pytest.raises(ValueError, match="global token index 50 is out of range for 40 keys"):
        masks.GlobalTokens([0, 50]).dense(40, 40)
    with pytest.raises(ValueError, match="beyond_keys must be"):
        masks.GlobalTokens([0], beyond_keys="clip")


def test_bad_lengths_and_indices_are_clear_errors():
    with pytest.raises(ValueError, match="q_len must be an int >= 0, got -1"):
        masks.SlidingWindow(2, 0).dense(-1, 4)
    with pytest.raises(ValueError, match="kv_len must be an int >= 0"):
        masks.Causal().block_layout(4, 2.5, 2)
    with pytest.raises(TypeError, match="indices must be integer positions"):
        masks.GlobalTokens([1.7])
    assert masks.GlobalTokens([]).dense(2, 2).sum() == 0


@pytest.mark.parametrize("pattern", [masks.RandomBlocks(2, 8, seed=5), masks.bigbird(8, 1, 1, 1)])
def test_random_blocks_sit_bottom_right_like_every_pattern(pattern):
    """Query row i is position i + S - L: a decoding step's query, or the last rows of a
    call, see what the same positions see in the whole prompt; positions before 0
    (L > S) get no random block. The block plan agrees with the dense mask throughout."""
    whole = pattern.dense(45, 45)
    for q_len in (1, 7, 20):
        assert torch.equal(pattern.dense(q_len, 45), whole[..., 45 - q_len :, :])
    longer = pattern.dense(60, 45)
    assert torch.equal(longer[..., 15:, :], whole)
    if isinstance(pattern, masks.RandomBlocks):
        assert not longer[..., :15, :].any()
    for q_len, kv_len in ((45, 45), (20, 45), (1, 45), (60, 45)):
        dense = pattern.dense(q_len, kv_len).reshape(-1, q_len, kv_len)
        for block_q, block_k in ((8, 8), (16, 8), (5, 13)):
            kinds = pattern.block_layout(q_len, kv_len, block_q, block_k)
            for qi, kj in torch.cartesian_prod(*(torch.arange(n) for n in kinds.shape)).tolist():
                tile = dense[
                    :, qi * block_q : (qi + 1) * block_q, kj * block_k : (kj + 1) * block_k
                ]
                assert kinds[qi, kj] != EMPTY or not tile.any(), (q_len, qi, kj)
                assert kinds[qi, kj] != FULL or tile.all(), (q_len, qi, kj)


def test_random_blocks_keep_a_few_layouts_while_decoding():
    """One layout per (L, S) was kept forever: decoding 4096 tokens held 86 MiB, growing
    cubically. The latest key lengths' are kept, each the layout a fresh pattern draws."""
    from mhsa.core.masks.block_sparse import LAYOUTS_KEPT, RandomBlocks

    pattern = RandomBlocks(2, 4, seed=3)
    for kv_len in range(1, 200):
        pattern.layout_for(1, kv_len)
    assert len(pattern._layouts) <= LAYOUTS_KEPT
    for q_len, kv_len in ((1, 37), (9, 5), (40, 40)):
        fresh = RandomBlocks(2, 4, seed=3).layout_for(q_len, kv_len)
        assert torch.equal(pattern.layout_for(q_len, kv_len), fresh)
