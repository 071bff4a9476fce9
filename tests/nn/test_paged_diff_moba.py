"""DiffAttention and MoBA over a PagedKVCache (as `mhsa serve` decodes): the same answers
as a contiguous KVCache and as full recomputation, for sequences of different lengths
whose pages interleave in one pool, decoded together."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from helpers import max_error
from mhsa.cache import KVCache, PagedKVCache
from mhsa.core.masks import SlidingWindow
from mhsa.core.moba import moba_attention
from mhsa.core.paged_step import PagedStep
from mhsa.nn import DiffAttention, MoBA, MultiHeadAttention
from mhsa.nn.positional import ALiBiPosition, AttentionPosition, RotaryEmbedding

E, H = 48, 3  # DiffAttention: 2H = 6 query/key heads of width 8, values 16 wide
PROMPTS = (5, 11)  # prompt lengths of the two sequences (not block multiples)
STEPS = 6  # tokens decoded one at a time after each prompt


def diff_module(backend: str) -> DiffAttention:
    torch.manual_seed(0)
    module = DiffAttention(E, H, depth=2, qkv_bias=True, backend=backend)
    with torch.no_grad():
        module.sub_norm.weight.uniform_(0.5, 1.5)
    return module.eval()


def moba_module(backend: str) -> MoBA:
    torch.manual_seed(0)
    return MoBA(32, 4, block_size=4, top_k=1, num_kv_heads=2, backend=backend).eval()


def paged_decode(module, xs: list[Tensor], pool: PagedKVCache, call: dict) -> list[Tensor]:
    """Each sequence's prompt prefilled alone (longest first, so pages interleave), then
    STEPS tokens of all sequences in one call each: each sequence's outputs (1, T, E)."""
    ids = [pool.add_sequence(list(range(n))) for n in PROMPTS]
    outs = [[] for _ in xs]
    for i in sorted(range(len(xs)), key=lambda i: -PROMPTS[i]):
        layer = pool.batch([ids[i]], PROMPTS[i])[0]
        outs[i].append(module(xs[i][:, : PROMPTS[i]], cache=layer, **call))
    for step in range(STEPS):
        layer = pool.batch(ids, 1)[0]
        x = torch.cat([x[:, n + step : n + step + 1] for x, n in zip(xs, PROMPTS, strict=True)])
        out = module(x, cache=layer, **call)
        for i in range(len(xs)):
            outs[i].append(out[i : i + 1])
    return [torch.cat(o, dim=1) for o in outs]


def contiguous_decode(module, x: Tensor, prompt: int, cache: KVCache, call: dict) -> Tensor:
    """The same calls for one sequence over a contiguous KVCache."""
    outs = [module(x[:, :prompt], cache=cache, **call)]
    for t in range(prompt, x.shape[1]):
        outs.append(module(x[:, t : t + 1], cache=cache, **call))
    return torch.cat(outs, dim=1)


def inputs(width: int) -> list[Tensor]:
    torch.manual_seed(1)
    return [torch.randn(1, n + STEPS, width) for n in PROMPTS]


