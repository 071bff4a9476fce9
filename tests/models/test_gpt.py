"""GPT: cached decoding equals full recomputation; batched prompts; GPT-2 weights."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import max_error, tiny_hf_gpt2
from mhsa.cache import KVCache, SlidingWindowCache
from mhsa.models import GPT, GPTConfig
from mhsa.models.gpt import sample


def small(**changes) -> GPT:
    options = dict(vocab_size=61, n_layer=2, n_head=4, d_model=32, max_len=64)
    options.update(changes)
    return GPT(GPTConfig(**options)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rotary", "alibi", "t5"])
@pytest.mark.parametrize(
    "n_kv_head, window", [(None, None), (2, None), (1, 5)], ids=["mha", "gqa", "mqa-window"]
)
def test_cached_decoding_equals_full_recompute(position, n_kv_head, window):
    model = small(position=position, n_kv_head=n_kv_head, window=window)
    idx = torch.randint(0, 61, (3, 23))
    full = model(idx)
    caches = model.make_caches(3, 23)
    steps = [model(idx[:, :9], caches=caches)]  # prefill
    steps += [model(idx[:, t : t + 1], caches=caches) for t in range(9, 20)]
    steps += [model(idx[:, 20:], caches=caches)]  # a multi-token step after decoding
    assert max_error(torch.cat(steps, dim=1), full) < 1e-5
    if window is not None:
        assert isinstance(caches[0], SlidingWindowCache) and caches[0].k.shape[2] == window


@pytest.mark.parametrize("position", ["learned", "rotary", "alibi", "t5"])
def test_left_padded_batch_equals_each_prompt_alone(position):
    model = small(position=position, n_kv_head=2)
    prompts = [torch.randint(0, 61, (n,)) for n in (5, 12, 1)]
    width = 12
    tokens = torch.zeros(3, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, width - p.numel() :] = p
    start = torch.tensor([width - p.numel() for p in prompts])
    padded = model(tokens, start=start)
    caches = model.make_caches(3, width + 4)
    for cache in caches:
        cache.set_padding(start)
    cached = model(tokens, caches=caches)
    for b, p in enumerate(prompts):
        alone = model(p.view(1, -1))[0]
        assert max_error(padded[b, start[b] :], alone) < 1e-5
        assert max_error(cached[b, start[b] :], alone) < 1e-5


def test_batched_generation_matches_single_and_uncached():
    model = small(position="rotary")
    prompts = [torch.randint(0, 61, (n,)) for n in (3, 9, 6)]
    batched = model.generate(prompts, 10, temperature=0)
    for prompt, out in zip(prompts, batched, strict=True):
        alone = model.generate(prompt.view(1, -1), 10, temperature=0)[0]
        assert torch.equal(out, alone)
        assert torch.equal(out[: prompt.numel()], prompt)
    uncached = model.generate(prompts, 10, temperature=0, use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(batched, uncached, strict=True))


def test_eos_stops_a_sequence():
    model = small()
    prompt = torch.randint(0, 61, (1, 4))
    greedy = model.generate(prompt, 8, temperature=0)[0, 4:]
    eos = int(greedy[2])
    out = model.generate([prompt[0]], 8, temperature=0, eos_token=eos)[0]
    assert out[-1] == eos and out.numel() <= 4 + 3


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    assert sample(logits, temperature=0).item() == 1
    gen = torch.Generator().manual_seed(0)
    draws = {sample(logits, top_k=2, generator=gen).item() for _ in range(200)}
    assert draws == {1, 2}
    draws = {sample(logits, top_p=0.5, generator=gen).item() for _ in range(100)}
    assert draws == {1}  # the top token alone already has probability > 0.5
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample(logits, temperature=-1)


def test_sampling_frequencies_follow_temperature_top_k_and_top_p():
    """20000 draws per setting against the distribution written out here (4 sigma)."""
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    rows = logits.expand(20000, 4)
    gen = torch.Generator().manual_seed(1)

    def frequencies(**options) -> torch.Tensor:
        draws = sample(rows, generator=gen, **options)
        return torch.bincount(draws, minlength=4).double() / draws.numel()

    def softmax(values: list[float]) -> torch.Tensor:
        exp = torch.tensor([math.exp(x) for x in values], dtype=torch.float64)
        return exp / exp.sum()

    tempered = softmax([x / 0.5 for x in logits.tolist()])  # temperature divides
    assert max_error(frequencies(temperature=0.5), tempered) < 0.015
    top2 = softmax([-math.inf, 2.0, 4.0, -math.inf])  # the two likeliest, at T = 0.5
    assert max_error(frequencies(temperature=0.5, top_k=2), top2) < 0.015
    # at T = 1 the sorted probabilities are .579, .213, .129, .078: the smallest set
    # reaching 0.75 is the first two, reaching 0.8 the first three
    nucleus = softmax([-math.inf, 1.0, 2.0, -math.inf])
    assert max_error(frequencies(top_p=0.75), nucleus) < 0.015
    nucleus = softmax([-math.inf, 1.0, 2.0, 0.5])
    assert max_error(frequencies(top_p=0.8), nucleus) < 0.015


def test_tiny_temperatures_and_top_p_sample_the_likeliest_token():
    """Valid settings at the edge: a temperature of 1e-300 or a top_p below float32's
    smallest number is a draw of the likeliest token (one of the tied ones), never nan."""
    logits = torch.tensor([[0.0, 3.0, -1.0, 3.0], [2.0, -5.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for options in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"top_p": 1e-50, "top_k": 3}):
        draws = torch.stack([sample(logits, generator=gen, **options) for _ in range(50)])
        assert set(draws[:, 0].tolist()) <= {1, 3} and set(draws[:, 1].tolist()) == {0}, options
    big = torch.tensor([[3e38, -3e38, 1.0]])
    assert sample(big, temperature=1e-3, generator=gen).item() == 0


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_window_attends_exactly_the_last_window_tokens(position):
    """With window 4, one layer: the logits at position 12 depend on tokens 9..12 only."""
    model = small(n_layer=1, window=4, position=position)
    ids = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(0))

    def logits_after_changing(index: int) -> torch.Tensor:
        changed = ids.clone()
        changed[0, index] = (changed[0, index] + 1) % 61
        return model(changed)[0, 12]

    base = model(ids)[0, 12]
    assert max_error(logits_after_changing(8), base) < 1e-6  # outside the window
    assert max_error(logits_after_changing(9), base) > 1e-3  # its oldest token


def test_limits_are_clear_errors():
    model = small(max_len=16)
    with pytest.raises(ValueError, match="exceeds max_len 16"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 10)
    cache = KVCache(1, 2, 4, 8)
    with pytest.raises(ValueError, match="overflow"):
        cache.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
    with pytest.raises(ValueError, match="position must be one of"):
        GPTConfig(position="relative")


def test_sliding_window_cache_memory_is_bounded():
    cache = SlidingWindowCache(1, 1, 4, 2)
    for t in range(10):
        k = torch.full((1, 1, 1, 2), float(t))
        keys, _ = cache.update(k, k)
    assert cache.k.shape[2] == 4
    assert keys[0, 0, :, 0].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]  # oldest first


def test_logits_equal_transformers_gpt2():
    hf = tiny_hf_gpt2(n_layer=3)
    config = GPTConfig(vocab_size=101, n_layer=3, n_head=4, d_model=48, max_len=64)
    ours = GPT.from_hf_gpt2(hf.state_dict(), config).eval()
    idx = torch.randint(0, 101, (2, 30))
    with torch.no_grad():
        expected = hf(idx).logits
    assert max_error(ours(idx), expected) < 1e-4
    generated = ours.generate(idx[:, :10], 8, temperature=0)
    with torch.no_grad():
        hf_generated = hf.generate(idx[:, :10], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, hf_generated)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_head": 0}, "n_head must be an int >= 1"),
        ({"vocab_size": 0}, "vocab_size must be"),
        ({"n_layer": -1}, "n_layer must be"),
        ({"d_model": -8}, "d_model must be"),
        ({"n_kv_head": 3}, "n_kv_head must divide n_head"),
        ({"dropout": 1.5}, "dropout must be"),
        ({"n_kv_head": True}, "n_kv_head must be an int, got True"),
        ({"max_len": 0}, "max_len must be"),
        ({"attention": "mla"}, "attention must be one of"),
        ({"attention": "latent", "n_kv_head": 2}, "attention='latent' shares one latent"),
        ({"attention": "diff", "d_model": 36, "n_head": 4}, "attention='diff' needs d_model"),
        ({"attention": "diff", "n_kv_head": 2}, "no grouped-query heads"),
        ({"attention": "moba", "window": 8}, "attention='moba' is causal"),
        ({"attention": "moba", "position": "alibi"}, "attention='moba' is causal"),
        ({"attention": "moba", "moba_top_k": 0}, "moba_top_k must be an int >= 1"),
        ({"attention": "moba", "moba_block": 0}, "moba_block must be an int >= 1"),
    ],
)
def test_config_errors_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**options)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"top_k": 0}, ValueError, "top_k must be an int >= 1"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": -0.5}, ValueError, "top_p must be"),
        ({"temperature": float("nan")}, ValueError, "temperature must be >= 0"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be >= 0"),
        ({"prompt": torch.tensor([1.0, 2.0])}, TypeError, "prompt must hold integer token ids"),
        ({"prompt": torch.tensor([1, 300])}, ValueError, "token id 300, outside .* 0..255"),
        ({"prompt": torch.tensor([-1, 2])}, ValueError, "token id -1"),
        # (were `len()` TypeErrors from inside generate)
        ({"eos_token": 2.0}, TypeError, "eos_token must be a token id, a list of them"),
        ({"eos_token": torch.tensor(300)}, ValueError, "eos_token holds token id 300"),
    ],
)
def test_generate_errors_name_the_argument(options, error, message):
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, max_len=32)).eval()
    options = dict(options)  # the parametrize dict is shared: a rerun must see it whole
    prompt = options.pop("prompt", torch.tensor([1, 2, 3]))
    max_new_tokens = options.pop("max_new_tokens", 2)
    with pytest.raises(error, match=message):
        model.generate([prompt], max_new_tokens, **options)


def test_a_1d_tensor_prompt_is_refused_before_decoding_and_tensor_eos_ids_serve():
    """A 1-D tensor (what a tokenizer returns) was decoded as a batch of one-token
    prompts, then raised IndexError at the end."""
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, max_len=32)).eval()
    with pytest.raises(ValueError, match=r"idx must be a \(B, T\) tensor .* got \(5,\)"):
        model.generate(torch.tensor([1, 2, 3, 4, 5]), 2)
    # a list of lists, (1, T) tensors or 0-d tensors: AttributeError, or a cat error
    # after the whole decode
    for prompts, got in (([[1, 2]], "list"), ([torch.tensor([[1, 2]])], r"\(1, 2\)")):
        with pytest.raises(ValueError, match=rf"idx's prompts must be 1-D tensors, got {got}"):
            model.generate(prompts, 2)
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 4, temperature=0, eos_token=[])
    stop = int(greedy[0, 3])  # the first new token
    for eos in (torch.tensor(stop), torch.tensor([stop])):
        assert model.generate(prompt, 4, temperature=0, eos_token=eos)[0, 3:].tolist() == [stop]


def test_top_p_1_keeps_every_token():
    """float32's running sum reached 1.0 before the tail: half of a 128k vocabulary
    became unsampleable at top_p=1.0."""
    from mhsa.models.sampling import Sampling, probabilities

    logits = torch.randn(1, 128000, generator=torch.Generator().manual_seed(0)) * 4
    full = probabilities(logits, Sampling(1.0))
    assert torch.equal(probabilities(logits, Sampling(1.0, top_p=1.0)), full)


def test_start_with_caches_is_refused():
    """start was dropped with caches: the padding read as tokens (logits 0.25 off)."""
    model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, max_len=32)).eval()
    caches = model.make_caches(2, 8)
    with pytest.raises(ValueError, match=r"start is for calls without caches.*set_padding"):
        model(torch.tensor([[0, 5, 6], [1, 2, 3]]), caches=caches, start=torch.tensor([1, 0]))


def test_forward_rejects_token_ids_outside_the_vocabulary():
    model = GPT(GPTConfig(vocab_size=10, n_layer=1, n_head=2, d_model=16, max_len=32))
    with pytest.raises(ValueError, match="idx holds token id 10"):
        model(torch.tensor([[1, 10]]))


def test_left_padded_generation_with_a_sliding_window_cache_equals_each_prompt_alone():
    """The window cache's key padding (its padded path): a left-padded batch decoded
    past the window gives each prompt's own greedy tokens."""
    model = small(window=4, position="rotary")
    prompts = [
        torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 2, 9)
    ]
    together = model.generate(prompts, 10, temperature=0)
    for prompt, out in zip(prompts, together, strict=True):
        alone = model.generate([prompt], 10, temperature=0)[0]
        assert torch.equal(out, alone)


