"""PagedKVCache: sequences of different lengths decoded together through a pool of
blocks give the logits of each sequence run alone; prefix sharing, fork with copy on
write, freeing, pool exhaustion and the prefix cache's eviction."""

from __future__ import annotations

import pytest
import torch

from helpers import max_error
from mhsa.cache import PagedKVCache, PagedLayer, PoolExhausted
from mhsa.models.gpt import GPT, GPTConfig
from mhsa.models.llama import Llama, LlamaConfig
from mhsa.nn.positional import AttentionPosition

VOCAB = 50


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding steps are tiny: a second thread only adds waits on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _llama(dtype=torch.float64, **changes) -> Llama:
    config = LlamaConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, **changes
    )
    return Llama(config).to(dtype).eval()


def _gpt(**changes) -> GPT:
    config = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, max_len=64, **changes)
    return GPT(config).double().eval()


MODELS = {
    "llama gqa": lambda: _llama(),
    "llama sliding window": lambda: _llama(sliding_window=6),
    "gpt learned": lambda: _gpt(),
    "gpt rotary gqa": lambda: _gpt(position="rotary", n_kv_head=1),
    "gpt alibi": lambda: _gpt(position="alibi"),
    "gpt t5": lambda: _gpt(position="t5"),
    "gpt window": lambda: _gpt(window=5),
}


def _cache(model, dtype=torch.float64, **options) -> PagedKVCache:
    attn = model.layers[0].attn if isinstance(model, Llama) else model.blocks[0].self_attn
    options = {"num_blocks": 40, "block_size": 5, **options}
    return PagedKVCache(
        len(attn_layers(model)), attn.num_kv_heads, attn.head_dim, dtype=dtype, **options
    )


def attn_layers(model):
    return model.layers if isinstance(model, Llama) else model.blocks


def _serve(model, cache, prompts, continuations, chunk=None):
    """Each prompt prefilled alone (in chunks), then every continuation token decoded
    together: (sequence ids, per sequence the logits from its first uncached token)."""
    seqs = [cache.add_sequence(prompt.tolist()) for prompt in prompts]
    logits = [[] for _ in prompts]
    with torch.no_grad():
        for seq, prompt, out in zip(seqs, prompts, logits, strict=True):
            size = chunk or len(prompt)
            for start in range(cache.length(seq), len(prompt), size):
                part = prompt[start : start + size]
                out.append(model(part[None], caches=cache.batch([seq], len(part)))[0])
        for step in range(len(continuations[0])):
            idx = torch.stack([tokens[step] for tokens in continuations]).view(-1, 1)
            step_logits = model(idx, caches=cache.batch(seqs, 1))
            for n, out in enumerate(logits):
                out.append(step_logits[n])
    return seqs, [torch.cat(out) for out in logits]


def _alone(model, prompt, continuation):
    with torch.no_grad():
        return model(torch.cat([prompt, continuation])[None])[0]


def _tokens(*lengths):
    return [torch.randint(0, VOCAB, (n,)) for n in lengths]


@pytest.mark.parametrize("name", MODELS)
def test_sequences_decoded_together_equal_each_alone(name):
    model = MODELS[name]()
    prompts, continuations = _tokens(4, 13, 9), _tokens(6, 6, 6)
    for chunk in (None, 4):  # whole prompts, and chunks of 4
        cache = _cache(model)
        seqs, logits = _serve(model, cache, prompts, continuations, chunk)
        for prompt, continuation, got in zip(prompts, continuations, logits, strict=True):
            assert max_error(got, _alone(model, prompt, continuation)) < 1e-10
        for seq in seqs:
            cache.free(seq)
        assert cache.used_blocks == 0


def test_reference_backend_and_float32():
    model = _llama()
    for layer in model.layers:
        layer.attn.backend = "reference"  # the module's backend picks the paged one
    prompts, continuations = _tokens(11, 3), _tokens(4, 4)
    _, logits = _serve(model, _cache(model), prompts, continuations)
    for prompt, continuation, got in zip(prompts, continuations, logits, strict=True):
        assert max_error(got, _alone(model, prompt, continuation)) < 1e-10
    model = _llama(torch.float32)
    prompts, continuations = _tokens(30, 7, 18), _tokens(5, 5, 5)
    cache = _cache(model, torch.float32, block_size=16)
    _, logits = _serve(model, cache, prompts, continuations)
    for prompt, continuation, got in zip(prompts, continuations, logits, strict=True):
        assert max_error(got, _alone(model, prompt, continuation)) < 1e-5


