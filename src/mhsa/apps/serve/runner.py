"""The model runner of continuous batching: it executes a Scheduler's Plan on a
Decoder (mhsa.models.decoder) over a PagedKVCache and chooses each request's next
token with mhsa.models.sampling.sample_and_stop.

A plan runs as two forward passes: every decoding request's newest token together,
then the prefill chunk. After each, the requests whose context the pass completed get
a token (a Choice), handed back before the next pass runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from ...cache import PagedKVCache
from ...models.decoder import Decoder
from ...models.sampling import Choice, Sampling, StopRule, sample_and_stop
from .scheduler import Chunk, Plan, Request


class Runner:
    """Runs plans for model over cache; stop_ids end a request ("stop")."""

    def __init__(self, model: Decoder, cache: PagedKVCache, stop_ids: Sequence[int] = ()) -> None:
        self.model, self.cache = model, cache
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

    def run(self, plan: Plan) -> Iterator[list[tuple[Request, Choice]]]:
        """Execute plan: after each forward pass, the (request, Choice) of each request
        whose context it completed."""
        if plan.decode:
            logits = self.decode(plan.decode)
            yield self._choose([chunk.request for chunk in plan.decode], logits)
        if plan.prefill is not None:
            logits = self.prefill(plan.prefill)
            yield self._choose([plan.prefill.request], logits) if plan.prefill.samples else []

    def decode(self, chunks: list[Chunk]) -> Tensor:
        """One token of each request, in one forward pass -> logits (N, V)."""
        tokens = self._tensor([chunk.tokens for chunk in chunks])
        caches = self.cache.batch([chunk.request.seq for chunk in chunks], 1)
        return self.model.step(tokens, caches)

    def prefill(self, chunk: Chunk) -> Tensor:
        """One chunk of one request's context -> logits (1, V) of its last token."""
        caches = self.cache.batch([chunk.request.seq], len(chunk.tokens))
        return self.model.prefill(self._tensor([chunk.tokens]), caches)

    def _choose(self, requests: list[Request], logits: Tensor) -> list[tuple[Request, Choice]]:
        chosen = []
        for row, request in enumerate(requests):
            sampling, stop, generator = self._choosing[request.id]
            choice = sample_and_stop(
                logits[row : row + 1],
                sampling,
                stop,
                generated=len(request.output),
                generator=generator,
            )
            chosen.append((request, choice))
        return chosen

    def _tensor(self, rows: list[list[int]]) -> Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)
