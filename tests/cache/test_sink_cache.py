"""SlidingWindowCache(sink_tokens=n) (StreamingLLM): decoding with the first n positions
kept plus the window equals a full recomputation with mask (key < n) | SlidingWindow."""

from __future__ import annotations

import pytest
import torch

from helpers import max_error
from mhsa.cache import SlidingWindowCache
from mhsa.core.masks import GlobalTokens, SlidingWindow
from mhsa.nn import MultiHeadAttention
from mhsa.nn.positional import RotaryEmbedding


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding steps are tiny: a second thread only adds waits on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sink_window_mask(length: int, sinks: int, window: int) -> torch.Tensor:
    """(length, length) bool, built from the definition: causal, and key < sinks or
    within the last `window` positions (the query included)."""
    query = torch.arange(length).view(-1, 1)
    key = torch.arange(length).view(1, -1)
    return (key <= query) & ((key < sinks) | (query - key < window))


def _decode(module, x, cache, chunks, sinks, window):
    """Feed x (1, L, E) through the cache in chunks of the given sizes: (1, L, E)."""
    mask = GlobalTokens(range(sinks), beyond_keys="ignore") | SlidingWindow(window - 1, 0)
    rotary, outs, done = RotaryEmbedding(module.head_dim), [], 0
    for size in chunks:
        step = x[:, done : done + size]
        outs.append(module(step, mask=mask, causal=True, position=rotary, cache=cache))
        done += size
    return torch.cat(outs, dim=1)


def test_decoding_2000_tokens_with_4_sinks_equals_full_recomputation():
    """The issue's check: window 256, 4 sinks, 2000 tokens one at a time, float32, every
    step within 1e-5 of the full pass, in 260 slots."""
    torch.manual_seed(0)
    sinks, window, length = 4, 256, 2000
    module = MultiHeadAttention(16, 2, num_kv_heads=1).eval()
    x = torch.randn(1, length, 16)
    cache = SlidingWindowCache(1, 1, window, module.head_dim, sink_tokens=sinks)
    with torch.no_grad():
        steps = _decode(module, x, cache, [1] * length, sinks, window)
        full = module(
            x,
            mask=_sink_window_mask(length, sinks, window),
            causal=True,
            position=RotaryEmbedding(module.head_dim),
        )
    assert max_error(steps, full) < 1e-5
    assert cache.k.shape == (1, 1, sinks + window, module.head_dim)
    assert cache.v.shape[2] == 260 and cache.window == window and cache.length == length


@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_chunks_of_any_size_equal_full_recomputation_in_float64(sinks):
    """Prefill chunks longer than the window, shorter, and single tokens."""
    torch.manual_seed(1)
    window, chunks = 5, [3, 1, 9, 1, 1, 2, 6, 1, 4]
    length = sum(chunks)
    module = MultiHeadAttention(12, 3, num_kv_heads=3, dtype=torch.float64).eval()
    x = torch.randn(2, length, 12, dtype=torch.float64)
    cache = SlidingWindowCache(2, 3, window, 4, dtype=torch.float64, sink_tokens=sinks)
    with torch.no_grad():
        steps = _decode(module, x, cache, chunks, sinks, window)
        full = module(
            x,
            mask=_sink_window_mask(length, sinks, window),
            causal=True,
            position=RotaryEmbedding(4),
        )
    assert max_error(steps, full) < 1e-12
    assert cache.k.shape[2] == sinks + window


def test_the_cache_returns_the_sinks_then_the_window():
    cache = SlidingWindowCache(1, 1, 3, 1, dtype=torch.float64, sink_tokens=2)
    length = 0
    for count in (1, 4, 1, 3, 1):
        keys = torch.arange(length, length + count, dtype=torch.float64).view(1, 1, -1, 1)
        k_all, v_all = cache.update(keys, -keys)
        kept = sorted(set(range(min(2, length))) | set(range(max(2, length - 3), length)))
        assert k_all.flatten().tolist() == kept + list(range(length, length + count))
        assert torch.equal(v_all, -k_all)
        length += count


def test_sink_tokens_are_checked_and_refuse_left_padding():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sink_tokens must be an int >= 0"):
            SlidingWindowCache(1, 1, 4, 2, sink_tokens=bad)
    cache = SlidingWindowCache(2, 1, 4, 2, sink_tokens=2)
    with pytest.raises(ValueError, match="left padding"):
        cache.set_padding(torch.tensor([0, 3]))
    cache.set_padding(torch.tensor([0, 0]))  # no padding is fine
    assert cache.key_padding() is None


@pytest.mark.parametrize("sinks", [0, 2])
def test_kept_from_names_the_first_window_key_the_next_update_returns(sinks):
    """kept_from() is the cache interface's answer to "where do the returned window keys
    start" (a chunked model's mask needs it; a KVCache keeps all: 0)."""
    from mhsa.cache import KVCache

    assert KVCache(1, 1, 16, 4).kept_from() == 0
    cache = SlidingWindowCache(1, 1, 5, 1, sink_tokens=sinks)
    for position in range(12):
        first = cache.kept_from()
        new = torch.full((1, 1, 1, 1), float(position))  # each key holds its position
        keys, _ = cache.update(new, new)
        stored = keys[0, 0, :, 0].tolist()
        assert first == max(sinks, position - 5)
        assert stored == list(range(min(sinks, position + 1))) + list(range(first, position + 1))


def _positions(begin: int, end: int) -> torch.Tensor:
    return torch.arange(begin, end, dtype=torch.float64).view(1, 1, -1, 1)


@pytest.mark.parametrize("sinks", [0, 2])
def test_truncate_drops_drafts_only_while_the_ring_keeps_the_window(sinks):
    """A dropped token overwrote the key one window before it: before the ring wraps,
    truncate is exact; after, it refuses rather than return the drafts as old keys."""
    cache = SlidingWindowCache(1, 1, 6, 1, dtype=torch.float64, sink_tokens=sinks)
    cache.update(_positions(0, 3), _positions(0, 3))
    cache.update(_positions(100, 102), _positions(100, 102))  # drafts, rejected
    cache.truncate(3)
    keys, _ = cache.update(_positions(3, 4), _positions(3, 4))
    assert keys.flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    cache.update(_positions(4, 9 + sinks), _positions(4, 9 + sinks))  # the ring wraps
    cache.update(_positions(100, 102), _positions(100, 102))
    with pytest.raises(ValueError, match="overwrote the keys at positions"):
        cache.truncate(9 + sinks)
    cache.truncate(11 + sinks)  # dropping nothing is always exact
