"""The model runner of continuous batching: it executes a Scheduler's Plan on a
Decoder (mhsa.models.decoder) over a PagedKVCache and chooses each request's next
token with mhsa.models.sampling.sample_and_stop.

A plan runs as forward passes in its order: every decoding request's newest token
together, then each prefill chunk (of a different request) on its own, shortest
remaining first. After each, the requests whose context the pass completed get a token
(a Choice), handed back before the next pass runs, so a short prompt's first token
does not wait for the long prompts' chunks of the same step.

With a speculator (mhsa.models.speculative: PromptLookup, DraftModel) each decoding
request's chunk also carries up to its lookahead of draft tokens; requests with as many
drafts are verified together in one forward pass over the pool, accept_draft gives the
tokens that stand plus the target's own next one (several Choices), and the pool drops
the rejected drafts' slots (truncate).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from ...cache import PagedKVCache
from ...cache.blocks import PoolExhausted
from ...models.decoder import Decoder
from ...models.sampling import Choice, Sampling, StopRule, accept_draft, sample_and_stop_rows
from ...models.speculative import Speculator
from .scheduler import Chunk, Plan, Request

Chosen = list[tuple[Request, list[Choice]]]  # each request's new tokens of one pass


class Runner:
    """Runs plans for model over cache; stop_ids end a request ("stop")."""

    def __init__(
        self,
        model: Decoder,
        cache: PagedKVCache,
        stop_ids: Sequence[int] = (),
        speculator: Speculator | None = None,
    ) -> None:
        self.model, self.cache, self.speculator = model, cache, speculator
        self.device = model.cache_layout.device
        self.stop_ids = tuple(stop_ids)
        # per request id: how its tokens are chosen, when it stops, its random generator
        self._choosing: dict[int, tuple[Sampling, StopRule, torch.Generator | None]] = {}

    def add(self, request: Request, seed: int | None = None) -> None:
        """Prepare request's sampling: a generator seeded with seed (None: a random
        seed) when it samples at a temperature."""
        generator = None
        if request.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))
        sampling = Sampling(request.temperature, None, request.top_p)
        stop = StopRule(self.stop_ids, request.max_tokens)
        self._choosing[request.id] = (sampling, stop, generator)

    def drop(self, request: Request) -> None:
        """Forget an ended request's sampling state."""
        self._choosing.pop(request.id, None)
        if self.speculator is not None:
            self.speculator.forget(request.id)

    def run(self, plan: Plan) -> Iterator[Chosen]:
        """Execute plan: after each forward pass, the (request, Choices) of each request
        whose context it completed (one Choice each, or more with drafts that stood)."""
        if plan.decoding and self.speculator is not None:
            yield from self._speculate(plan.decoding)
        elif plan.decoding:
            logits = self.step_decoding(plan.decoding)
            yield self._choose([chunk.request for chunk in plan.decoding], logits)
        for chunk in plan.prefills:
            logits = self.prefill(chunk)
            yield self._choose([chunk.request], logits) if chunk.samples else []

    def step_decoding(self, chunks: list[Chunk]) -> Tensor:
        """One token of each request, in one forward pass -> logits (N, V)."""
        tokens = self._tensor([chunk.tokens for chunk in chunks])
        caches = self.cache.batch([chunk.request.seq for chunk in chunks], 1)
        return self.model.step(tokens, caches)

    def prefill(self, chunk: Chunk) -> Tensor:
        """One chunk of one request's context -> logits (1, V) of its last token."""
        caches = self.cache.batch([chunk.request.seq], len(chunk.tokens))
        return self.model.prefill(self._tensor([chunk.tokens]), caches)

    def _speculate(self, chunks: list[Chunk]) -> Iterator[Chosen]:
        """Draft for each decoding request, then verify the requests with equally many
        drafts in one forward pass each."""
        groups: dict[int, list[tuple[Chunk, list[int], Tensor | None]]] = defaultdict(list)
        for chunk in chunks:
            draft, probs = self._draft(chunk)
            groups[len(draft)].append((chunk, draft, probs))
        for count, group in sorted(groups.items()):
            rows = [chunk.tokens + draft for chunk, draft, _ in group]
            seqs = [chunk.request.seq for chunk, _, _ in group]
            logits = self.model.verify(self._tensor(rows), self.cache.batch(seqs, count + 1))
            chosen = []
            for row, (chunk, draft, probs) in enumerate(group):
                request = chunk.request
                sampling, stop, generator = self._choosing[request.id]
                choices = accept_draft(
                    logits[row],
                    draft,
                    sampling,
                    stop,
                    generated=len(request.output),
                    generator=generator,
                    draft_probs=probs,
                )
                rejected = count - min(len(choices) - 1, count)
                if rejected:
                    self.cache.truncate(request.seq, self.cache.length(request.seq) - rejected)
                chosen.append((request, choices))
            yield chosen

    def _draft(self, chunk: Chunk) -> tuple[list[int], Tensor | None]:
        """Up to chunk.lookahead draft tokens for the chunk's request (none when the
        draft model's own pool is full)."""
        if chunk.lookahead < 1:
            return [], None
        request = chunk.request
        sampling, _, generator = self._choosing[request.id]
        context = request.prompt + request.output
        try:
            draft, probs = self.speculator.propose(
                context, chunk.lookahead, sampling, generator, key=request.id
            )
        except PoolExhausted:
            self.speculator.forget(request.id)
            return [], None
        return draft[: chunk.lookahead], None if probs is None else probs[: chunk.lookahead]

    def _choose(self, requests: list[Request], logits: Tensor) -> Chosen:
        """Each request's next token from its row of logits, under its own settings."""
        rules = []
        for request in requests:
            sampling, stop, generator = self._choosing[request.id]
            rules.append((sampling, stop, len(request.output), generator))
        choices = sample_and_stop_rows(logits, rules)
        return [(request, [choice]) for request, choice in zip(requests, choices, strict=True)]

    def _tensor(self, rows: list[list[int]]) -> Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)
