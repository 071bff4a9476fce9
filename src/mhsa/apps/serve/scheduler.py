"""The scheduler of continuous batching (vLLM's): each step it decides which requests
run and which tokens each feeds the model. It holds no tensors: the Runner executes
its plans, and the pool it counts blocks in is a PagedKVCache's bookkeeping.

A step has a budget of tokens, as vLLM's chunked prefill does: one token for every
running request that is decoding (never held back), then prefill_chunk tokens of
prefill shared by the running requests that are not decoding yet. The oldest of those
gets an equal share of the prefill budget first (prefill_chunk over their number), so
none waits forever; the rest goes shortest remaining first, so a short prompt admitted
behind a long one is prefilled in the next step while the long one goes on in chunks.
Requests are admitted by fit, at most max_batch at once: in arrival order, a request
that does not fit yet is passed over by later ones that do, until it has waited
max_wait seconds (max_wait 0, the default here, from the start); from then on it holds
a reservation, and a later request passes it only when it fits now and also beside it
and the others that passed it (their blocks at their longest, and a batch slot), so
once the requests that were running when its wait ran out end, it runs (a short
request is not held behind a large one, and a large one waits no longer than max_wait
plus the time those running requests take to end). No request may hold more than
max_share of the pool.
Whether a request fits is one of two rules:

- "reserve" (the default): only when the pool can hold the request's prompt and all
  its new tokens on top of what the running requests may still take, so no running
  request ever finds the pool full (one that does not fit waits; none is dropped);
- "optimistic": when the pool's free blocks hold its context now. A step that needs
  more blocks than are free preempts the newest running request: it gives back its
  blocks and waits at the head of the queue, to be prefilled again from its prompt and
  the tokens it generated (recompute), and then carries on where it stopped.

Cancelled requests end at the next step. Prompts that start alike share the cached
blocks of their common start (the pool's prefix cache).

With chunk_multiple m > 1 (a model whose answer depends on where its prefill calls
start, as MoBA's choice of key blocks does), every prefill chunk but a prompt's last
ends at a multiple of m, a little past the budget where it must; prefixes are shared
only when the pool's blocks are whole multiples of m (a cached start is then aligned).

With lookahead k (speculative decoding) a decoding request's chunk also holds room for
up to k draft tokens (never past its max_tokens); the runner fills them, and
took_drafts(request, n) counts the n that stood (the pool keeps only those).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

ADMISSION = ("reserve", "optimistic")


class BlockPool(Protocol):
    """The block bookkeeping the scheduler reads and changes (PagedKVCache's)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    def add_sequence(self, tokens: Sequence[int], *, salt: bytes = b"") -> int:
        """Register a sequence; its leading blocks cached under salt count in length(id)."""
        ...

    def length(self, seq_id: int) -> int: ...

    def block_table(self, seq_id: int) -> list[int]: ...

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int: ...

    def free(self, seq_id: int) -> None: ...


OnToken = Callable[["Request", "int | None"], None]


@dataclass(eq=False)
class Request:
    """One generation request (Engine.submit makes it). on_token(request, token) is
    called from the engine's thread for every new token, then with None once
    finish_reason is set: "stop" (a stop token, not in output), "length" (max_tokens),
    "cancelled" or "error"."""

    id: int
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    on_token: OnToken | None = None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    cache_salt: bytes = b""  # its prefix cache namespace: it shares blocks only within it
    submitted: float = field(default_factory=time.perf_counter)
    queued_at: float = 0.0  # the scheduler's clock when it was added
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    # the scheduler's state
    seq: int | None = None  # the pool's sequence id while admitted
    computed: int = 0  # tokens of the context (prompt + output) in the pool
    cancelled: bool = False
    worst_blocks: int = 0  # blocks it holds at its longest
    preemptions: int = 0
    passed: bool = False  # admitted past a request that had waited max_wait

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_length(self) -> int:
        """Prompt and output tokens: what the pool holds once the request catches up."""
        return len(self.prompt) + len(self.output)

    @property
    def decoding(self) -> bool:
        """It has generated a token, and that token is all the pool lacks."""
        return bool(self.output) and self.context_length - self.computed == 1

    def context(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop-1 of prompt + output."""
        if stop <= len(self.prompt):
            return self.prompt[start:stop]
        return (self.prompt + self.output)[start:stop]


@dataclass
class Chunk:
    """Tokens of one request fed in a step; samples: they end its context, so the
    last one's logits give its next token."""

    request: Request
    tokens: list[int]
    samples: bool
    lookahead: int = 0  # slots held for draft tokens after them (speculative decoding)


@dataclass
class Plan:
    """One step: a one-token chunk for each decoding request (one forward pass), the
    prefill chunks of other requests (prefill_chunk tokens in all, at most one chunk a
    request; shortest remaining first, so run in this order the first token of a short
    prompt comes before the long ones' chunks are computed), and the requests this
    scheduling ended (cancelled) or preempted."""

    decoding: list[Chunk] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        """The requests that run in this step."""
        return [chunk.request for chunk in self.decoding + self.prefills]

    @property
    def empty(self) -> bool:
        return not self.decoding and not self.prefills


class Scheduler:
    """Decides each step's Plan over a BlockPool (see the module docstring); max_batch
    requests run at once, prefill_chunk tokens of prefill are fed per step; a request
    may hold max_share of the pool's blocks at most, and is passed over by later requests
    that fit for max_wait seconds of clock() at most (then only by those it fits beside)."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_batch: int,
        prefill_chunk: int,
        admission: str = "reserve",
        max_share: float = 1.0,
        max_wait: float = 0.0,
        lookahead: int = 0,
        chunk_multiple: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("max_batch", max_batch),
            ("prefill_chunk", prefill_chunk),
            ("chunk_multiple", chunk_multiple),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
        if isinstance(max_share, bool) or not isinstance(max_share, int | float):
            raise TypeError(f"max_share must be a number in (0, 1], got {max_share!r}")
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1] (a share of the pool), got {max_share}")
        if isinstance(max_wait, bool) or not isinstance(max_wait, int | float) or max_wait < 0:
            raise ValueError(f"max_wait must be a number of seconds >= 0, got {max_wait!r}")
        self.pool, self.max_batch, self.prefill_chunk = pool, max_batch, prefill_chunk
        self.admission, self.max_wait, self.clock = admission, max_wait, clock
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {lookahead!r}")
        self.lookahead, self.chunk_multiple = lookahead, chunk_multiple
        # a cached prefix ends at a block boundary: aligned only if blocks are multiples
        self.share_prefixes = pool.block_size % chunk_multiple == 0
        self._unshared = itertools.count()
        self.max_blocks = max(1, math.floor(max_share * pool.num_blocks))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def worst_blocks(self, tokens: int) -> int:
        """Blocks a request of this many tokens (prompt + max_tokens) holds at its longest."""
        return math.ceil(tokens / self.pool.block_size)

    def add(self, request: Request) -> None:
        """Queue a request (its worst_blocks set); it runs once admitted."""
        request.worst_blocks = self.worst_blocks(len(request.prompt) + request.max_tokens)
        if request.worst_blocks > self.max_blocks:
            share = "" if self.max_blocks == self.pool.num_blocks else " a request may hold"
            raise ValueError(
                f"the request needs {request.worst_blocks} cache blocks, the pool "
                f"has {self.max_blocks}{share}: shorten it (prompt + max_tokens) or serve "
                "with more blocks"
            )
        request.queued_at = self.clock()
        self.waiting.append(request)

    def schedule(self) -> Plan:
        """End cancelled requests, admit waiting ones, and plan the step; preempt the
        newest running requests while the step needs more blocks than are free."""
        plan = Plan(ended=self.end_cancelled())
        self._admit()
        while True:
            decoding = [
                Chunk(r, [r.output[-1]], True, self._lookahead(r))
                for r in self.running
                if r.decoding
            ]
            prefills = self._prefill_chunks()
            chunks = decoding + prefills
            needed = sum(
                self.pool.blocks_needed(c.request.seq, len(c.tokens) + c.lookahead) for c in chunks
            )
            if needed <= self.pool.free_blocks or len(self.running) < 2:
                break
            plan.preempted.append(self.preempt(self.running[-1]))
        plan.decoding, plan.prefills = decoding, prefills
        for chunk in chunks:  # the runner writes them into the pool in this step
            chunk.request.computed += len(chunk.tokens)
        return plan

    def _lookahead(self, request: Request) -> int:
        """Draft slots for a decoding request: lookahead, but no token past max_tokens."""
        return max(0, min(self.lookahead, request.max_tokens - len(request.output) - 1))

    def took_drafts(self, request: Request, count: int) -> None:
        """count draft tokens of request's last chunk stood: they are in the pool."""
        request.computed += count

    def _prefill_chunks(self) -> list[Chunk]:
        """The step's prefill: prefill_chunk tokens shared by the running requests that
        are not decoding. The oldest of them (first queued) takes an equal share first,
        then the rest goes shortest remaining first; chunks shortest remaining first."""
        prefilling = [r for r in self.running if not r.decoding]
        if not prefilling:
            return []
        left = {r: r.context_length - r.computed for r in prefilling}
        order = sorted(prefilling, key=left.__getitem__)  # (stable: admission order)
        budget, share = self.prefill_chunk, dict.fromkeys(prefilling, 0)
        oldest = min(prefilling, key=lambda r: r.queued_at)
        share[oldest] = min(left[oldest], -(-budget // len(prefilling)))
        budget -= share[oldest]
        for request in order:
            take = min(left[request] - share[request], budget)
            share[request] += take
            budget -= take
        return [self._chunk(r, self._aligned(r, share[r])) for r in order if share[r]]

    def _aligned(self, request: Request, count: int) -> int:
        """count, cut back (or, where that leaves nothing, carried on) so that the chunk
        ends at a multiple of chunk_multiple or at the end of the request's context."""
        stop, end, multiple = request.computed + count, request.context_length, self.chunk_multiple
        if stop >= end or stop % multiple == 0:
            return count
        aligned = stop - stop % multiple
        if aligned <= request.computed:
            aligned = min(end, aligned + multiple)
        return aligned - request.computed

    def _chunk(self, request: Request, count: int) -> Chunk:
        """The next count tokens of request's context (it samples if they end it)."""
        stop = request.computed + count
        return Chunk(
            request, request.context(request.computed, stop), stop == request.context_length
        )

    def _admit(self) -> None:
        """Admit by fit in arrival order; one that does not fit is passed over until it
        has waited max_wait, then only by requests that fit beside it (_fits_beside)."""
        now = self.clock()
        overdue = None  # the first waiting request that does not fit and waited max_wait
        for request in list(self.waiting):
            if len(self.running) >= self.max_batch:
                return
            fits = self.pool.free_blocks - self._spoken_for() >= self._blocks_to_admit(request)
            if fits and overdue is not None:
                fits = self._fits_beside(request, overdue)
            if not fits:
                if overdue is None and now - request.queued_at >= self.max_wait:
                    overdue = request  # it has waited long enough: it holds a reservation
                continue  # wait for a running request to end (or to run further)
            self.waiting.remove(request)
            request.passed = overdue is not None
            salt = request.cache_salt  # (a namespace of its own where nothing is shared)
            if not self.share_prefixes:
                salt = b"unshared %d" % next(self._unshared)
            request.seq = self.pool.add_sequence(request.prompt + request.output, salt=salt)
            request.computed = self.pool.length(request.seq)
            if not request.preemptions:
                request.cached_tokens = request.computed
            self.running.append(request)

    def _spoken_for(self) -> int:
        """Free blocks the running requests may take first: all they may still grow by
        ("reserve"), or what their next decoding token takes ("optimistic")."""
        if self.admission == "reserve":
            return sum(
                max(r.worst_blocks - len(self.pool.block_table(r.seq)), 0) for r in self.running
            )
        return sum(
            self.pool.blocks_needed(r.seq, 1 + self._lookahead(r))
            for r in self.running
            if r.decoding
        )

    def _fits_beside(self, request: Request, overdue: Request) -> bool:
        """Whether request may pass overdue (a request that has waited max_wait): only
        if overdue fits beside it and the running requests that passed one, at their
        longest and in the batch, so the blocks and slot it waits for are there once
        the requests running before are gone. Nothing passes a preempted request: once
        back it would be the newest, the next to be preempted."""
        if overdue.preemptions:
            return False
        passed = [r for r in self.running if r.passed]
        blocks = sum(r.worst_blocks for r in passed) + request.worst_blocks
        blocks += self._blocks_to_admit(overdue)
        return blocks <= self.pool.num_blocks and len(passed) + 2 <= self.max_batch

    def _blocks_to_admit(self, request: Request) -> int:
        if self.admission == "reserve":
            return request.worst_blocks
        return self.worst_blocks(request.context_length)

    def preempt(self, request: Request) -> Request:
        """Take a running request off the pool (its blocks given back) to the head of
        the queue; once admitted again it is prefilled from prompt + output."""
        self.running.remove(request)
        self.pool.free(request.seq)
        request.seq, request.computed, request.passed = None, 0, False
        request.queued_at = -math.inf  # it has waited long enough (and none passes it)
        request.preemptions += 1
        self.waiting.appendleft(request)
        return request

    def cancel(self, request: Request) -> None:
        """Mark request to end ("cancelled") at the next schedule."""
        if not request.done:
            request.cancelled = True

    def end_cancelled(self) -> list[Request]:
        """End every cancelled request (running or waiting); returns them."""
        ended = [r for r in [*self.running, *self.waiting] if r.cancelled and not r.done]
        for request in ended:
            self.finish(request, "cancelled")
        return ended

    def finish(self, request: Request, reason: str) -> bool:
        """End request with reason, its blocks given back; False if it had ended."""
        if request.done:
            return False
        if request in self.running:
            self.running.remove(request)
            self.pool.free(request.seq)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.finish_reason = reason
        return True
