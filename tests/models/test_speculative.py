"""Speculative decoding (mhsa.models.speculative, sampling.accept_draft): greedy output
is exactly plain decoding's with prompt lookup and with a draft model (GPT and Llama,
with stop tokens); sampled tokens keep the target's distribution (a chi-square test on
a tiny vocabulary, drafts from a model q and deterministic ones); the paged cache's
truncate gives rejected drafts' blocks back."""

from __future__ import annotations

import math

import pytest
import torch

from mhsa.cache import PagedKVCache
from mhsa.models.gpt import GPT, GPTConfig
from mhsa.models.llama import Llama, LlamaConfig
from mhsa.models.sampling import Sampling, StopRule, accept_draft, probabilities
from mhsa.models.speculative import DraftModel, PromptLookup


def _gpt(width: int, layers: int, seed: int) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=48, max_len=256, d_model=width, n_head=2, n_layer=layers)
    return GPT(config).double().eval()


def _llama(width: int, layers: int, seed: int) -> Llama:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=48,
        n_layer=layers,
        n_head=4,
        n_kv_head=2,
        d_model=width,
        d_ff=2 * width,
        max_len=256,
    )
    return Llama(config).double().eval()


def test_prompt_lookup_drafts_what_followed_the_latest_ngram():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    context = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup.propose(context, 2)[0] == [4, 5]  # the longest n-gram first: "1 2 3"
    assert lookup.propose([9, 2, 3, 7, 8, 5, 2, 3], 2)[0] == [7, 8]  # then "2 3"
    assert lookup.propose([2, 3, 1, 2, 3, 6, 0, 3], 5)[0] == [6, 0, 3]  # the latest "3"
    assert lookup.propose([5, 6, 7, 5, 6], 4)[0] == [7, 5, 6]
    assert lookup.propose([1, 2, 3], 4)[0] == []  # nothing repeats
    assert PromptLookup().propose([2, 3, 1, 2, 3, 6, 0, 3], 5)[0] == []  # default: n >= 2
    assert PromptLookup().propose([9, 2, 3, 7, 8, 5, 2, 3], 2)[0] == [7, 8]
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_a_draft_model_out_of_room_drafts_nothing_and_decoding_goes_on():
    """A pool of 4 blocks (64 tokens) under a 90-token answer: it raised PoolExhausted
    halfway; now its drafts stop and the tokens are plain decoding's."""
    target, draft = _gpt(32, 2, 0), _gpt(16, 1, 1)
    speculate = DraftModel(draft, num_blocks=4)
    prompt = torch.randint(0, 48, (30,), generator=torch.Generator().manual_seed(2))
    plain = target.generate([prompt], 60, temperature=0, eos_token=[])[0]
    fast = target.generate([prompt], 60, temperature=0, eos_token=[], speculate=speculate)[0]
    assert torch.equal(fast, plain)
    assert speculate.pool.free_blocks == 4  # the stream was forgotten at the end
    assert speculate.propose(list(range(70)), 3) == ([], None)  # more than the pool holds


