"""One cache interface: every cache answers update / next_positions / key_padding / memory
(mhsa.cache.Cache), the caches of many layers answer update(k, v, layer), attention
modules and models never test a cache's type, and a cache computes no attention."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import mhsa.cache
from helpers import max_error
from mhsa.cache import (
    Cache,
    DecoderCache,
    KVCache,
    MemoryCache,
    MultiLayerCache,
    PagedKVCache,
    SlidingWindowCache,
    StaticKVCache,
)
from mhsa.nn import MultiHeadAttention
from mhsa.nn.positional import AttentionPosition, RotaryEmbedding

SOURCE = Path(__file__).resolve().parents[2] / "src" / "mhsa"
CACHE_TYPES = {name for name in mhsa.cache.__all__ if name != "PoolExhausted"}


def _type_checks_on_caches(path: Path) -> list[str]:
    """'line: call' for each isinstance/issubclass/type(...) is naming a cache class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        named = set()
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
            "isinstance",
            "issubclass",
        ):
            named = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])}
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Call)
            and getattr(node.left.func, "id", "") == "type"
        ):
            named = {
                getattr(n, "id", getattr(n, "attr", ""))
                for c in node.comparators
                for n in ast.walk(c)
            }
        if named & CACHE_TYPES:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_attention_modules_and_models_never_test_a_caches_type(tmp_path):
    """nn/ (attention.py: the module every cache passes through) and models/."""
    files = sorted([*(SOURCE / "nn").glob("*.py"), *(SOURCE / "models").glob("*.py")])
    assert [hit for path in files for hit in _type_checks_on_caches(path)] == []
    planted = tmp_path / "planted.py"  # the check itself finds them
    planted.write_text(
        "if isinstance(cache, (KVCache, mhsa.cache.PagedLayer)):\n    pass\n"
        "elif type(cache) is MemoryCache:\n    pass\n"
    )
    assert len(_type_checks_on_caches(planted)) == 2


def test_the_cache_package_computes_no_attention():
    """It stores and hands out keys and pages: it imports no kernel, backend or
    attention function (only its own modules, the leaf of generic argument checks, and
    the PagedStep its passes hand every layer, which itself imports only those checks)."""
    leaves = {"core.checks", "core.paged_step"}
    for path in (SOURCE / "cache").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                checks = node.level == 2 and node.module in leaves
                own = node.level <= 1 and not (node.module or "").startswith("mhsa")
                assert own or checks, path
    step = SOURCE / "core" / "paged_step.py"
    for node in ast.walk(ast.parse(step.read_text(), str(step))):
        if isinstance(node, ast.ImportFrom):
            generic = node.level == 0 and node.module.split(".")[0] in (
                "__future__",
                "collections",
                "torch",
            )
            assert generic or (node.level, node.module) == (1, "checks"), ast.unparse(node)


def test_every_cache_is_a_cache():
    kv = KVCache(2, 1, 8, 4)
    layer_caches = [kv, SlidingWindowCache(2, 1, 3, 4), StaticKVCache(kv), MemoryCache()]
    paged = PagedKVCache(2, 1, 4, num_blocks=4, block_size=2)
    layer_caches += paged.batch([paged.add_sequence([1, 2])], 2)
    for cache in layer_caches:
        assert isinstance(cache, Cache)
        for name in ("update", "next_positions", "key_padding", "memory", "reorder"):
            assert callable(getattr(cache, name))
    for many in (DecoderCache(2, 2, 1, 8, 4), paged):
        assert isinstance(many, MultiLayerCache) and isinstance(many.layer(1), Cache)


def _kv(batch, length, heads=1, dim=4, value=0.0):
    return torch.full((batch, heads, length, dim), value), torch.full(
        (batch, heads, length, dim), -value
    )


def test_memory_cache_keeps_the_first_keys_and_gives_no_positions():
    memory = MemoryCache()
    assert memory.memory() is None and memory.cross_attention and memory.next_positions(3) is None
    first = _kv(2, 5, value=1.0)
    assert all(torch.equal(a, b) for a, b in zip(memory.update(*first), first, strict=True))
    again = memory.update(*_kv(2, 5, value=2.0))  # the memory is fixed: the first is kept
    assert torch.equal(again[0], first[0]) and torch.equal(memory.memory()[1], first[1])
    assert not KVCache(1, 1, 2, 4).cross_attention and KVCache(1, 1, 2, 4).memory() is None