POSITIONS = {
    "none": lambda: None,
    "rotary": lambda: RotaryEmbedding(E // H // 2),
    "alibi": lambda: ALiBiPosition(2 * H),  # a score function over the 2H paired heads
}


@pytest.mark.parametrize("backend", ["reference", "flash"])
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("window", [None, 4])
@torch.no_grad()
def test_diff_attention_over_pages_equals_full_recompute(backend, position, window):
    module, xs = diff_module(backend), inputs(E)
    call = {"position": POSITIONS[position](), "causal": window is None}
    call["mask"] = None if window is None else SlidingWindow(window - 1, 0)
    pool = PagedKVCache(1, 2 * H, E // H // 2, num_blocks=12, block_size=4)
    paged = paged_decode(module, xs, pool, call)
    for x, n, out in zip(xs, PROMPTS, paged, strict=True):
        full = module(x, **call)
        assert max_error(out, full) < 1e-5
        cache = KVCache(1, 2 * H, x.shape[1], E // H // 2)
        assert max_error(out, contiguous_decode(module, x, n, cache, call)) < 1e-5


@torch.no_grad()
def test_diff_attention_over_pages_refuses_what_pages_cannot_hold():
    module = diff_module("auto")
    pool = PagedKVCache(1, 2 * H, E // H // 2, num_blocks=4, block_size=4)
    layer = pool.batch([pool.add_sequence([1, 2, 3])], 3)[0]
    x = torch.randn(1, 3, E)
    with pytest.raises(ValueError, match="key_padding_mask"):
        module(x, causal=True, cache=layer, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        module(x, causal=False, cache=layer)


class _DenseBias(AttentionPosition):
    """A position that gives a dense (H, L, S) bias, which paged keys cannot take."""

    def attention_bias(self, q_len: int, kv_len: int) -> Tensor:
        return torch.zeros(2 * H, q_len, kv_len)


@torch.no_grad()
def test_modules_over_pages_refuse_a_positions_dense_bias():
    """A position's bias (attention_bias) is a dense tensor: over pages, MultiHeadAttention
    and DiffAttention refuse it, naming the fix (a score function)."""
    x = torch.randn(1, 3, E)
    modules = [
        (diff_module("auto"), PagedKVCache(1, 2 * H, E // H // 2, num_blocks=4, block_size=4)),
        (MultiHeadAttention(E, 2 * H).eval(), PagedKVCache(1, 2 * H, E // H // 2, num_blocks=4)),
    ]
    for module, pool in modules:
        layer = pool.batch([pool.add_sequence([1, 2, 3])], 3)[0]
        with pytest.raises(ValueError, match="takes no bias.*score function"):
            module(x, causal=True, cache=layer, position=_DenseBias())


@pytest.mark.parametrize("backend", ["reference", "flash"])
@torch.no_grad()
def test_moba_over_pages_equals_a_contiguous_cache(backend):
    # one token a step routes as its own query block: the answer of a KVCache decoding
    # the same calls (mhsa generate's), which full recomputation does not give
    module, xs = moba_module(backend), inputs(32)
    call = {"position": RotaryEmbedding(8)}
    pool = PagedKVCache(1, 2, 8, num_blocks=12, block_size=4)
    paged = paged_decode(module, xs, pool, call)
    for x, n, out in zip(xs, PROMPTS, paged, strict=True):
        cache = KVCache(1, 2, x.shape[1], 8)
        assert max_error(out, contiguous_decode(module, x, n, cache, call)) < 1e-5


@torch.no_grad()
def test_moba_over_pages_equals_full_recompute_when_each_call_fills_whole_blocks():
    module = moba_module("flash")
    torch.manual_seed(2)
    x = torch.randn(2, 16, 32)
    rotary = RotaryEmbedding(8)
    full = module(x, position=rotary)
    pool = PagedKVCache(1, 2, 8, num_blocks=12, block_size=3)  # pages across MoBA blocks
    ids = [pool.add_sequence([7] * 16) for _ in range(2)]
    outs = [
        module(x[:, t : t + 4], position=rotary, cache=pool.batch(ids, 4)[0])
        for t in range(0, 16, 4)
    ]
    assert max_error(torch.cat(outs, dim=1), full) < 1e-5


def test_paged_moba_attention_checks_its_pages():
    q = torch.randn(1, 2, 1, 8)
    pool = torch.randn(4, 4, 2, 8)
    with pytest.raises(ValueError, match="seq_lens goes with block_table"):
        moba_attention(q, pool, pool, 4, 1, seq_lens=[3])
    with pytest.raises(ValueError, match="block_table"):
        moba_attention(q, pool, pool, 4, 1, block_table=torch.zeros(2, 1), seq_lens=[3])
    table = torch.tensor([[2]])
    step = PagedStep(table, [3], num_blocks=4, block_size=4)
    by_table = moba_attention(q, pool, pool, 4, 1, block_table=table, seq_lens=[3])
    assert torch.equal(moba_attention(q, pool, pool, 4, 1, step=step), by_table)
    with pytest.raises(ValueError, match="not both"):
        moba_attention(q, pool, pool, 4, 1, block_table=table, seq_lens=[3], step=step)
    with pytest.raises(ValueError, match="made for"):  # the step of other pools
        moba_attention(q, pool[:3], pool[:3], 4, 1, step=step)
