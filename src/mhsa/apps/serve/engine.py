"""Continuous batching over a PagedKVCache, as vLLM serves: requests join between
decoding steps and leave when done.

The Engine composes a Scheduler (mhsa.apps.serve.scheduler: which requests run and which
tokens each feeds, no tensors) and a Runner (mhsa.apps.serve.runner: the forward passes and
each next token), and adds what a server needs around them: a lock, the callbacks, a
thread that steps while there is work, and the cache's statistics.

The model runs outside the engine's lock, so submit and cancel return at once from any
thread while a step computes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch
from torch import nn

from ...cache import PagedKVCache
from ...core.checks import int_at_least
from ...models.sampling import Choice, check_sampling, output_tokens
from ...models.speculative import Speculator, check_draft_tokens
from .runner import Runner
from .scheduler import OnToken, Request, Scheduler

__all__ = ["Engine", "Request"]

log = logging.getLogger(__name__)


class Engine:
    """Serves generation requests for one Llama or GPT model (a Decoder) over a
    PagedKVCache of num_blocks blocks of block_size tokens. context_length bounds
    prompt + new tokens; max_batch the requests running at once; prefill_chunk the
    prompt tokens computed per step; admission "reserve" or "optimistic" (preempting
    when blocks run out), max_share the share of the pool one request may hold and
    max_wait the seconds a request that does not fit is passed over by ones that do
    (see mhsa.apps.serve.scheduler); speculator (PromptLookup, DraftModel) drafts up to
    draft_tokens tokens a step for each decoding request, verified in one pass."""

    def __init__(
        self,
        model: nn.Module,
        *,
        context_length: int,
        num_blocks: int,
        block_size: int = 16,
        max_batch: int = 16,
        prefill_chunk: int = 128,
        stop_ids: Sequence[int] = (),
        admission: str = "reserve",
        max_share: float = 1.0,
        max_wait: float = 0.0,
        speculator: Speculator | None = None,
        draft_tokens: int = 4,
    ) -> None:
        for name, value in (
            ("context_length", context_length),
            ("max_batch", max_batch),
            ("prefill_chunk", prefill_chunk),
        ):
            int_at_least(name, value, 1)
        check_draft_tokens(draft_tokens)
        config = model.config
        if context_length > config.max_len:
            raise ValueError(
                f"context_length {context_length} exceeds the model's max_len {config.max_len}"
            )
        self.cache = PagedKVCache.for_layout(
            model.cache_layout, num_blocks=num_blocks, block_size=block_size
        )
        self.model = model.eval()
        self.device = model.cache_layout.device
        self.context_length, self.max_batch = context_length, max_batch
        self.prefill_chunk, self.stop_ids = prefill_chunk, frozenset(stop_ids)
        self.scheduler = Scheduler(
            self.cache,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            admission=admission,
            max_share=max_share,
            max_wait=max_wait,
            lookahead=0 if speculator is None else draft_tokens,
            chunk_multiple=model.prefill_alignment,
        )
        self.runner = Runner(self.model, self.cache, sorted(self.stop_ids), speculator)
        self.speculator, self.draft_tokens = speculator, draft_tokens
        self._lock = threading.Condition()
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._peak = {"used_blocks": 0, "running": 0, "longest_request": 0}
        self._in_step: list[Request] = []  # the requests of the step running now

    # -- requests (any thread) --

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float | None = None,
        seed: int | None = None,
        on_token: OnToken | None = None,
        cache_salt: bytes = b"",
    ) -> Request:
        """Queue a request; raises ValueError (a message fit for an API error) when it
        can never be served. cache_salt: its namespace in the prefix cache (it shares
        cached blocks only with requests of the same salt)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"the prompt holds token ids outside the vocabulary 0..{vocab - 1}")
        int_at_least("max_tokens", max_tokens, 1)
        check_sampling(temperature, None, top_p)
        if len(prompt) + max_tokens > self.context_length:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                f"exceeds the context length {self.context_length}"
            )
        with self._lock:
            request = Request(
                self._next_id, prompt, max_tokens, float(temperature), top_p, on_token
            )
            request.cache_salt = cache_salt
            self.runner.add(request, seed)
            try:
                self.scheduler.add(request)  # (raises when the pool can never hold it)
            except BaseException:
                self.runner.drop(request)
                raise
            self._next_id += 1
            self._lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """End request ("cancelled"); its blocks are freed at the next step."""
        with self._lock:
            self.scheduler.cancel(request)
            self._lock.notify_all()

    @property
    def idle(self) -> bool:
        with self._lock:
            return self.scheduler.idle

    @property
    def queued(self) -> int:
        """Requests waiting to be admitted."""
        with self._lock:
            return len(self.scheduler.waiting)

    # -- one step --

    def step(self) -> bool:
        """One step: the scheduler's plan (cancelled requests end, waiting ones are
        admitted), then the runner's decoding pass and prefill chunks, each pass's
        tokens handed out as it ends. False when there was nothing to do."""
        with self._lock:
            plan = self.scheduler.schedule()
            for request in plan.ended:
                self._ended(request)
            self._in_step = plan.requests
        if plan.empty:
            return False
        with torch.inference_mode():
            for chosen in self.runner.run(plan):
                self._emit(chosen)
        self._note_peaks(self._in_step)
        return True

    def _emit(self, chosen: list[tuple[Request, list[Choice]]]) -> None:
        """Hand out each request's new tokens, and end the requests that stop or reach
        max_tokens; with drafts, those that stood are counted in the pool."""
        now = time.perf_counter()
        for request, choices in chosen:
            if len(choices) > 1:
                with self._lock:
                    self.scheduler.took_drafts(request, len(choices) - 1)
            for token in output_tokens(choices):
                request.output.append(token)
                request.token_times.append(now)
                request.first_token_at = request.first_token_at or now
                _call(request, token)
            reason = choices[-1].finish_reason()  # (the runner's choices end at an end)
            if reason is not None:
                self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        with self._lock:
            if self.scheduler.finish(request, reason):
                self._ended(request)

    def _ended(self, request: Request) -> None:
        """(under the lock) A request ended: forget it and say so."""
        self.runner.drop(request)
        _call(request, None)

    def _note_peaks(self, requests: list[Request]) -> None:
        peak = self._peak
        peak["used_blocks"] = max(peak["used_blocks"], self.cache.used_blocks)
        peak["running"] = max(peak["running"], len(requests))
        longest = max(len(r.prompt) + len(r.output) for r in requests)
        peak["longest_request"] = max(peak["longest_request"], longest)

    def stats(self) -> dict:
        """The cache's size and use: blocks now and at the peak, their bytes, and the
        bytes contiguous caches sized for the longest request so far would take for
        the most requests that ran at once."""
        cache, peak = self.cache, dict(self._peak)
        block_bytes = cache.k.element_size() * (cache.k[0, 0].numel() + cache.v[0, 0].numel())
        block_bytes *= cache.num_layers
        token_bytes = block_bytes // cache.block_size
        with self._lock:
            waiting, running = len(self.scheduler.waiting), len(self.scheduler.running)
        return {
            "num_blocks": cache.num_blocks,
            "block_size": cache.block_size,
            "block_bytes": block_bytes,
            "used_blocks": cache.used_blocks,
            "waiting": waiting,
            "running": running,
            "peak_used_blocks": peak["used_blocks"],
            "peak_running": peak["running"],
            "peak_bytes": peak["used_blocks"] * block_bytes,
            "longest_request": peak["longest_request"],
            "contiguous_bytes": peak["longest_request"] * token_bytes * peak["running"],
        }

    # -- running it --

    def start(self) -> None:
        """Run the steps in a daemon thread (idle, it waits for a request)."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mhsa-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread; waiting and running requests are cancelled."""
        with self._lock:
            self._stopping = True
            for request in [*self.scheduler.running, *self.scheduler.waiting]:
                self.scheduler.cancel(request)
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            for request in self.scheduler.end_cancelled():
                self._ended(request)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and self.scheduler.idle:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a failed step ends its requests, not the server
                log.exception("engine step failed")
                for request in self._in_step:
                    self._finish(request, "error")

    def run(
        self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int]
    ) -> list[list[int]]:
        """Greedy outputs of prompts decoded together (no thread: steps until done)."""
        counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
        requests = [self.submit(p, n) for p, n in zip(prompts, counts, strict=True)]
        while not all(r.done for r in requests):
            if not self.step():
                raise RuntimeError("the engine went idle before its requests finished")
        return [r.output for r in requests]


def _call(request: Request, token: int | None) -> None:
    if request.on_token is None:
        return
    try:
        request.on_token(request, token)
    except Exception:  # a listener's fault must not stop the engine
        log.exception("on_token of request %d failed", request.id)
