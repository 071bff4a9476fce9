"""The flex backend's conversion of our masks to FlexAttention BlockMasks, checked by
running FlexAttention eagerly on CPU against the reference (the backend itself serves
CUDA only), and its dispatch rules."""

from __future__ import annotations

import warnings

import pytest
import torch

import mhsa
from helpers import max_error
from mhsa.core.backends import AttentionSpec, get
from mhsa.core.backends.flex import block_mask_for, flex_forward
from mhsa.core.masks import (
    BoolMask,
    Causal,
    Document,
    KeyPadding,
    Pattern,
    PrefixLM,
    RandomBlocks,
    SelectedBlocks,
    SlidingWindow,
    bigbird,
)
from mhsa.core.scores import ALiBi, RelativeBias, Softcap
from mhsa.nn.positional import alibi_slopes

pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # eager flex warns

CASES = [
    ("none", None, False),
    ("causal L != S", None, True),
    ("window", SlidingWindow(5, 3), False),
    ("causal window", SlidingWindow(5, 0), True),
    ("bool tensor", "tensor", False),
    ("key padding with a dead row", "padding", False),
    # broadcast over rows or keys: the mask_mod once indexed past their size of 1
    ("bool (B, 1, 1, S)", "keys", False),
    ("bool (L, 1)", "rows", False),
    # patterns that differ by head or by sequence: the bitmaps once had no head axis
    ("SelectedBlocks per head", "selected", False),
    ("BoolMask per head | Causal", "bool heads", False),
    ("BoolMask per sequence | window", "bool batch", False),
]


@pytest.mark.parametrize(("name", "mask", "causal"), CASES, ids=[c[0] for c in CASES])
def test_flex_equals_the_reference(name, mask, causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 37, 16), torch.randn(2, 2, 45, 16), torch.randn(2, 2, 45, 16)
    if mask == "tensor":
        mask = torch.rand(2, 1, 37, 45) > 0.5
    elif mask == "padding":
        mask = KeyPadding(torch.tensor([[True] * 30 + [False] * 15, [False] * 45]))
    elif mask == "keys":
        mask = torch.rand(2, 1, 1, 45) > 0.3
    elif mask == "rows":
        mask = torch.rand(37, 1) > 0.3
    elif mask == "selected":
        mask = SelectedBlocks(torch.rand(2, 4, 6, 6) < 0.5, 8)  # n = ceil(45 / 8)
    elif mask == "bool heads":
        mask = BoolMask(torch.rand(1, 4, 37, 45) < 0.5) | Causal()
    elif mask == "bool batch":
        mask = BoolMask(torch.rand(2, 1, 37, 45) < 0.5) | SlidingWindow(1, 1)
    out, lse = flex_forward(q, k, v, mask=mask, causal=causal, scale=0.25, compiled=False)
    ref, ref_lse = mhsa.attention(
        q, k, v, mask, causal=causal, scale=0.25, return_lse=True, backend="reference"
    )
    assert torch.isfinite(out).all()
    assert max_error(out, ref) < 1e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert max_error(lse[finite], ref_lse[finite]) < 1e-5


def test_pattern_block_masks_are_cached_per_shape():
    window = SlidingWindow(300, 0)
    first = block_mask_for(window, True, (1, 1, 1024, 1024), "cpu")
    assert block_mask_for(SlidingWindow(300, 0), True, (1, 1, 1024, 1024), "cpu") is first
    assert block_mask_for(window, True, (1, 1, 2048, 2048), "cpu") is not first
    assert block_mask_for(None, False, (1, 1, 1024, 1024), "cpu") is None
    # tiles out of the window's reach are skipped: far fewer than all 8 x 8
    assert int(first.kv_num_blocks.sum() + first.full_kv_num_blocks.sum()) < 64
    causal = block_mask_for(None, True, (1, 1, 1000, 1300), "cpu")  # closed form, cached
    assert block_mask_for(None, True, (1, 1, 1000, 1300), "cpu") is causal
    dense = block_mask_for(
        torch.ones(1000, 1300, dtype=torch.bool).tril(300), False, (1, 1, 1000, 1300), "cpu"
    )
    assert torch.equal(causal.to_dense(), dense.to_dense())


def test_cache_keys_leave_out_private_caches():
    pattern = bigbird(64)
    key = pattern.cache_key()
    pattern.dense(512, 512)  # fills RandomBlocks' own layout cache
    assert pattern.cache_key() == key
    random = RandomBlocks(3, 64, seed=0)
    random.dense(512, 512)
    assert random.cache_key() == RandomBlocks(3, 64, seed=0).cache_key()
    assert random.cache_key() != RandomBlocks(3, 64, seed=1).cache_key()
    padding = KeyPadding(torch.tensor([3, 5]))
    assert padding.cache_key() == ("id", id(padding))  # holds a tensor: keyed by identity


