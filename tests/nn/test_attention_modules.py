"""The four attention modules (MultiHeadAttention, LatentAttention, DiffAttention, MoBA)
on one base: one forward signature, and over a paged cache (PagedKVCache, as `mhsa serve`
decodes) each either serves it, with the answer of a contiguous KVCache (and of no cache,
where that is the same computation), or refuses it with a ValueError naming itself and
the alternative; what pages cannot hold is refused alike by all four, naming the module."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from helpers import max_error
from mhsa.cache import KVCache, PagedKVCache
from mhsa.nn import DiffAttention, LatentAttention, MoBA, MultiHeadAttention
from mhsa.nn.attention_base import AttentionModule
from mhsa.nn.positional import RotaryEmbedding

PROMPTS = (5, 11)  # two sequences' prompt lengths (not block multiples)
STEPS = 4  # tokens decoded one at a time after each prompt
ROTARY = 8  # every module's rotated width


class Kind:
    """How to build one module and the caches it reads: heads and widths per token."""

    def __init__(
        self,
        build: Callable[[], AttentionModule],
        heads: int,
        width: int,
        value_width: int | None = None,
        recomputes: bool = True,
    ) -> None:
        self.build, self.heads, self.width, self.value_width = build, heads, width, value_width
        self.recomputes = recomputes  # cached decoding == one call without a cache

    def module(self) -> AttentionModule:
        torch.manual_seed(0)
        return self.build().eval()

    def pool(self, num_blocks: int = 12) -> PagedKVCache:
        return PagedKVCache(
            1,
            self.heads,
            self.width,
            num_blocks=num_blocks,
            block_size=4,
            value_dim=self.value_width,
        )

    def contiguous(self, max_len: int) -> KVCache:
        return KVCache(1, self.heads, max_len, self.width, self.value_width)


def _latent() -> LatentAttention:
    return LatentAttention(
        40, 4, kv_lora_rank=24, qk_rope_head_dim=ROTARY, qk_nope_head_dim=10, v_head_dim=12
    )


KINDS = {
    "MultiHeadAttention": Kind(lambda: MultiHeadAttention(32, 4, num_kv_heads=2), 2, 8),
    "LatentAttention": Kind(_latent, 1, 24 + ROTARY, value_width=0),
    "DiffAttention": Kind(lambda: DiffAttention(48, 3, depth=1), 6, 8),
    # one token a step routes as its own query block: a KVCache's answer, not a full call's
    "MoBA": Kind(lambda: MoBA(32, 4, block_size=4, top_k=1, num_kv_heads=2), 2, 8, None, False),
}


def _inputs(width: int) -> list[Tensor]:
    torch.manual_seed(1)
    return [torch.randn(1, n + STEPS, width) for n in PROMPTS]


def _paged_decode(module, xs: list[Tensor], pool: PagedKVCache, call: dict) -> list[Tensor]:
    """Each prompt prefilled alone (longest first, so the pages interleave), then STEPS
    tokens of both sequences in one call each: each sequence's outputs (1, T, E)."""
    ids = [pool.add_sequence([100 * i + t for t in range(n)]) for i, n in enumerate(PROMPTS)]
    outs: list[list[Tensor]] = [[] for _ in xs]
    for i in sorted(range(len(xs)), key=lambda i: -PROMPTS[i]):
        outs[i].append(
            module(xs[i][:, : PROMPTS[i]], cache=pool.batch([ids[i]], PROMPTS[i])[0], **call)
        )
    for step in range(STEPS):
        x = torch.cat([x[:, n + step : n + step + 1] for x, n in zip(xs, PROMPTS, strict=True)])
        out = module(x, cache=pool.batch(ids, 1)[0], **call)
        for i in range(len(xs)):
            outs[i].append(out[i : i + 1])
    return [torch.cat(o, dim=1) for o in outs]


def _contiguous_decode(module, x: Tensor, prompt: int, cache: KVCache, call: dict) -> Tensor:
    """The same calls for one sequence over a contiguous KVCache."""
    outs = [module(x[:, :prompt], cache=cache, **call)]
    outs += [module(x[:, t : t + 1], cache=cache, **call) for t in range(prompt, x.shape[1])]
    return torch.cat(outs, dim=1)


def test_every_module_has_the_one_forward():
    for kind in KINDS.values():
        module = kind.module()
        assert isinstance(module, AttentionModule)
        assert type(module).forward is AttentionModule.forward


@pytest.mark.parametrize("name", list(KINDS))
@torch.no_grad()
def test_each_module_serves_a_paged_cache_or_refuses_it(name):
    kind = KINDS[name]
    module = kind.module()
    xs = _inputs(module.embed_dim)
    call = {"causal": True, "position": RotaryEmbedding(ROTARY)}
    pool = kind.pool()
    if module.paged_alternative is not None:
        layer = pool.batch([pool.add_sequence([1, 2, 3])], 3)[0]
        with pytest.raises(ValueError, match=f"{name} does not attend over a paged cache"):
            module(xs[0][:, :3], cache=layer, **call)
        return
    paged = _paged_decode(module, xs, pool, call)
    for x, n, out in zip(xs, PROMPTS, paged, strict=True):
        cached = _contiguous_decode(module, x, n, kind.contiguous(x.shape[1]), call)
        assert max_error(out, cached) < 1e-5
        if kind.recomputes:
            assert max_error(out, module(x, **call)) < 1e-5


class _Unpaged(MultiHeadAttention):
    """A module that declares it does not serve paged caches."""

    paged_alternative = "decode it with a contiguous KVCache"


@torch.no_grad()
def test_a_module_that_does_not_serve_pages_refuses_them_before_writing():
    module = _Unpaged(32, 4, num_kv_heads=2).eval()
    pool = KINDS["MultiHeadAttention"].pool(num_blocks=4)
    layer = pool.batch([pool.add_sequence([1, 2, 3])], 3)[0]
    with pytest.raises(ValueError, match=r"_Unpaged does not attend over a paged cache .*KVCache"):
        module(torch.randn(1, 3, 32), causal=True, cache=layer)
    assert not pool.k.any() and not pool.v.any()  # nothing written into the pages


@pytest.mark.parametrize("name", list(KINDS))
@torch.no_grad()
def test_what_pages_cannot_hold_is_refused_naming_the_module(name):
    kind = KINDS[name]
    module = kind.module()
    pool = kind.pool(num_blocks=4)
    layer = pool.batch([pool.add_sequence([1, 2, 3])], 3)[0]
    x = torch.randn(1, 3, module.embed_dim)
    padding = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=f"{name} over a paged cache takes no key_padding_mask"):
        module(x, causal=True, cache=layer, key_padding_mask=padding)
    with pytest.raises(ValueError, match=f"{name} .*need_weights"):
        module(x, causal=True, cache=layer, need_weights=True)
    with pytest.raises(ValueError, match="self-attention: pass no key or value"):
        module(x, torch.randn(1, 3, module.embed_dim), causal=True, cache=layer)
    module.dropout = 0.1
    with pytest.raises(ValueError, match=f"{name} over a paged cache takes no dropout"):
        module.train()(x, causal=True, cache=layer)
    assert not pool.k.any() and not pool.v.any()  # each refused before writing the pages
