"""mhsa.integrations.transformers.build_mask: transformers' mask functions lowered to mhsa
patterns, each equal to the dense mask of transformers' own sdpa_mask, and never an
L x S tensor; what no pattern says exactly falls back to that dense mask."""

from __future__ import annotations

import pytest
import torch

from mhsa.core.masks import Causal, Pattern
from mhsa.integrations import transformers as mhsa_hf
from optional import needs

masking_utils = needs("transformers.masking_utils")


def dense(lowered: mhsa_hf.LoweredMask) -> torch.Tensor:
    """The (B, 1, L, S) bool mask a LoweredMask stands for (the keys after keys_used:
    never)."""
    b, _, length, keys = lowered.shape
    used = lowered.keys_used
    allowed = torch.ones(b, 1, length, used, dtype=torch.bool)
    if lowered.mask is not None:
        mask = lowered.mask
        allowed = allowed & (mask if isinstance(mask, torch.Tensor) else mask.dense(length, used))
    if lowered.causal:
        allowed = allowed & Causal().dense(length, used)
    return torch.nn.functional.pad(allowed, (0, keys - used), value=False)


PADDING = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 12]).bool()
BLOCKS = torch.tensor([[-1, -1, 0, 0, 0, -1, -1, 1, 1, 1, 1, -1], [0, 0, -1, -1] * 3])


def mask_cases():
    """(name, mask_function maker, sdpa_mask keyword arguments)."""
    m = masking_utils
    left = (~PADDING).sum(-1)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    packed = m.find_packed_sequence_indices(positions)
    remapped = m.remap_positions_for_packed_sequence
    return [
        ("causal", lambda: m.causal_mask_function, dict(q_length=12, kv_length=12)),
        (
            "causal padded",
            lambda: m.causal_mask_function,
            dict(q_length=12, kv_length=12, attention_mask=PADDING),
        ),
        (
            "causal cached",
            lambda: m.causal_mask_function,
            dict(q_length=3, kv_length=12, q_offset=9, attention_mask=PADDING),
        ),
        (
            "bidirectional padded",
            lambda: m.bidirectional_mask_function,
            dict(q_length=12, kv_length=12, attention_mask=PADDING),
        ),
        (
            "sliding",
            lambda: m.sliding_window_causal_mask_function(4),
            dict(q_length=12, kv_length=12, attention_mask=PADDING),
        ),
        # a full sliding-window cache layer: the last 3 keys and 2 new ones, from position 7
        (
            "sliding cached",
            lambda: m.sliding_window_causal_mask_function(4),
            dict(q_length=2, kv_length=5, q_offset=10, kv_offset=7, attention_mask=PADDING),
        ),
        (
            "sliding bidirectional",
            lambda: m.sliding_window_bidirectional_mask_function(2),
            dict(q_length=12, kv_length=12, attention_mask=PADDING),
        ),
        (
            "chunked",
            lambda: m.chunked_causal_mask_function(3, left),
            dict(q_length=12, kv_length=12, attention_mask=PADDING),
        ),
        (
            "chunked cached",
            lambda: m.chunked_causal_mask_function(3, left),
            dict(q_length=2, kv_length=12, q_offset=10, attention_mask=PADDING),
        ),
        # one left padding for all (none): Chunked; a chunked cache layer keeps the last
        # keys only (transformers' sliding-window layer of chunk_size keys)
        (
            "chunked unpadded",
            lambda: m.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)),
            dict(q_length=12, kv_length=12),
        ),
        (
            "chunked cache layer",
            lambda: m.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)),
            dict(q_length=2, kv_length=5, q_offset=10, kv_offset=7),
        ),
        (
            "packed",
            lambda: m.and_masks(
                remapped(m.causal_mask_function, positions), m.packed_sequence_mask_function(packed)
            ),
            dict(q_length=12, kv_length=12),
        ),
        (
            "packed sliding",
            lambda: m.and_masks(
                remapped(m.sliding_window_causal_mask_function(2), positions),
                m.packed_sequence_mask_function(packed),
            ),
            dict(q_length=12, kv_length=12),
        ),
        # image tokens (blocks 0 and 1) see their whole block, text (-1) stays causal
        (
            "blockwise",
            lambda: m.or_masks(m.causal_mask_function, m.blockwise_overlay(BLOCKS)),
            dict(q_length=12, kv_length=12, attention_mask=PADDING),
        ),
        (
            "blockwise cached",
            lambda: m.or_masks(
                m.sliding_window_causal_mask_function(5), m.blockwise_overlay(BLOCKS)
            ),
            dict(q_length=4, kv_length=12, q_offset=8, attention_mask=PADDING),
        ),
        # a StaticCache: 16 slots, the keys after the last query's position are free
        (
            "static prefill",
            lambda: m.causal_mask_function,
            dict(q_length=5, kv_length=16, attention_mask=PADDING),
        ),
        (
            "static decode",
            lambda: m.sliding_window_causal_mask_function(4),
            dict(q_length=1, kv_length=16, q_offset=9, attention_mask=PADDING),
        ),
        # cross-attention: 5 queries, the 12 keys of another sequence and its padding
        (
            "cross",
            lambda: m.bidirectional_mask_function,
            dict(q_length=5, kv_length=12, attention_mask=PADDING),
        ),
        (
            "or",
            lambda: m.or_masks(m.causal_mask_function, m.sliding_window_bidirectional_overlay(1)),
            dict(q_length=12, kv_length=12, attention_mask=PADDING),
        ),
    ]


