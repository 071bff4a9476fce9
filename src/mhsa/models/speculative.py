"""Speculative decoding, exact: cheap drafts of the next tokens, verified by the target
model in one forward pass over its paged cache, the rejected drafts' slots rolled back.

    PromptLookup(max_ngram=3, min_ngram=2)   drafts: what followed the latest earlier occurrence
                                     of the context's last n-gram (copying tasks)
    DraftModel(small_model)          drafts: a smaller model sharing the tokenizer
    speculative_decode(model, prompt, sampling, stop, speculator, draft_tokens=4)
                                     -> the Choices of one sequence, as plain decoding's

Which drafts stand is mhsa.models.sampling.accept_draft's decision: greedy output is
exactly plain greedy decoding's (the paged attention and the quantised linears give
every row the same numbers whatever else the call holds), and sampled tokens keep the
target's distribution. The server's runner verifies many sequences' drafts at once
(mhsa.apps.serve.runner); speculative_decode runs one sequence through the one decoding
loop (mhsa.models.sampling.token_loop) for generate and chat.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from ..cache import PagedKVCache
from ..core.checks import int_at_least
from .sampling import GREEDY, Choice, Sampling, StopRule, probabilities, token_loop

BLOCK = 16  # tokens per block of the one-sequence pools here
Draft = tuple[list[int], Tensor | None]  # drafted tokens, the (k, V) probabilities of each


class Speculator:
    """Proposes up to k tokens to follow context (prompt + tokens so far) of stream
    `key`; returns them and the (k', V) probabilities each was drawn from (None: chosen
    deterministically). forget(key) ends a stream. A speculator drafts in
    _draft(context (a list), k (>= 1), sampling, generator, key)."""

    def propose(
        self,
        context: Sequence[int],
        k: int,
        sampling: Sampling = GREEDY,
        generator: torch.Generator | None = None,
        key: int = 0,
    ) -> Draft:
        if k < 1:
            return [], None
        return self._draft(list(context), k, sampling, generator, key)

    def forget(self, key: int) -> None:
        """End stream `key` (a speculator that keeps no state per stream has nothing to do)."""


class PromptLookup(Speculator):
    """Prompt lookup decoding: the tokens that followed the most recent earlier
    occurrence of the context's last n tokens (n from max_ngram down to min_ngram),
    up to k of them. Free: it runs no model, and drafts well where the answer copies
    its input (rewriting, editing, quoting code). min_ngram 2: a match of one token
    (a comma, "the") drafts in free text too, and its drafts mostly fall (measured on
    SmolLM2: 0.89x plain decoding's tokens/s on free-form chat with 1, 1.02x with 2)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def _draft(self, context: list[int], k: int, *_: object) -> Draft:
        end = len(context)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            tail = context[end - n :]
            for start in range(end - n - 1, -1, -1):  # the latest occurrence first
                if context[start : start + n] == tail:
                    draft = context[start + n : start + n + k]
                    if draft:
                        return draft, None
        return [], None


class DraftModel(Speculator):
    """Drafts from a smaller decoder (GPT or Llama) with the target's vocabulary: it
    follows each stream in its own paged pool of num_blocks blocks of 16 tokens,
    catches up on the tokens the target took, and drops the drafts it rejected; a
    stream the pool has no room for gets no drafts (plain decoding's tokens). Greedy
    requests get its argmax tokens; sampled ones a draw from its distribution
    (returned as q)."""

    def __init__(self, model: nn.Module, num_blocks: int = 256) -> None:
        self.model = model.eval()
        self.pool = PagedKVCache.for_layout(
            model.cache_layout, num_blocks=num_blocks, block_size=BLOCK
        )
        self.device = model.cache_layout.device
        self._streams: dict[int, tuple[int, list[int]]] = {}  # key -> (sequence, fed tokens)
        # one pool: generate() calls in threads draft in turn (reentrant: a call's
        # generator finalised by the collector inside a draft forgets its stream)
        self._lock = threading.RLock()

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def _draft(
        self,
        context: list[int],
        k: int,
        sampling: Sampling,
        generator: torch.Generator | None,
        key: int,
    ) -> Draft:
        with self._lock:
            if key not in self._streams:  # (a prefix another stream left may be cached)
                seq = self.pool.add_sequence(context)
                self._streams[key] = (seq, context[: self.pool.length(seq)])  # (forget frees it)
            else:  # keep what the target took of the last drafts, drop the rest
                seq, fed = self._streams[key]
                held = min(_common_prefix(fed, context), len(context) - 1)
                self.pool.truncate(seq, held)
            common = self.pool.length(seq)
            new = context[common:]
            if self.pool.blocks_needed(seq, len(new) + k - 1) > self.pool.free_blocks:
                # the pool cannot hold this stream's drafts (a context past its num_blocks x
                # 16 tokens, or many streams): no draft, and decoding goes on without one
                self._streams[key] = (seq, context[:common])
                return [], None
            logits = self.model.prefill(self._tensor(new), self.pool.batch([seq], len(new)))
            draft, rows = [], []
            for i in range(k):
                if sampling.temperature == 0:
                    token = int(logits[0].argmax())
                else:
                    q = probabilities(logits[0], sampling)
                    token = int(torch.multinomial(q, 1, generator=generator))
                    rows.append(q)
                draft.append(token)
                if i + 1 < k:
                    logits = self.model.step(self._tensor([token]), self.pool.batch([seq], 1))
            self._streams[key] = (seq, context + draft[:-1])
            return draft, (torch.stack(rows) if rows else None)

    def forget(self, key: int) -> None:
        with self._lock:
            stream = self._streams.pop(key, None)
            if stream is not None:
                self.pool.free(stream[0])

    def _tensor(self, tokens: list[int]) -> Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.device)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_draft_tokens(draft_tokens: int) -> None:
    int_at_least("draft_tokens", draft_tokens, 1)


