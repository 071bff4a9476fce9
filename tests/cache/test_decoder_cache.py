"""Decoding an encoder-decoder stack step by step with DecoderCache equals the full
teacher-forced pass; the cross-attention memory is projected once; reorder follows beams."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from helpers import max_error
from mhsa.cache import DecoderCache, KVCache, MemoryCache, SlidingWindowCache
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
                decoder(
                    x[:, t : t + 1],
                    memory,
                    causal=True,
                    memory_key_padding_mask=padding,
                    cache=cache,
                )
                for t in range(7)
            ]
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


# The caches on their own, against values written out by hand or kept in a plain list.


def _tokens(first: int, count: int, batch: int = 2, heads: int = 1, dim: int = 2) -> Tensor:
    """Token t of sequence b, head h holds 100 * b + 10 * h + t in every feature."""
    t = torch.arange(first, first + count, dtype=torch.float32).view(1, 1, -1, 1)
    b = torch.arange(batch, dtype=torch.float32).view(-1, 1, 1, 1)
    h = torch.arange(heads, dtype=torch.float32).view(1, -1, 1, 1)
    return (100 * b + 10 * h + t).expand(batch, heads, count, dim).contiguous()


def test_kv_cache_allocates_and_appends_in_order():
    cache = KVCache(2, 3, 5, 4, 6, dtype=torch.float64)
    assert cache.k.shape == (2, 3, 5, 4) and cache.v.shape == (2, 3, 5, 6)
    assert cache.k.dtype == cache.v.dtype == torch.float64
    assert cache.start.tolist() == [0, 0] and cache.start.dtype == torch.long
    assert cache.length == 0 and cache.max_len == 5
    plain = KVCache(1, 1, 3, 4)
    assert plain.v.shape == (1, 1, 3, 4) and plain.k.dtype == plain.v.dtype == torch.float32
    assert not plain.k.any() and not plain.v.any()
    keys, values = [], []
    for first, count in ((0, 2), (2, 1), (3, 2)):  # fills max_len exactly
        k, v = _tokens(first, count, 2, 3, 4).double(), -_tokens(first, count, 2, 3, 6).double()
        keys.append(k)
        values.append(v)
        k_all, v_all = cache.update(k, v)
        assert cache.length == first + count
        assert torch.equal(k_all, torch.cat(keys, dim=2))
        assert torch.equal(v_all, torch.cat(values, dim=2))
    with pytest.raises(ValueError, match=r"KVCache overflow: 5 cached \+ 1 new tokens > max_len 5"):
        cache.update(_tokens(5, 1, 2, 3, 4).double(), _tokens(5, 1, 2, 3, 6).double())
    assert cache.length == 5


@pytest.mark.parametrize("name", ["batch", "num_kv_heads", "max_len", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_cache_sizes_must_be_positive_ints(name, bad):
    sizes = {"batch": 1, "num_kv_heads": 1, "max_len": 1, "head_dim": 1}  # 1 is allowed
    KVCache(**sizes)
    with pytest.raises(ValueError, match=f"^{name} must be an int >= 1, got {bad!r}$"):
        KVCache(**{**sizes, name: bad})


def test_sliding_window_cache_names_its_window():
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match=f"^window must be an int >= 1, got {bad!r}$"):
            SlidingWindowCache(1, 1, bad, 4)


def test_decoder_cache_layers_must_be_a_positive_int():
    for bad in (0, -2, False):
        with pytest.raises(ValueError, match=f"^num_layers must be an int >= 1, got {bad!r}$"):
            DecoderCache(bad, 1, 1, 4, 2)


def test_set_padding_is_checked():
    cache = KVCache(2, 1, 8, 2)
    with pytest.raises(ValueError, match=r"start must be a tensor of shape \(2,\), got list"):
        cache.set_padding([0, 1])
    with pytest.raises(ValueError, match=r"start must be a tensor of shape \(2,\), got \(3,\)"):
        cache.set_padding(torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"shape \(2,\), got \(1, 2\)"):
        cache.set_padding(torch.tensor([[0, 1]]))
    for dtype in (torch.float32, torch.complex64, torch.bool):
        with pytest.raises(TypeError, match=f"start must hold integer indices, got {dtype}"):
            cache.set_padding(torch.zeros(2, dtype=dtype))
    message = r"start must be in 0\.\.7 \(the cache's max_len - 1\), got "
    with pytest.raises(ValueError, match=message + r"\[-1, 0\]"):
        cache.set_padding(torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=message + r"\[0, 8\]"):
        cache.set_padding(torch.tensor([0, 8]))
    assert cache.start.tolist() == [0, 0]  # nothing taken from a refused start
    cache.set_padding(torch.tensor([7, 0], dtype=torch.int32))  # the bounds themselves
    assert cache.start.tolist() == [7, 0] and cache.start.dtype == torch.long
    cache.update(_tokens(0, 1), _tokens(0, 1))
    with pytest.raises(ValueError, match="^set_padding must come before the first update$"):
        cache.set_padding(torch.tensor([0, 0]))
    window = SlidingWindowCache(2, 1, 4, 2)  # starts may lie past the window
    with pytest.raises(ValueError, match=r"start must be 0 or more, got \[0, -1\]"):
        window.set_padding(torch.tensor([0, -1]))
    window.set_padding(torch.tensor([100, 0]))
    assert window.start.tolist() == [100, 0]


def test_positions_and_key_padding_follow_the_left_padding():
    cache = KVCache(3, 1, 8, 2)
    assert cache.key_padding() is None
    assert cache.positions.tolist() == [0, 0, 0]
    assert cache.next_positions(3).tolist() == [[0, 1, 2]] * 3
    cache.set_padding(torch.tensor([0, 2, 5]))
    assert cache.positions.tolist() == [0, 0, 0]
    assert cache.next_positions(3).tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 0]]
    cache.update(_tokens(0, 3, 3), _tokens(0, 3, 3))
    assert cache.positions.tolist() == [3, 1, 0] and cache.positions.dtype == torch.long
    next_positions = cache.next_positions(4)
    assert next_positions.tolist() == [[3, 4, 5, 6], [1, 2, 3, 4], [0, 0, 0, 1]]
    assert next_positions.dtype == torch.long
    real = [[True] * 3, [False, False, True], [False] * 3]
    assert cache.key_padding().tolist() == real
    cache.update(_tokens(3, 3, 3), _tokens(3, 3, 3))
    assert cache.positions.tolist() == [6, 4, 1]
    assert cache.key_padding().tolist() == [
        [True] * 6,
        [False] * 2 + [True] * 4,
        [False] * 5 + [True],
    ]


def test_update_checks_shapes_and_dtypes():
    cache = KVCache(2, 1, 8, 4, 3)
    good_k, good_v = torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 3)
    message = r"cache holds \(batch, num_kv_heads, \*, head_dim\) = \(2, 1, \*, 4\); got "
    bad = [
        (torch.zeros(3, 1, 2, 4), good_v, r"k \(3, 1, 2, 4\), v \(2, 1, 2, 3\)"),
        (torch.zeros(2, 2, 2, 4), good_v, r"k \(2, 2, 2, 4\), v \(2, 1, 2, 3\)"),
        (torch.zeros(2, 1, 2, 3), good_v, r"k \(2, 1, 2, 3\), v \(2, 1, 2, 3\)"),
        (good_k, torch.zeros(1, 1, 2, 3), r"k \(2, 1, 2, 4\), v \(1, 1, 2, 3\)"),
        (good_k, torch.zeros(2, 2, 2, 3), r"k \(2, 1, 2, 4\), v \(2, 2, 2, 3\)"),
        (good_k, torch.zeros(2, 1, 1, 3), r"k \(2, 1, 2, 4\), v \(2, 1, 1, 3\)"),
        (good_k, torch.zeros(2, 1, 2, 4), r"k \(2, 1, 2, 4\), v \(2, 1, 2, 4\)"),
    ]
    for k, v, got in bad:
        with pytest.raises(ValueError, match=message + got):
            cache.update(k, v)
    with pytest.raises(TypeError, match="cache holds torch.float32, got k torch.float64, v torch"):
        cache.update(good_k.double(), good_v)
    with pytest.raises(
        TypeError,
        match="v torch.float64: storing would round them silently; allocate the cache with "
        "the model's dtype$",
    ):
        cache.update(good_k, good_v.double())
    assert cache.length == 0
    cache.update(good_k, good_v)
    assert cache.length == 2


def test_reset_forgets_tokens_and_padding():
    cache = KVCache(2, 1, 4, 2)
    start = torch.tensor([1, 0])
    cache.set_padding(start)
    cache.update(_tokens(0, 3), _tokens(0, 3))
    cache.reset()
    assert cache.length == 0 and cache.start.tolist() == [0, 0] and cache.key_padding() is None
    assert start.tolist() == [1, 0]  # the caller's tensor (reset once zeroed it)
    cache.set_padding(torch.tensor([0, 2]))  # allowed again
    k_all, _ = cache.update(_tokens(10, 4), _tokens(10, 4))  # the whole max_len again
    assert torch.equal(k_all, _tokens(10, 4))


def test_reorder_moves_keys_values_and_padding():
    cache = KVCache(3, 1, 4, 2)
    cache.set_padding(torch.tensor([0, 1, 2]))
    cache.update(_tokens(0, 2, 3), -_tokens(0, 2, 3))
    index = torch.tensor([2, 2, 0])
    cache.reorder(index)
    assert cache.start.tolist() == [2, 2, 0]
    k_all, v_all = cache.update(_tokens(2, 1, 3), -_tokens(2, 1, 3))
    assert torch.equal(k_all[:, :, :2], _tokens(0, 2, 3)[index])
    assert torch.equal(v_all[:, :, :2], -_tokens(0, 2, 3)[index])
    assert torch.equal(k_all[:, :, 2:], _tokens(2, 1, 3))
    for bad, got in (([0, 3], r"\[0, 3\]"), ([-1, 0, 1], r"\[-1, 0, 1\]")):
        with pytest.raises(ValueError, match=r"reorder index must be in 0\.\.2, got " + got):
            cache.reorder(torch.tensor(bad))
    assert cache.start.tolist() == [2, 2, 0]


def test_sliding_window_cache_returns_kept_then_new_keys():
    window = 3
    cache = SlidingWindowCache(2, 2, window, 2, 5, dtype=torch.float64)
    assert cache.window == window and cache.max_len == window and cache.first == 0
    length = 0
    for count in (2, 1, 4, 1, 2, 3, 1):  # one step longer than the window
        k, v = _tokens(length, count, 2, 2, 2), -_tokens(length, count, 2, 2, 5)
        k_all, v_all = cache.update(k.double(), v.double())
        first = max(0, length - window)  # the kept keys: the last `window` before this step
        assert cache.first == first
        assert torch.equal(k_all, _tokens(first, length + count - first, 2, 2, 2).double())
        assert torch.equal(v_all, -_tokens(first, length + count - first, 2, 2, 5).double())
        length += count
        assert cache.length == length
    assert cache.k.shape == (2, 2, window, 2) and cache.v.shape == (2, 2, window, 5)
    assert cache.k.dtype == cache.v.dtype == torch.float64


def test_sliding_window_key_padding_and_reset():
    cache = SlidingWindowCache(2, 1, 3, 2)
    cache.set_padding(torch.tensor([0, 4]))
    assert cache.positions.tolist() == [0, 0]
    cache.update(_tokens(0, 5), _tokens(0, 5))
    assert cache.key_padding().tolist() == [[True] * 5, [False] * 4 + [True]]
    assert cache.positions.tolist() == [5, 1]
    cache.update(_tokens(5, 2), _tokens(5, 2))  # keys 2..6
    assert cache.first == 2
    assert cache.key_padding().tolist() == [[True] * 5, [False, False, True, True, True]]
    cache.reset()
    assert cache.first == 0 and cache.length == 0 and cache.key_padding() is None
    cache.set_padding(torch.tensor([1, 0]))
    assert cache.key_padding().tolist() == [[], []]  # no keys yet, none from before
    k_all, _ = cache.update(_tokens(20, 2), _tokens(20, 2))
    assert torch.equal(k_all, _tokens(20, 2))
    assert cache.key_padding().tolist() == [[False, True], [True, True]]


def test_memory_cache_reorder():
    memory = MemoryCache()
    memory.reorder(torch.tensor([1, 0]))  # nothing projected yet: nothing to move
    assert memory.k is None and memory.v is None
    memory.k, memory.v = _tokens(0, 3, 3), -_tokens(0, 3, 3)
    memory.reorder(torch.tensor([2, 0, 0]))
    assert torch.equal(memory.k, _tokens(0, 3, 3)[[2, 0, 0]])
    assert torch.equal(memory.v, -_tokens(0, 3, 3)[[2, 0, 0]])


def test_decoder_cache_holds_one_cache_per_layer():
    cache = DecoderCache(3, 2, 4, 6, 8, dtype=torch.float64)
    assert len(cache.self_attn) == len(cache.cross_attn) == 3
    assert len({id(c) for c in cache.self_attn}) == len({id(c) for c in cache.cross_attn}) == 3
    for layer in cache.self_attn:
        assert isinstance(layer, KVCache) and layer.k.shape == layer.v.shape == (2, 4, 6, 8)
        assert layer.k.dtype == torch.float64
    assert all(isinstance(c, MemoryCache) and c.k is None for c in cache.cross_attn)
    assert cache.length == 0
    for layer in cache.self_attn:
        layer.update(_tokens(0, 2, 2, 4, 8).double(), _tokens(0, 2, 2, 4, 8).double())
        layer.start = torch.tensor([0, 1])
    for memory in cache.cross_attn:
        memory.k, memory.v = _tokens(0, 3), -_tokens(0, 3)
    assert cache.length == 2
    cache.reorder(torch.tensor([1, 1]))
    for layer in cache.self_attn:
        assert layer.start.tolist() == [1, 1]
        assert torch.equal(layer.k[:, :, :2], _tokens(0, 2, 2, 4, 8).double()[[1, 1]])
    for memory in cache.cross_attn:
        assert torch.equal(memory.k, _tokens(0, 3)[[1, 1]])
    uncached = DecoderCache(2, 2, 4, 6, 8, cache_memory=False)
    assert uncached.cross_attn == [None, None]
    assert uncached.self_attn[0].k.dtype == torch.float32
    uncached.reorder(torch.tensor([1, 0]))  # skips the missing memory caches


def test_caches_are_allocated_on_the_requested_device():
    """The meta device stands in for an accelerator: a CPU tensor mixed in shows or fails.
    (Only cheap meta ops: the first meta index_copy_ or clamp loads decompositions, ~2 s.)"""

    def on_meta(*tensors: Tensor) -> bool:
        return all(t.device.type == "meta" for t in tensors)

    cache = KVCache(2, 1, 4, 2, 3, device="meta")
    assert on_meta(cache.k, cache.v, cache.start)
    cache.set_padding(torch.tensor([1, 0]))  # a CPU start moves to the cache's device
    assert on_meta(cache.start)
    k_all, v_all = cache.update(
        torch.zeros(2, 1, 2, 2, device="meta"), torch.zeros(2, 1, 2, 3, device="meta")
    )
    assert k_all.shape == (2, 1, 2, 2) and v_all.shape == (2, 1, 2, 3) and on_meta(k_all, v_all)
    window = SlidingWindowCache(2, 1, 3, 2, device="meta")
    assert on_meta(window.k, window.v, window.start)
    decoder = DecoderCache(2, 2, 1, 4, 2, device="meta")
    assert on_meta(*(layer.k for layer in decoder.self_attn))