def test_one_draft_model_serves_generate_calls_in_threads():
    """Every call drafted under one stream key in the shared pool: threads freed and
    re-batched each other's sequence, and every one of them raised."""
    import threading

    target, draft = _gpt(32, 2, 0), _gpt(16, 1, 1)
    speculate = DraftModel(draft, num_blocks=64)
    prompt = torch.randint(0, 48, (9,), generator=torch.Generator().manual_seed(2))
    plain = target.generate([prompt], 30, temperature=0, eos_token=[])[0]
    results, errors = [], []

    def decode() -> None:
        try:
            for _ in range(3):
                options = dict(temperature=0, eos_token=[], speculate=speculate)
                results.append(torch.equal(target.generate([prompt], 30, **options)[0], plain))
        except Exception as error:  # (reported below: the test asserts there are none)
            errors.append(error)

    threads = [threading.Thread(target=decode) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and results == [True] * 9
    assert speculate.pool.free_blocks == 64


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("kind", ["prompt-lookup", "draft"])
def test_greedy_speculative_decoding_equals_plain_decoding(family, kind):
    make = _gpt if family == "gpt" else _llama
    target, draft = make(32, 2, 0), make(16, 1, 1)
    speculate = PromptLookup() if kind == "prompt-lookup" else DraftModel(draft)
    generator = torch.Generator().manual_seed(0)
    phrase = torch.randint(0, 48, (7,), generator=generator)
    prompts = [
        phrase.repeat(4),  # copying: drafts that stand
        torch.randint(0, 48, (23,), generator=generator),  # free text
        torch.randint(0, 48, (1,), generator=generator),
    ]
    accepted = 0
    for prompt in prompts:
        for eos in ([], [int(prompt[-1])]):
            plain = target.generate([prompt], 40, temperature=0, eos_token=eos)[0]
            fast = target.generate(
                [prompt], 40, temperature=0, eos_token=eos, speculate=speculate, draft_tokens=3
            )[0]
            assert torch.equal(fast, plain)
            accepted += len(fast)
    assert accepted > 0
    with pytest.raises(ValueError, match="one prompt"):
        target.generate([prompts[0], prompts[1]], 4, speculate=speculate)


def _chi_square_bound(cells: int) -> float:
    """The chi-square value a correct sampler exceeds with probability 1e-4 (Wilson and
    Hilferty's approximation), for cells - 1 degrees of freedom."""
    df, z = cells - 1, 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing outside the target's support
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("drafts", ["from-q", "deterministic"])
def test_accepted_tokens_keep_the_target_distribution(drafts):
    """Two tokens decoded with 2 drafts a step on a 5-token vocabulary: the joint of the
    first two tokens is the target's p0 x p1 (its second row does not depend on the
    first token here), whatever the draft distribution q."""
    vocab, trials = 5, 12000
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(3, vocab, generator=generator, dtype=torch.float64) * 1.5
    q = torch.softmax(torch.randn(2, vocab, generator=generator, dtype=torch.float64), -1)
    sampling = Sampling(temperature=0.8, top_k=4)
    p = probabilities(target, sampling).double()
    stop = StopRule((), None)
    counts = torch.zeros(vocab, vocab)
    for _ in range(trials):
        if drafts == "from-q":
            draft = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(2)]
            draft_probs = q
        else:  # prompt lookup's: fixed tokens, q one-hot
            draft, draft_probs = [1, 3], None
        choices = accept_draft(
            target, draft, sampling, stop, generated=0, generator=generator, draft_probs=draft_probs
        )
        tokens = [int(c.tokens[0]) for c in choices]
        if len(tokens) == 1:  # the next step samples its own
            tokens.append(int(torch.multinomial(p[1], 1, generator=generator)))
        counts[tokens[0], tokens[1]] += 1
    joint = (p[0].view(-1, 1) * p[1].view(1, -1)).flatten()
    assert _chi_square(counts.flatten(), joint) < _chi_square_bound(int((joint > 0).sum()))


def test_accept_draft_greedy_and_stops():
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0]])
    greedy, stop = Sampling(temperature=0), StopRule((3,), 10)
    assert [int(c.tokens[0]) for c in accept_draft(logits, [1, 2], greedy, stop, generated=0)] == [
        1,
        2,
        0,
    ]
    taken = accept_draft(logits, [1, 0], greedy, stop, generated=0)
    assert [int(c.tokens[0]) for c in taken] == [1, 2]  # the second draft falls
    last = accept_draft(logits, [1, 2], greedy, StopRule((), 2), generated=0)
    assert len(last) == 2 and last[-1].last  # max_tokens ends it inside the drafts
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept_draft(logits, [1], greedy, stop, generated=0)


def test_truncate_gives_rejected_blocks_back():
    cache = PagedKVCache(1, 1, 4, num_blocks=8, block_size=4)
    seq = cache.add_sequence(list(range(6)))
    for new in (6, 7):  # 13 tokens: 4 blocks; the prompt's full block is cached
        (layer,) = cache.batch([seq], new)
        layer.update(torch.zeros(1, 1, new, 4), torch.zeros(1, 1, new, 4))
    assert cache.used_blocks == 4
    cache.truncate(seq, 9)
    assert cache.length(seq) == 9 and cache.used_blocks == 3
    with pytest.raises(ValueError, match="cached prompt tokens"):
        cache.truncate(seq, 3)  # its first block is in the prefix cache
    cache.free(seq)
    assert cache.used_blocks == 0
