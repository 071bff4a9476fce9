"""generate(..., compile=True): the prompt prefilled eagerly, then one compiled decoding
step over StaticKVCaches (fixed shapes); the tokens equal eager decoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import assert_same_greedy
from mhsa.cache import KVCache, SlidingWindowCache, StaticKVCache
from mhsa.models import GPT, GPTConfig
from mhsa.models.decoding import compile_seconds
from mhsa.models.gemma3 import Gemma3, Gemma3Config
from mhsa.models.llama import Llama, LlamaConfig


def _models():
    torch.manual_seed(0)
    yield GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_len=64)).eval()
    yield GPT(
        GPTConfig(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_len=64, position="rotary")
    ).eval()
    config = LlamaConfig(vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48)
    yield Llama(config).eval()
    # dynamic NTK past max_len 16: its frequencies read the longest position (a host
    # read once, which a compiled step could not trace)
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    yield Llama(dataclasses.replace(config, max_len=16, rope_scaling=dynamic)).eval()
    # Gemma 2's attention softcap reads no position: it was refused inside the compiled
    # step (a dynamo error)
    capped = Gemma3Config(
        vocab_size=96,
        n_layer=1,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        d_ff=48,
        sliding_window=None,
        attn_softcap=0.5,
    )
    yield Gemma3(capped).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    list(_models()),
    ids=["gpt", "gpt-rotary", "llama", "llama-dynamic-rope", "gemma-softcap"],
)
def test_compiled_decoding_gives_the_eager_tokens(model):
    options = (
        {"temperature": 0.0, "eos_token": []} if isinstance(model, Llama) else {"temperature": 0.0}
    )
    prompts = [torch.randint(0, 96, (7,)), torch.randint(0, 96, (4,))]  # left-padded
    other = [torch.randint(0, 96, (9,))]  # another length: the same compiled step
    for batch, new in ((prompts, 12), (other, 5)):
        want = model.generate(batch, new, **options)
        got = model.generate(batch, new, compile=True, **options)
        for g, w in zip(got, want, strict=True):
            with torch.no_grad():
                assert_same_greedy(
                    g.tolist(), w.tolist(), lambda i, w=w: model(w[:i].view(1, -1))[0, -1]
                )
    assert compile_seconds(model) > 0


def test_a_static_cache_continues_a_prefilled_cache_in_place():
    cache = KVCache(2, 3, 8, 4)
    cache.set_padding(torch.tensor([0, 2]))
    cache.update(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
    static = StaticKVCache(cache)
    assert static.next_positions(1).tolist() == [[5], [3]]
    k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    all_k, _ = static.update(k, v)
    assert all_k.shape == (2, 3, 8, 4) and torch.equal(cache.k[:, :, 5:6], k)
    assert static.key_padding().tolist() == [
        [True] * 6 + [False] * 2,
        [False] * 2 + [True] * 4 + [False] * 2,
    ]


def test_static_cache_and_compile_refuse_what_they_cannot_do():
    with pytest.raises(TypeError, match="sliding window"):
        StaticKVCache(SlidingWindowCache(1, 2, 4, 8))
    static = StaticKVCache(KVCache(1, 2, 8, 4))
    with pytest.raises(ValueError, match="one token per step"):
        static.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    model = next(_models())
    with pytest.raises(ValueError, match="use_cache=True"):
        model.generate(torch.randint(0, 96, (1, 4)), 2, compile=True, use_cache=False)


def test_a_static_cache_refuses_what_would_see_its_query_misplaced():
    """Its one query sits after all max_len slots: a pattern, T5's buckets or a softcap of
    ALiBi's scores would see it there (0.39 and 0.56 off once); a window over every slot,
    ALiBi, a softcap and causal do not."""
    from mhsa.core.masks import Causal, SlidingWindow
    from mhsa.core.scores import Softcap
    from mhsa.nn import MultiHeadAttention
    from mhsa.nn.positional import ALiBiPosition, RelativeBiasPosition

    torch.manual_seed(0)
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    plain = MultiHeadAttention(16, 2, dtype=torch.float64).eval()
    softcapped = MultiHeadAttention(16, 2, score=Softcap(0.5), dtype=torch.float64).eval()
    softcapped.load_state_dict(plain.state_dict())
    for layer, position, mask, refused in (
        (plain, RelativeBiasPosition(2).double(), None, "RelativeBias"),
        (plain, None, SlidingWindow(2, 0), "SlidingWindow"),
        (plain, None, SlidingWindow(15, 0), None),  # (the whole cache: the model's own case)
        (plain, None, Causal(), None),
        (plain, ALiBiPosition(2), None, None),
        (softcapped, None, None, None),  # (reads no position: it was refused)
        (softcapped, ALiBiPosition(2), None, "ALiBi.* then Softcap"),  # (tanh of a shifted row)
    ):
        options = {"causal": True, "mask": mask, "position": position}
        with torch.no_grad():
            full = layer(x, **options)
            cache = KVCache(1, 2, 16, 8, dtype=torch.float64)
            layer(x[:, :6], cache=cache, **options)
            static = StaticKVCache(cache)
            if refused:
                with pytest.raises(ValueError, match=f"StaticKVCache cannot apply {refused}"):
                    layer(x[:, 6:], cache=static, **options)
            else:
                step = layer(x[:, 6:], cache=static, **options)
                assert (step - full[:, 6:]).abs().max() < 1e-12


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"window": 8}, "got SlidingWindowCache"),
        ({"attention": "moba", "moba_block": 8, "moba_top_k": 1}, "MoBA routes each query"),
        ({"position": "t5"}, "RelativeBias.* would see the query after"),
    ],
    ids=["window", "moba", "t5"],
)
def test_compile_refuses_models_whose_step_needs_more_than_static_caches(options, match):
    """Said before anything is compiled or prefilled, and the eager path still decodes."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, n_layer=1, n_head=2, d_model=32, max_len=64, **options)
    model = GPT(config).eval()
    prompt = torch.randint(0, 96, (1, 10))  # longer than the window: a ring buffer
    with pytest.raises(ValueError, match=f"compile=True decodes .*{match}.*without compile"):
        model.generate(prompt, 3, compile=True, temperature=0.0)
    assert compile_seconds(model) is None
    assert model.generate(prompt, 3, temperature=0.0).shape == (1, 13)


@pytest.mark.slow
def test_more_models_than_dynamos_default_limit_compile_their_steps_in_one_process():
    """The compiled step's code is shared by every model: torch.compile kept 8 versions
    of it, and the 9th model's fullgraph step raised FailOnRecompileLimitHit."""
    prompt, alive = torch.randint(0, 32, (1, 3)), []  # (a freed model frees its version)
    for seed in range(10):  # shapes that differ: each a version of the compiled step
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, max_len=16 + seed)
        alive.append(GPT(config).eval())
        want = alive[-1].generate(prompt, 3, temperature=0.0)
        assert torch.equal(alive[-1].generate(prompt, 3, temperature=0.0, compile=True), want)