@pytest.mark.parametrize(
    ("attention", "options"),
    [
        ("diff", {"position": "rotary"}),
        ("diff", {"position": "alibi"}),
        ("diff", {"position": "learned", "window": 5}),
        ("moba", {"position": "rotary", "moba_block": 4, "moba_top_k": 2, "n_kv_head": 2}),
        ("latent", {"position": "rotary"}),
        ("latent", {"position": "t5"}),
        ("latent", {"position": "learned", "window": 5}),
    ],
)
def test_attention_variants_decode_with_caches_as_full_recompute(attention, options):
    """Differential attention caches 2H half-width heads; MoBA routes each call's new
    tokens as a block, so its steps here fill whole blocks of 4."""
    torch.manual_seed(0)
    model = small(attention=attention, **options)
    idx = torch.randint(0, 61, (2, 24))
    caches = model.make_caches(2, 24)
    if attention in ("diff", "latent"):
        steps = [model(idx[:, :9], caches=caches)]
        steps += [model(idx[:, t : t + 1], caches=caches) for t in range(9, 24)]
    else:
        steps = [model(idx[:, t : t + 4], caches=caches) for t in range(0, 24, 4)]
    assert max_error(torch.cat(steps, dim=1), model(idx)) < 1e-5
    assert len(model.generate([torch.tensor([1, 2, 3])], 4)[0]) == 7