def test_a_shared_prefix_is_stored_once():
    model = _llama()
    system = torch.randint(0, VOCAB, (40,))
    prompts = [torch.cat([system, tail]) for tail in _tokens(5, 9)]
    continuations = _tokens(3, 3)
    cache = _cache(model, block_size=16)
    with torch.no_grad():  # the first prompt's blocks are cached once it is prefilled
        first = cache.add_sequence(prompts[0].tolist())
        first_logits = model(prompts[0][None], caches=cache.batch([first], 45))[0]
    assert cache.used_blocks == 3
    second = cache.add_sequence(prompts[1].tolist())
    assert cache.length(second) == 32  # two full blocks of the system prompt
    assert cache.block_table(second)[:2] == cache.block_table(first)[:2]
    assert cache.used_blocks == 3
    with torch.no_grad():
        second_logits = model(prompts[1][None, 32:], caches=cache.batch([second], 17))[0]
        steps = [
            model(idx.view(2, 1), caches=cache.batch([first, second], 1))
            for idx in torch.stack(continuations, dim=1)
        ]
    assert cache.used_blocks == 3 + 2  # 49 + 3 tokens of the second: 4 blocks, 2 shared
    logits = [
        torch.cat([first_logits, *(s[0] for s in steps)]),
        torch.cat([second_logits, *(s[1] for s in steps)]),
    ]
    assert max_error(logits[0], _alone(model, prompts[0], continuations[0])) < 1e-10
    alone = _alone(model, prompts[1], continuations[1])
    assert max_error(logits[1], alone[32:]) < 1e-10
    # the last prompt token is never cached: a prompt of exactly 32 shared tokens reuses 1
    assert cache.length(cache.add_sequence(system[:32].tolist())) == 16
    assert cache.length(cache.add_sequence(system[:33].tolist())) == 32


def test_cached_prefix_blocks_outlive_their_sequences_until_needed():
    model = _llama()
    prompt = torch.randint(0, VOCAB, (23,))
    cache = _cache(model, num_blocks=6, block_size=5)
    seqs, _ = _serve(model, cache, [prompt], [prompt[:0]])
    cache.free(seqs[0])
    assert cache.used_blocks == 0 and cache.free_blocks == 6  # 4 kept for the prefix cache
    again = cache.add_sequence(prompt.tolist())
    assert cache.length(again) == 20 and cache.used_blocks == 4
    with torch.no_grad():
        out = model(prompt[None, 20:], caches=cache.batch([again], 3))[0]
    assert max_error(out, _alone(model, prompt, prompt[:0])[20:]) < 1e-10
    cache.free(again)
    other = cache.add_sequence(list(range(30)))  # needs every block: the oldest evicted
    with torch.no_grad():
        model(torch.arange(30)[None], caches=cache.batch([other], 30))
    cache.free(other)
    assert cache.length(cache.add_sequence(prompt.tolist())) == 0


def test_fork_copies_a_shared_block_before_writing():
    model = _llama()
    prompt, (mine, theirs) = torch.randint(0, VOCAB, (13,)), _tokens(4, 4)
    cache = _cache(model)
    with torch.inference_mode():
        original = cache.add_sequence(prompt.tolist())
        prefill = model(prompt[None], caches=cache.batch([original], 13))[0]
        forked = cache.fork(original)
        assert cache.block_table(forked) == cache.block_table(original)
        assert cache.used_blocks == 3 and cache.length(forked) == 13
        keys = [cache.gather(original, layer) for layer in range(2)]
        assert cache.blocks_needed(forked, 1) == 1  # a copy of the shared, partly filled block
        fork_logits = [model(theirs[None, :1], caches=cache.batch([forked], 1))[0]]
        assert cache.used_blocks == 4 and cache.blocks_needed(original, 1) == 0
        for layer in range(2):  # the original's cached keys and values are untouched
            k, v = cache.gather(original, layer)
            assert torch.equal(k, keys[layer][0]) and torch.equal(v, keys[layer][1])
        pairs = torch.stack([mine, torch.cat([theirs[1:], theirs[:1]])], dim=1)  # (4, 2)
        steps = [
            model(pair.view(2, 1), caches=cache.batch([original, forked], 1)) for pair in pairs
        ]
    mine_logits = torch.cat([prefill, *(s[0] for s in steps)])
    fork_logits = torch.cat([*fork_logits, *(s[1] for s in steps[:-1])])
    assert max_error(mine_logits, _alone(model, prompt, mine)) < 1e-10
    assert max_error(fork_logits, _alone(model, prompt, theirs)[13:]) < 1e-10
    cache.free(original)
    cache.free(forked)
    assert cache.used_blocks == 0