@pytest.mark.parametrize("name, make, sizes", mask_cases(), ids=[c[0] for c in mask_cases()])
def test_mask_function_lowers_to_patterns_exactly(name, make, sizes):
    arguments = dict(batch_size=2, mask_function=make(), **sizes)
    lowered = mhsa_hf.build_mask(**arguments)
    expected = masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False)
    assert lowered.mask is None or isinstance(lowered.mask, Pattern), name  # no L x S tensor
    assert torch.equal(dense(lowered), expected.expand_as(dense(lowered))), name


def test_chunked_mask_lowers_to_chunked():
    """transformers' chunked causal mask (Llama 4) is mhsa's Chunked pattern, with the
    position of key 0 when a cache layer has dropped the first keys."""
    unpadded = torch.zeros(2, dtype=torch.long)
    lowered = mhsa_hf.build_mask(
        batch_size=2,
        q_length=2,
        kv_length=5,
        q_offset=10,
        kv_offset=7,
        mask_function=masking_utils.chunked_causal_mask_function(4, unpadded),
    )
    assert repr(lowered.mask) == "Chunked(4, start=7)"


def test_mask_function_never_builds_an_l_by_s_mask():
    """A million tokens, padded, with a window: 10^12 entries dense; lowered, the patterns
    hold the (B, S) padding only."""
    million = 10**6
    padding = torch.ones(2, million, dtype=torch.bool)
    padding[0, :5] = False
    lowered = mhsa_hf.build_mask(
        batch_size=2,
        q_length=million,
        kv_length=million,
        mask_function=masking_utils.sliding_window_causal_mask_function(512),
        attention_mask=padding,
    )
    assert repr(lowered.mask) == "(SlidingWindow(511, 0)) & (KeyPadding(...))"
    assert lowered.shape == (2, 1, million, million) and not lowered.causal


def test_mask_function_falls_back_to_transformers_dense_mask():
    """A model's own overlay (here an image-token-like prefix), packed positions that
    skip, or a window that looks ahead over a StaticCache's free slots have no pattern:
    transformers' own dense mask, exact, not a dropped mask."""

    def prefix(batch, head, q, kv):
        return kv < 3

    overlay = masking_utils.or_masks(masking_utils.causal_mask_function, prefix)
    # documents whose positions skip: offsets of positions are not offsets of indices
    skipping = masking_utils.and_masks(
        masking_utils.remap_positions_for_packed_sequence(
            masking_utils.sliding_window_causal_mask_function(3),
            torch.arange(0, 24, 2).expand(2, 12),
        ),
        masking_utils.packed_sequence_mask_function(torch.zeros(2, 12, dtype=torch.long)),
    )
    for arguments in (
        dict(q_length=12, kv_length=12, mask_function=overlay, use_vmap=True),
        dict(q_length=12, kv_length=12, mask_function=skipping),
        dict(
            q_length=3,
            kv_length=16,
            q_offset=5,
            mask_function=masking_utils.sliding_window_bidirectional_mask_function(2),
        ),
    ):
        arguments = dict(batch_size=2, attention_mask=None, **arguments)
        lowered = mhsa_hf.build_mask(**arguments)
        expected = masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False)
        assert isinstance(lowered.mask, torch.Tensor)
        assert torch.equal(dense(lowered), expected)