def check_draft_model(draft: nn.Module, target: nn.Module) -> None:
    """A draft model must share the target's vocabulary (its tokenizer)."""
    got, want = draft.config.vocab_size, target.config.vocab_size
    if got != want:
        raise ValueError(
            f"the draft model's vocabulary ({got} tokens) is not the target's ({want}): "
            "a draft model must share the target's tokenizer"
        )


@torch.inference_mode()
def speculative_decode(
    model: nn.Module,
    prompt: Sequence[int],
    sampling: Sampling,
    stop: StopRule,
    speculator: Speculator | None,
    *,
    draft_tokens: int = 4,
    generator: torch.Generator | None = None,
) -> Iterator[Choice]:
    """One sequence's Choices (one token each, from mhsa.models.sampling.token_loop),
    ending with one that stops or is the max_tokens-th: each step the cache drops the
    drafts that fell, the speculator drafts up to draft_tokens tokens, the target (a GPT
    or Llama) computes the last token and the drafts in one forward pass over a paged
    cache, and accept_draft keeps what stands and adds the target's own next token.
    speculator None:
    plain decoding over the same paged cache (so the same numbers as with drafts, and
    as `mhsa serve`)."""
    check_draft_tokens(draft_tokens)
    if stop.max_tokens is None:
        raise ValueError("speculative decoding needs a StopRule with max_tokens")
    layout = model.cache_layout
    total = len(prompt) + stop.max_tokens  # (drafts never reach past max_tokens)
    cache = PagedKVCache.for_layout(
        layout, num_blocks=math.ceil(total / BLOCK) + 1, block_size=BLOCK
    )
    context = [int(t) for t in prompt]
    key = id(cache)  # this call's stream (calls in other threads share the speculator)
    seq = cache.add_sequence(context)
    tokens = torch.tensor([context], dtype=torch.long, device=layout.device)
    logits = model.prefill(tokens, cache.batch([seq], len(context)))

    def verify(taken: list[Choice], generated: int) -> tuple[Tensor, list[int], Tensor | None]:
        """The last token and the drafts after the tokens taken, in one pass."""
        context.extend(int(choice.tokens[0]) for choice in taken)
        cache.truncate(seq, len(context) - 1)  # drop the drafts that fell
        room = stop.max_tokens - generated - 1  # drafts beyond it could not be used
        draft, q = [], None
        if speculator is not None and room > 0:
            draft, q = speculator.propose(
                context, min(draft_tokens, room), sampling, generator, key
            )
        feed = torch.tensor([context[-1:] + draft], dtype=torch.long, device=layout.device)
        return model.verify(feed, cache.batch([seq], feed.shape[1]))[0], draft, q

    try:
        yield from token_loop(logits, sampling, stop, verify=verify, generator=generator)
    finally:
        if speculator is not None:
            speculator.forget(key)
