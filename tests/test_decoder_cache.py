"""Decoding an encoder-decoder stack step by step with DecoderCache equals the full
teacher-forced pass; the cross-attention memory is projected once; reorder follows beams."""

from __future__ import annotations

import pytest
import torch

from helpers import max_error
from mhsa.cache import DecoderCache, KVCache
from mhsa.nn import TransformerDecoder, TransformerDecoderLayer


def _decoder(norm_first: bool) -> TransformerDecoder:
    layer = TransformerDecoderLayer(16, 4, dim_feedforward=32, dropout=0.0, norm_first=norm_first)
    return TransformerDecoder(layer, 2).eval()


def test_step_by_step_equals_full_pass():
    for norm_first in (False, True):
        decoder = _decoder(norm_first)
        x, memory = torch.randn(3, 7, 16), torch.randn(3, 5, 16)
        padding = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] * 4 + [False]])
        with torch.no_grad():
            full = decoder(x, memory, causal=True, memory_key_padding_mask=padding)
            cache = DecoderCache(2, 3, 4, 7, 4)
            steps = [
                decoder(x[:, t : t + 1], memory, causal=True, memory_key_padding_mask=padding,
                        cache=cache)
                for t in range(7)
            ]  # fmt: skip
        assert max_error(torch.cat(steps, dim=1), full) < 1e-5
        assert cache.length == 7


def test_memory_is_projected_once():
    decoder = _decoder(False)
    calls = []
    decoder.layers[0].cross_attn.k_proj.register_forward_hook(lambda *_: calls.append(1))
    cache = DecoderCache(2, 2, 4, 3, 4)
    memory = torch.randn(2, 5, 16)
    with torch.no_grad():
        for _ in range(3):
            decoder(torch.randn(2, 1, 16), memory, causal=True, cache=cache)
    assert len(calls) == 1


def test_reorder_keeps_the_chosen_sequences():
    decoder = _decoder(True)
    x, memory = torch.randn(2, 4, 16), torch.randn(2, 5, 16)
    with torch.no_grad():
        cache = DecoderCache(2, 2, 4, 4, 4)
        decoder(x[:, :3], memory, causal=True, cache=cache)
        index = torch.tensor([1, 1])
        cache.reorder(index)
        step = decoder(x[index, 3:], memory[index], causal=True, cache=cache)
        full = decoder(x[index], memory[index], causal=True)
    assert max_error(step, full[:, 3:]) < 1e-5


def test_cache_arguments_are_checked():
    cache = KVCache(2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"start must be in 0..7"):
        cache.set_padding(torch.tensor([-3, 20]))
    with pytest.raises(TypeError, match="start must hold integer indices"):
        cache.set_padding(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"reorder index must be in 0..1"):
        cache.reorder(torch.tensor([0, 2]))
    half = KVCache(2, 1, 8, 4, dtype=torch.float16)
    with pytest.raises(TypeError, match="cache holds torch.float16"):
        half.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