def test_compiled_flex_may_recompile_past_dynamos_default_limit():
    from mhsa.core.backends.common import RECOMPILE_LIMIT, recompile_limit

    with recompile_limit():
        assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    assert torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT  # restored afterwards


def test_flex_serves_cuda_only_and_refuses_what_it_cannot_do():
    flex = get("flex")
    assert "CUDA only" in flex.supports(AttentionSpec.example())
    cuda = AttentionSpec.example(device=torch.device("cuda"), has_mask=True)
    assert flex.supports(cuda) is None
    assert "bias" in flex.supports(
        AttentionSpec.example(device=torch.device("cuda"), has_bias=True)
    )
    assert (
        flex.supports(
            AttentionSpec.example(device=torch.device("cuda"), has_sinks=True, has_score=True)
        )
        is None
    )
    assert "dropout" in flex.supports(
        AttentionSpec.example(device=torch.device("cuda"), dropout_p=0.1)
    )
    with pytest.raises(ValueError, match="flex"):
        mhsa.attention(*torch.randn(3, 1, 2, 8, 4), backend="flex")


RULE_PATTERNS = {
    "window": SlidingWindow(5, 3),
    "document": Document([0] * 20 + [1] * 25),
    "bigbird": bigbird(8, seed=1),
    "prefix-lm": PrefixLM(10),
    "key padding": KeyPadding(torch.tensor([[True] * 30 + [False] * 15, [True] * 45])),
}


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", list(RULE_PATTERNS))
def test_patterns_and_scores_reach_flex_as_rules_never_dense(pattern, causal, monkeypatch):
    """mask_mod asks the pattern's elementwise rule; score functions become score_mods
    with global query positions: Pattern.dense is never called, results equal the
    reference's."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 37, 16), torch.randn(2, 2, 45, 16), torch.randn(2, 2, 45, 16)
    mask = RULE_PATTERNS[pattern]
    slopes, table = alibi_slopes(4), torch.randn(32, 4)
    for score in (None, ALiBi(slopes), RelativeBias(table).then(Softcap(2.0))):
        with monkeypatch.context() as patched:
            patched.setattr(Pattern, "dense", lambda *_: pytest.fail("Pattern.dense called"))
            out, lse = flex_forward(
                q, k, v, mask=mask, causal=causal, scale=0.25, compiled=False, score=score
            )
        ref, ref_lse = mhsa.attention(
            q,
            k,
            v,
            mask,
            causal=causal,
            scale=0.25,
            score=score,
            return_lse=True,
            backend="reference",
        )
        assert max_error(out, ref) < 1e-5
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert max_error(lse[finite], ref_lse[finite]) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_join_flex_through_its_lse(causal):
    """Sinks are added to FlexAttention's (out, lse) afterwards; a dead row (key
    padding) keeps output 0 and gets lse = its sink. (FlexAttention has no CPU backward:
    gradients reach the sinks through add_sinks, as in the flash engine.)"""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 37, 16), torch.randn(2, 2, 45, 16), torch.randn(2, 2, 45, 16)
    mask = KeyPadding(torch.tensor([[True] * 30 + [False] * 15, [False] * 45]))
    sinks = torch.randn(4)
    out, lse = flex_forward(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=0.25,
        compiled=False,
        score=ALiBi(alibi_slopes(4)),
        sinks=sinks,
    )
    ref, ref_lse = mhsa.attention(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=0.25,
        sinks=sinks,
        score=ALiBi(alibi_slopes(4)),
        return_lse=True,
        backend="reference",
    )
    assert max_error(out, ref) < 1e-5
    assert max_error(lse, ref_lse) < 1e-5
    assert out[1].abs().max() == 0
    assert torch.equal(lse[1], sinks.view(4, 1).expand(4, 37))


def test_asking_flex_for_the_lse_raises_no_deprecation_warning():
    """torch 2.13 deprecates return_lse=True (a FutureWarning in every run); where
    AuxRequest exists the engine asks for the lse through return_aux."""
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        out, lse = flex_forward(q, k, v, mask=None, causal=False, scale=None, compiled=False)
    want, want_lse = mhsa.attention(q, k, v, backend="reference", return_lse=True)
    assert max_error(out, want) < 1e-5 and max_error(lse, want_lse) < 1e-5
