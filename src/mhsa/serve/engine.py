"""Continuous batching over a PagedKVCache: requests join between decoding steps and
leave when done, as vLLM schedules them.

Each step runs one forward pass for every running sequence's next token (decode) and
at most one chunk of one waiting prompt (prefill), so a long prompt is prefilled a
chunk per step while the others keep decoding. A request is admitted only when the
pool can hold its prompt and all its new tokens on top of what the running requests
may still take, so no running request ever finds the pool full: one that does not fit
waits (first come, first served), none is dropped. Prompts that start alike share the
cached blocks of their common start (PagedKVCache's prefix cache).

The model runs outside the engine's lock, so submit and cancel return at once from any
thread while a step computes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..cache import PagedKVCache
from ..models.decoding import check_sampling, sample

log = logging.getLogger(__name__)

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
    generator: torch.Generator | None = None
    on_token: OnToken | None = None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    # scheduler state
    seq: int | None = None  # the cache's sequence id once admitted
    prefilled: int = 0  # prompt tokens in the cache
    next_token: int | None = None  # sampled, to be fed by the next decoding step
    cancelled: bool = False
    worst_blocks: int = 0  # blocks it holds at its longest

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Serves generation requests for one Llama or GPT model over a PagedKVCache of
    num_blocks blocks of block_size tokens. context_length bounds prompt + new tokens;
    max_batch the requests running at once; prefill_chunk the prompt tokens computed
    per step."""

    def __init__(self, model: nn.Module, *, context_length: int, num_blocks: int,
                 block_size: int = 16, max_batch: int = 16, prefill_chunk: int = 128,
                 stop_ids: Sequence[int] = ()) -> None:  # fmt: skip
        for name, value in (("context_length", context_length), ("max_batch", max_batch),
                            ("prefill_chunk", prefill_chunk)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        config = model.config
        if context_length > config.max_len:
            raise ValueError(f"context_length {context_length} exceeds the model's max_len "
                             f"{config.max_len}")  # fmt: skip
        weight = next(p for p in model.parameters() if p.is_floating_point())
        head_dim = getattr(config, "head_width", None) or config.d_model // config.n_head
        self.cache = PagedKVCache(len(model.layers if hasattr(model, "layers") else model.blocks),
                                  config.n_kv_head or config.n_head, head_dim,
                                  num_blocks=num_blocks, block_size=block_size,
                                  dtype=weight.dtype, device=weight.device)  # fmt: skip
        self.model = model.eval()
        self.device = weight.device
        self.context_length, self.max_batch = context_length, max_batch
        self.prefill_chunk, self.stop_ids = prefill_chunk, frozenset(stop_ids)
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._peak = {"used_blocks": 0, "running": 0, "longest_request": 0}
        self._in_step: list[Request] = []  # the requests of the step running now

    # -- requests (any thread) --

    def submit(self, prompt: Sequence[int], max_tokens: int, *, temperature: float = 0.0,
               top_p: float | None = None, seed: int | None = None,
               on_token: OnToken | None = None) -> Request:  # fmt: skip
        """Queue a request; raises ValueError (a message fit for an API error) when it
        can never be served."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"the prompt holds token ids outside the vocabulary 0..{vocab - 1}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        check_sampling(temperature, None, top_p)
        if len(prompt) + max_tokens > self.context_length:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                             f"exceeds the context length {self.context_length}")  # fmt: skip
        worst = math.ceil((len(prompt) + max_tokens) / self.cache.block_size)
        if worst > self.cache.num_blocks:
            raise ValueError(f"the request needs {worst} cache blocks, the pool has "
                             f"{self.cache.num_blocks}: shorten it or serve with more "
                             "blocks")  # fmt: skip
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))
        with self._lock:
            request = Request(self._next_id, prompt, max_tokens, float(temperature), top_p,
                              generator, on_token, worst_blocks=worst)  # fmt: skip
            self._next_id += 1
            self._waiting.append(request)
            self._lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """End request ("cancelled"); its blocks are freed at the next step."""
        with self._lock:
            if not request.done:
                request.cancelled = True
                self._lock.notify_all()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._running

    # -- the scheduler --

    def step(self) -> bool:
        """One scheduling step: end cancelled requests, admit waiting ones, then one
        decoding pass and one prefill chunk. False when there was nothing to do."""
        with self._lock:
            self._end_cancelled()
            self._admit()
            decoding = [r for r in self._running if r.next_token is not None]
            prefilling = next((r for r in self._running if r.prefilled < len(r.prompt)), None)
            self._in_step = decoding + [prefilling] * (prefilling is not None)
        if not decoding and prefilling is None:
            return False
        with torch.inference_mode():
            if decoding:
                self._decode(decoding)
            if prefilling is not None:
                self._prefill(prefilling)
        self._note_peaks(self._in_step)
        return True

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
            waiting, running = len(self._waiting), len(self._running)
        return {"num_blocks": cache.num_blocks, "block_size": cache.block_size,
                "block_bytes": block_bytes, "used_blocks": cache.used_blocks,
                "waiting": waiting, "running": running,
                "peak_used_blocks": peak["used_blocks"], "peak_running": peak["running"],
                "peak_bytes": peak["used_blocks"] * block_bytes,
                "longest_request": peak["longest_request"],
                "contiguous_bytes": peak["longest_request"] * token_bytes
                * peak["running"]}  # fmt: skip

    def _end_cancelled(self) -> None:
        for request in [r for r in self._running if r.cancelled]:
            self._finish(request, "cancelled")
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            self._finish(request, "cancelled")

    def _outstanding(self) -> int:
        """Blocks the running requests may still allocate."""
        return sum(max(r.worst_blocks - len(self.cache.block_table(r.seq)), 0)
                   for r in self._running)  # fmt: skip

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            request = self._waiting[0]
            if self.cache.free_blocks - self._outstanding() < request.worst_blocks:
                return  # the pool is spoken for: wait for a running request to end
            self._waiting.popleft()
            request.seq = self.cache.add_sequence(request.prompt)
            request.prefilled = request.cached_tokens = self.cache.length(request.seq)
            self._running.append(request)

    def _prefill(self, request: Request) -> None:
        """One chunk of request's prompt; its first token once the prompt is in."""
        chunk = request.prompt[request.prefilled : request.prefilled + self.prefill_chunk]
        caches = self.cache.batch([request.seq], len(chunk))
        logits = self.model(self._tensor([chunk]), caches=caches, last=True)[:, -1]
        request.prefilled += len(chunk)
        if request.prefilled == len(request.prompt):
            self._emit([request], logits)

    def _decode(self, requests: list[Request]) -> None:
        """Each request's next token, all in one forward pass."""
        tokens = self._tensor([[r.next_token] for r in requests])
        caches = self.cache.batch([r.seq for r in requests], 1)
        self._emit(requests, self.model(tokens, caches=caches, last=True)[:, -1])

    def _emit(self, requests: list[Request], logits: Tensor) -> None:
        """Sample each request's token from its logits row (N, V), hand it out, and end
        the requests that stop or reach max_tokens."""
        greedy = logits.argmax(dim=-1).tolist()
        now = time.perf_counter()
        for i, request in enumerate(requests):
            token = greedy[i]
            if request.temperature > 0:
                token = int(sample(logits[i : i + 1].float(), temperature=request.temperature,
                                   top_p=request.top_p, generator=request.generator))  # fmt: skip
            if token in self.stop_ids:
                request.next_token = None
                with self._lock:
                    self._finish(request, "stop")
                continue
            request.output.append(token)
            request.token_times.append(now)
            request.first_token_at = request.first_token_at or now
            request.next_token = token
            _call(request, token)
            if len(request.output) == request.max_tokens:
                request.next_token = None
                with self._lock:
                    self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        """(under the lock) End request: free its blocks and say so."""
        if request.done:
            return
        if request in self._running:
            self._running.remove(request)
            self.cache.free(request.seq)
        request.finish_reason, request.next_token = reason, None
        _call(request, None)

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
            for request in [*self._running, *self._waiting]:
                request.cancelled = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._end_cancelled()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self._running:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a failed step ends its requests, not the server
                log.exception("engine step failed")
                with self._lock:
                    for request in self._in_step:
                        self._finish(request, "error")

    def run(self, prompts: Sequence[Sequence[int]],
            max_tokens: int | Sequence[int]) -> list[list[int]]:  # fmt: skip
        """Greedy outputs of prompts decoded together (no thread: steps until done)."""
        counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
        requests = [self.submit(p, n) for p, n in zip(prompts, counts, strict=True)]
        while not all(r.done for r in requests):
            if not self.step():
                raise RuntimeError("the engine went idle before its requests finished")
        return [r.output for r in requests]

    def _tensor(self, rows: list[list[int]]) -> Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)


def _call(request: Request, token: int | None) -> None:
    if request.on_token is None:
        return
    try:
        request.on_token(request, token)
    except Exception:  # a listener's fault must not stop the engine
        log.exception("on_token of request %d failed", request.id)
