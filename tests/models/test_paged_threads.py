"""Two engines decoding at once, each in its own thread over its own PagedKVCache, give
the tokens each gives alone: a decoding step's checks and plans travel in the step
(mhsa.PagedStep), never in state that another engine's calls could overwrite."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from mhsa.cache import PagedKVCache
from mhsa.models.gpt import GPT, GPTConfig
from mhsa.models.llama import Llama, LlamaConfig
from mhsa.models.sampling import GREEDY, StopRule, sample_and_stop
from mhsa.models.speculative import speculative_decode

NEW_TOKENS = 24


def _models():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=97, n_layer=3, n_head=4, d_model=32, window=6))
    llama = Llama(
        LlamaConfig(
            vocab_size=97,
            n_layer=4,
            n_head=6,
            n_kv_head=2,
            d_model=48,
            d_ff=64,
            sliding_window=5,
            window_layers=(0, 2),  # windowed and global layers, as Gemma alternates them
        )
    )
    return gpt.eval(), llama.eval()


@torch.no_grad()
def _batched(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy decoding of several prompts together over a PagedKVCache, one step for
    all of them at a time (as `mhsa serve` runs them)."""
    cache = PagedKVCache.for_layout(model.cache_layout, num_blocks=64, block_size=4)
    seqs = [cache.add_sequence(prompt) for prompt in prompts]
    stop = StopRule((), NEW_TOKENS)
    last = []
    for seq, prompt in zip(seqs, prompts, strict=True):  # prompts of different lengths
        logits = model.prefill(torch.tensor([prompt]), cache.batch([seq], len(prompt)))
        last.append(logits.reshape(-1, logits.shape[-1])[-1])
    logits, outputs = torch.stack(last), [[] for _ in prompts]
    for count in range(NEW_TOKENS):
        choice = sample_and_stop(logits, GREEDY, stop, generated=count)
        for output, token in zip(outputs, choice.tokens.tolist(), strict=True):
            output.append(token)
        if choice.last:
            return outputs
        logits = model.step(choice.tokens.view(-1, 1), cache.batch(seqs, 1))
    return outputs


@torch.no_grad()
def _speculative(model, prompt: list[int]) -> list[list[int]]:
    """One sequence through speculative_decode's paged loop (plain decoding: no drafts)."""
    choices = speculative_decode(model, prompt, GREEDY, StopRule((), NEW_TOKENS), None)
    return [[int(choice.tokens[0]) for choice in choices]]


@pytest.mark.parametrize("threads", [1, 2])
def test_two_engines_decoding_at_once_give_the_tokens_each_gives_alone(threads):
    gpt, llama = _models()
    prompts = [[5, 8, 13, 2, 40, 9, 11], [3, 1, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
    jobs = {
        "gpt": lambda: _batched(gpt, prompts),
        "llama batched": lambda: _batched(llama, prompts[1:]),
        "llama alone": lambda: _speculative(llama, prompts[0] * 2),
    }
    alone = {name: job() for name, job in jobs.items()}
    assert all(len(tokens) == NEW_TOKENS for out in alone.values() for tokens in out)
    before_threads, before_interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(threads)
    sys.setswitchinterval(1e-6)  # threads switch between layers, mid-call
    try:
        for _ in range(3):
            together, failures = {}, []

            def run(name, job, together=together, failures=failures):
                try:
                    together[name] = job()
                except Exception as error:  # (reported below, with the thread's name)
                    failures.append(f"{name}: {error!r}")

            workers = [threading.Thread(target=run, args=item) for item in jobs.items()]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            assert failures == []
            assert together == alone
    finally:
        torch.set_num_threads(before_threads)
        sys.setswitchinterval(before_interval)