def test_pool_exhaustion_is_predicted_and_changes_nothing():
    model = _llama()
    cache = _cache(model, num_blocks=4, block_size=4)
    first, second = cache.add_sequence(list(range(10))), cache.add_sequence(list(range(20, 30)))
    assert cache.blocks_needed(first, 10) == 3 and cache.blocks_needed(first, 0) == 0
    with torch.no_grad():
        model(torch.arange(10)[None], caches=cache.batch([first], 10))
    assert cache.blocks_needed(first, 2) == 0 and cache.blocks_needed(first, 3) == 1
    assert cache.blocks_needed(second, 10) == 3 > cache.free_blocks == 1
    with pytest.raises(PoolExhausted, match="needs 3 blocks but 1 of 4 are free"):
        cache.batch([second], 10)
    with pytest.raises(PoolExhausted, match="needs 2 blocks"):
        cache.batch([first, second], 3)  # all or nothing
    assert cache.length(first) == 10 and cache.length(second) == 0 and cache.free_blocks == 1
    forked = cache.fork(first)  # both write their shared last block: one copy, not two
    assert cache.blocks_needed(first, 1) == cache.blocks_needed(forked, 1) == 1
    with torch.no_grad():
        model(torch.ones(2, 1, dtype=torch.long), caches=cache.batch([first, forked], 1))
    assert cache.free_blocks == 0 and cache.length(first) == cache.length(forked) == 11
    cache.free(forked)
    assert cache.free_blocks == 1
    cache.free(first)
    assert cache.used_blocks == 0 and isinstance(PoolExhausted("x"), ValueError)


def test_misuse_raises_clear_errors():
    model = _llama()
    cache = _cache(model)
    seq = cache.add_sequence([1, 2, 3])
    for bad, error in (
        ([], ValueError),
        ([1, -2], ValueError),
        ([1.0], ValueError),
        (torch.zeros(2), TypeError),
    ):
        with pytest.raises(error, match="tokens must"):
            cache.add_sequence(bad)
    for call in (
        lambda: cache.length(99),
        lambda: cache.free(99),
        lambda: cache.fork(99),
        lambda: cache.batch([99], 1),
    ):
        with pytest.raises(ValueError, match="no live sequence 99"):
            call()
    for args, message in (
        (([], 1), "non-empty"),
        (([seq, seq], 1), "distinct"),
        (([seq], 0), "new_tokens must be an int >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            cache.batch(*args)
    layers = cache.batch([seq], 3)
    with pytest.raises(ValueError, match="adds 3 tokens per sequence"):
        layers[0].next_positions(2)
    attn = model.layers[0].attn
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        for kwargs, message in (
            ({"need_weights": True}, "need_weights"),
            ({"key": x.clone()}, "self-attention"),
            ({"key_padding_mask": torch.ones(1, 3).bool()}, "key_padding"),
            ({"causal": False}, "attends causally"),
        ):
            with pytest.raises(ValueError, match=message):
                attn(x, cache=layers[0], **{"causal": True, **kwargs})
        with pytest.raises(TypeError, match="float64"):
            model.float().layers[0].attn(x.float(), causal=True, cache=layers[0])
        model.double()
        attn(x, causal=True, cache=layers[0])
        with pytest.raises(ValueError, match="already served"):
            attn(x, causal=True, cache=layers[0])
        cache.batch([seq], 1)  # a new step: the old one's layers are stale
        with pytest.raises(ValueError, match="stale"):
            attn(x, causal=True, cache=layers[1])
    with pytest.raises(ValueError, match="inference"):
        attn(x[:, :1], causal=True, cache=cache.batch([seq], 1)[0])
    wrong = PagedKVCache(2, 1, 8, num_blocks=4, dtype=torch.float64)  # the model has 2 kv heads
    with torch.no_grad(), pytest.raises(ValueError, match=r"k must be \(N, H_kv, T, D\)"):
        model(torch.ones(1, 2, dtype=torch.long), caches=wrong.batch([wrong.add_sequence([1])], 2))

    class Shifted(AttentionPosition):  # rotates from one offset: not per sequence
        def rotate(self, q, k, offset=0):
            return q, k

    with torch.no_grad(), pytest.raises(TypeError, match="not Shifted"):
        attn(x[:, :1], causal=True, position=Shifted(), cache=cache.batch([seq], 1)[0])


def test_a_module_with_rotary_positions_rotates_each_sequence_at_its_own():
    from mhsa.nn import MultiHeadAttention
    from mhsa.nn.positional import RotaryEmbedding

    module = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64).eval()
    rotary = RotaryEmbedding(4)
    xs = [torch.randn(1, n, 16, dtype=torch.float64) for n in (3, 8)]
    cache = PagedKVCache(1, 2, 4, num_blocks=8, block_size=4, dtype=torch.float64)
    with torch.no_grad():
        seqs = [cache.add_sequence(list(range(x.shape[1]))) for x in xs]
        for seq, x in zip(seqs, xs, strict=True):
            (layer,) = cache.batch([seq], x.shape[1])
            assert isinstance(layer, PagedLayer) and layer.length == 0
            module(x, causal=True, position=rotary, cache=layer)
        new = torch.randn(2, 1, 16, dtype=torch.float64)
        (layer,) = cache.batch(seqs, 1)
        assert layer.next_positions(1).tolist() == [[3], [8]] and layer.length == 8
        out = module(new, causal=True, position=rotary, cache=layer)
        for n, x in enumerate(xs):
            alone = module(torch.cat([x, new[n : n + 1]], dim=1), causal=True, position=rotary)
            assert max_error(out[n], alone[0, -1:]) < 1e-12