def test_attention_variants_replace_every_layers_self_attention():
    from mhsa.nn import DiffAttention, LatentAttention, MoBA, MultiHeadAttention

    for attention, kind in (("standard", MultiHeadAttention), ("diff", DiffAttention)):
        model = small(attention=attention)
        assert all(type(block.self_attn) is kind for block in model.blocks)
    model = small(attention="moba", moba_block=8, moba_top_k=3)
    assert all(isinstance(b.self_attn, MoBA) for b in model.blocks)
    assert model.blocks[0].self_attn.top_k == 3
    model = small(attention="latent")
    assert all(isinstance(b.self_attn, LatentAttention) for b in model.blocks)
    # the cache keeps one head of kv_lora_rank + qk_rope_head_dim per token, no values
    width = model.blocks[0].self_attn.cache_width
    assert model.cache_layout.num_kv_heads == 1 and model.cache_layout.value_dim == 0
    assert tuple(model.make_caches(2, 8)[0].k.shape) == (2, 1, 8, width)
    lambdas = [block.self_attn.lambda_init for block in small(attention="diff").blocks]
    assert lambdas[0] < lambdas[1]  # lambda_init grows with depth


def test_moba_generates_without_a_cache():
    """Unpadded prompts recompute with no key padding, which MoBA refuses."""
    model = small(attention="moba", moba_block=4, moba_top_k=2)
    prompt = torch.randint(0, 61, (1, 9))
    cached = model.generate(prompt, 5, temperature=0)
    assert torch.equal(model.generate(prompt, 5, temperature=0, use_cache=False), cached)


def test_moba_decodes_prompts_of_different_lengths_each_as_alone():
    """MoBA takes no left padding: generate decodes such prompts one after another."""
    model = small(attention="moba", moba_block=4, moba_top_k=1).double()
    prompts = [torch.randint(0, 61, (5,)), torch.randint(0, 61, (9,))]
    together = model.generate(prompts, 6, temperature=0, eos_token=[])
    for prompt, row in zip(prompts, together, strict=True):
        assert torch.equal(row, model.generate([prompt], 6, temperature=0, eos_token=[])[0])
        assert row.numel() == prompt.numel() + 6  # eos_token=[] reaches each row as given


def test_moba_refuses_packed_rows_and_sequence_shards():
    model = small(attention="moba", moba_block=4)
    idx = torch.randint(0, 61, (1, 8))
    for options in ({"cu_seqlens": torch.tensor([0, 3, 8])}, {"positions": torch.arange(8, 16)}):
        with pytest.raises(ValueError, match="attention='moba' chooses blocks within one"):
            model(idx, **options)
