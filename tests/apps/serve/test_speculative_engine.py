"""Speculative decoding in the continuous-batching engine (tiny float64 models): greedy
outputs with prompt lookup or a draft model equal plain decoding's for requests that
join and leave, prefill in chunks, stop at stop tokens and run out of max_tokens; the
rejected drafts' blocks go back (the pool ends empty); sampled requests run and end."""

from __future__ import annotations

import pytest
import torch

from mhsa.apps.serve import Engine
from mhsa.models.gpt import GPT, GPTConfig
from mhsa.models.llama import Llama, LlamaConfig
from mhsa.models.speculative import DraftModel, PromptLookup

VOCAB = 64


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llama(width: int = 32, layers: int = 2, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        n_layer=layers,
        n_head=4,
        n_kv_head=2,
        d_model=width,
        d_ff=48,
        max_len=512,
    )
    return Llama(config).double().eval()


def _gpt(width: int = 32, layers: int = 2, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, max_len=512, d_model=width, n_head=4, n_layer=layers))


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    phrase = torch.randint(0, VOCAB, (6,), generator=generator).tolist()
    free = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (3, 40, 17)]
    return [phrase * 5, free[0], phrase * 2 + free[1], free[2], phrase * 8]


def _engine(model, **options) -> Engine:
    return Engine(
        model,
        context_length=512,
        num_blocks=96,
        block_size=16,
        max_batch=3,
        prefill_chunk=16,
        **options,
    )


@pytest.mark.parametrize("build", [_llama, _gpt], ids=["llama", "gpt"])
@pytest.mark.parametrize("kind", ["prompt-lookup", "draft"])
def test_greedy_outputs_equal_plain_decoding(build, kind):
    model = build().double().eval()
    speculator = PromptLookup() if kind == "prompt-lookup" else DraftModel(build(16, 1, 1).double())
    prompts, counts = _prompts(), [30, 7, 25, 1, 40]
    plain = _engine(model).run(prompts, counts)
    engine = _engine(model, speculator=speculator, draft_tokens=3)
    fast = engine.run(prompts, counts)
    assert fast == plain
    assert engine.cache.used_blocks == 0
    # with a stop token: each output ends before the first of it, as plain decoding's
    stop = plain[0][5]
    plain = _engine(model, stop_ids=[stop]).run(prompts, counts)
    fast = _engine(model, stop_ids=[stop], speculator=speculator, draft_tokens=3).run(
        prompts, counts
    )
    assert fast == plain and any(len(p) < n for p, n in zip(plain, counts, strict=True))


def test_prompt_lookup_takes_fewer_steps_on_a_copying_prompt():
    model = _gpt().double().eval()
    prompt = _prompts()[4]  # a phrase 8 times: a tiny model continues the pattern
    steps = {}
    for name, options in (("plain", {}), ("lookup", {"speculator": PromptLookup()})):
        engine = _engine(model, **options)
        request = engine.submit(prompt, 40)
        count = 0
        while not request.done:
            engine.step()
            count += 1
        steps[name] = count
    assert steps["lookup"] < steps["plain"], steps


def test_sampled_requests_with_drafts_run_to_their_end():
    model = _llama()
    engine = _engine(model, speculator=DraftModel(_llama(16, 1, 1)), draft_tokens=4)
    requests = [
        engine.submit(p, 20, temperature=0.9, top_p=0.95, seed=i) for i, p in enumerate(_prompts())
    ]
    while not all(r.done for r in requests):
        engine.step()
    assert all(len(r.output) == 20 and r.finish_reason == "length" for r in requests)
    assert all(0 <= t < VOCAB for r in requests for t in r.output)
    assert engine.cache.used_blocks == 0
    with pytest.raises(ValueError, match="draft_tokens"):
        _engine(model, speculator=PromptLookup(), draft_tokens=0)


def test_a_draft_model_whose_pool_is_full_drafts_nothing_and_the_answers_stand():
    model = _gpt().double().eval()
    small = DraftModel(_gpt(16, 1, 1).double(), num_blocks=3)  # 48 tokens: one short prompt
    prompts, counts = _prompts(), [30, 7, 25, 1, 40]
    plain = _engine(model).run(prompts, counts)
    engine = _engine(model, speculator=small, draft_tokens=3)
    assert engine.run(prompts, counts) == plain
    assert engine.cache.used_blocks == 0 and small.pool.used_blocks == 0