def test_decoder_cache_updates_and_positions_through_its_layers():
    cache = DecoderCache(2, 2, 1, 8, 4)
    k_all, v_all = cache.update(*_kv(2, 3, value=1.0), 1)
    assert k_all.shape == (2, 1, 3, 4) and cache.self_attn[1].length == 3
    assert cache.self_attn[0].length == 0 and cache.layer(1) is cache.self_attn[1]
    cache.update(*_kv(2, 3), 0)
    assert cache.next_positions(2).tolist() == [[3, 4], [3, 4]]


def test_paged_cache_updates_the_pending_passs_layers():
    cache = PagedKVCache(2, 1, 4, num_blocks=6, block_size=2)
    with pytest.raises(ValueError, match="call batch"):
        cache.layer(0)
    seqs = [cache.add_sequence([1, 2, 3]), cache.add_sequence([4])]
    cache.batch(seqs[:1], 3)
    cache.update(*_kv(1, 3, value=1.0), 0)
    with pytest.raises(ValueError, match=r"layer must be in 0\.\.1"):
        cache.layer(2)
    layer = cache.layer(1)
    k_pool, v_pool = layer.update(*_kv(1, 3, value=2.0))
    assert k_pool.shape == (6, 2, 1, 4) and layer.seq_lens == [3]
    assert layer.block_table.shape == (1, 2) and layer.key_padding() is None
    k, v = cache.gather(seqs[0], 0)
    assert torch.equal(k, torch.ones(1, 3, 4)) and torch.equal(v, -torch.ones(1, 3, 4))
    assert torch.equal(cache.gather(seqs[0], 1)[0], 2 * torch.ones(1, 3, 4))
    with pytest.raises(ValueError, match="does not reorder"):
        layer.reorder(torch.tensor([0]))


def test_rotary_positions_come_from_the_cache_per_sequence():
    """Left-padded sequences decoded together through a KVCache, rotary positions at the
    cache's next_positions, equal each sequence alone."""
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64).eval()
    rotary = RotaryEmbedding(4)
    lengths = (6, 3)
    xs = [torch.randn(1, n + 4, 16, dtype=torch.float64) for n in lengths]
    cache = KVCache(2, 2, 16, 4, dtype=torch.float64)
    start = torch.tensor([max(lengths) - n for n in lengths])
    cache.set_padding(start)
    prompt = torch.cat(
        [
            torch.cat([torch.zeros(1, max(lengths) - n, 16, dtype=torch.float64), x[:, :n]], dim=1)
            for n, x in zip(lengths, xs, strict=True)
        ]
    )
    with torch.no_grad():
        steps = [module(prompt, causal=True, position=rotary, cache=cache)[:, -1:]]
        for t in range(4):
            new = torch.cat([x[:, n + t : n + t + 1] for n, x in zip(lengths, xs, strict=True)])
            steps.append(module(new, causal=True, position=rotary, cache=cache))
        got = torch.cat(steps, dim=1)
        for b, (n, x) in enumerate(zip(lengths, xs, strict=True)):
            alone = module(x, causal=True, position=rotary)[0, n - 1 :]
            assert max_error(got[b], alone) < 1e-12

    class Shifted(AttentionPosition):  # rotates from one offset: not per sequence
        def rotate(self, q, k, offset=0):
            return q, k

    with torch.no_grad(), pytest.raises(TypeError, match="not Shifted"):
        module(new, causal=True, position=Shifted(), cache=cache)


def test_a_memory_cache_equals_projecting_the_memory_at_every_step():
    """Cross-attention through a MemoryCache, with and without a rotary position, gives
    what projecting the memory again at each step gives (its keys rotated once)."""
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 4, dtype=torch.float64).eval()
    memory = torch.randn(2, 5, 16, dtype=torch.float64)
    steps = torch.randn(2, 3, 16, dtype=torch.float64)
    for position in (None, RotaryEmbedding(4)):
        cache = MemoryCache()
        with torch.no_grad():
            for t in range(3):
                step = steps[:, t : t + 1]
                got = module(step, memory, position=position, cache=cache)
                want = module(step, memory, position=position)
                assert max_error(got, want) < 1e-12
        assert cache.k.shape == (2, 4, 5, 4)


def test_a_static_cache_refuses_to_truncate():
    prefilled = KVCache(1, 1, 8, 4)
    prefilled.update(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))
    with pytest.raises(ValueError, match="truncate the prefilled KVCache"):
        StaticKVCache(prefilled).truncate(2)
