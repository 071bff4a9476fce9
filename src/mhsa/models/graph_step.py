"""Decoding with every shape fixed, replayed from a CUDA graph: at batch 1 on a GPU a
decoding step is bound by Python and kernel launches, not by the GPU (issue 45).

    StaticDecodeStep(model, caches, compile=, capture=)   token (B, 1) -> logits (B, V)
    graph_lease(model, batch, length, cuda_graph)         generate's captured step and
                                                          the caches it continues, kept
                                                          on the model between calls

The step continues prefilled KVCaches through StaticKVCaches (mhsa.cache), which share
their storage: every step attends over all max_len slots, those not yet written masked
by the cache's length, which lives in a device tensor (`filled`), as the token does
(`StaticDecodeStep.token`); the positions come from it. Nothing in the step changes
shape, reads a value back to the host or allocates outside the graph's pool, so one
capture serves every step, and a step is one graph launch.

Capturing needs the compiled step: the eager one checks values on the host (token ids,
rows with no key), which a capture forbids, and torch.compile (fullgraph) leaves those
checks out. On the CPU the same step runs uncaptured, eagerly or compiled, and gives
the tokens of plain decoding (tests/models/test_graph_step.py).
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..cache import KVCache, StaticKVCache
from ..core.scores import ScoreFunction, composed, sees_query_position
from ..nn.positional import AttentionPosition
from .compiled_step import compiled_once, decode_step, static_caches, step_memo

__all__ = [
    "SLOT_BUCKET",
    "GraphLease",
    "StaticDecodeStep",
    "fixed_slots_problem",
    "graph_lease",
    "static_step_problem",
]

# generate's captured caches hold a multiple of this many slots, so that prompts and
# lengths that differ a little share one capture
SLOT_BUCKET = 256


def fixed_slots_problem(caches: object) -> str | None:
    """Why `caches` cannot be continued by a StaticDecodeStep, or None: it needs one
    plain KVCache per layer (fixed slots; a sliding window's ring buffer has none), all
    of one batch, max_len and length."""
    if not isinstance(caches, (list, tuple)) or not caches:
        return f"caches must be a non-empty list of KVCaches, got {type(caches).__name__}"
    refused = next(filter(None, map(StaticKVCache.cannot_continue, caches)), None)
    if refused is not None:
        return refused
    shapes = {(cache.k.shape[0], cache.max_len, cache.length) for cache in caches}
    if len(shapes) > 1:
        return f"the caches differ in (batch, max_len, length): {sorted(shapes)}"
    return None


def static_step_problem(model: nn.Module, caches: object) -> str | None:
    """Why model's decoding step cannot run over StaticKVCaches continuing `caches`, or
    None: the one a module declares in `static_cache_problem` (MoBA, Llama 4's
    chunks), the caches' fixed_slots_problem, or a score function that would see
    the query after all the static slots (checked before anything is compiled)."""
    declared = (getattr(module, "static_cache_problem", None) for module in model.modules())
    return (
        next(filter(None, declared), None)
        or fixed_slots_problem(caches)
        or _placed_score_problem(model)
    )


def _placed_score_problem(model: nn.Module) -> str | None:
    """A score function whose row softmax depends on where the query sits among the
    keys (T5's buckets; ALiBi then Softcap): a static cache places it after all its
    slots. Each position's score is checked followed by each attention's own."""
    modules = list(model.modules())
    positions = [m.score() for m in modules if isinstance(m, AttentionPosition)]
    owns = [m.score for m in modules if isinstance(getattr(m, "score", None), ScoreFunction)]
    for first, then in itertools.product([*positions, None], [*owns, None]):
        score = composed(first, then)  # (as AttentionModule._score composes them)
        if score is not None and sees_query_position(score):
            return f"{score!r} would see the query after all the static slots"
    return None


class StaticDecodeStep:
    """token (B, 1) -> logits (B, V): one decoding step for the B sequences of `caches`
    (one prefilled KVCache per layer), model.step over StaticKVCaches sharing their
    storage, every shape fixed. Each call writes the token's keys at the next slot.

    compile: model.step through torch.compile (made once per model, shared with
    generate(compile=True)). capture: the compiled step recorded once in a CUDA graph
    (needs compile and a CUDA device; `warmup` compiled calls first) and replayed per
    call. Captured, the logits returned are the graph's own buffer: read them before
    the next call. A call once every slot is written raises ValueError. Inference only
    (no gradients)."""

    @torch.no_grad()
    def __init__(
        self,
        model: nn.Module,
        caches: Sequence[KVCache],
        *,
        compile: bool = False,
        capture: bool = False,
        warmup: int = 2,
    ) -> None:
        problem = static_step_problem(model, caches)
        if problem is not None:
            raise ValueError(f"StaticDecodeStep: {problem}")
        device = caches[0].k.device
        if capture and not compile:
            raise ValueError(
                "capture=True records the compiled step (the eager one reads values back "
                "to the host, which a CUDA graph forbids): pass compile=True"
            )
        if capture and device.type != "cuda":
            raise ValueError(f"capture=True needs caches on a CUDA device, got {device}")
        self.caches = list(caches)
        self.static = static_caches(caches) if compile else [StaticKVCache(c) for c in caches]
        self.token = torch.zeros(caches[0].k.shape[0], 1, dtype=torch.long, device=device)
        self.slots, self.written = caches[0].max_len, caches[0].length
        held = weakref.ref(model)  # the step is kept per model: no reference back to it
        if compile:
            self._function = compiled_once(
                model, decode_step, lambda token: (held(), token, self.static)
            )
        else:
            self._function = lambda token: held().step(token, self.static)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # the captured step's output buffer
        if capture:
            self._capture(warmup)

    def _capture(self, warmup: int) -> None:
        """Run the step `warmup` times (compiling it) on a side stream, rewind the
        caches, then record it in a CUDA graph (recording runs nothing)."""
        warmup = min(warmup, self.slots - self.written)  # (each writes one slot ahead)
        if warmup < 1:
            raise ValueError(self._full())
        stream = torch.cuda.Stream(device=self.token.device)
        stream.wait_stream(torch.cuda.current_stream(self.token.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self._function(self.token)
        torch.cuda.current_stream(self.token.device).wait_stream(stream)
        self._rewind()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._function(self.token)
        self.graph = graph

    def _rewind(self) -> None:
        """The step's length buffers back to the host's count of written slots."""
        for static in self.static:
            static.filled.fill_(self.written)

    def _full(self) -> str:
        return (
            f"the static cache is full: {self.written} of {self.slots} slots written; "
            "allocate the caches for the prompt plus every new token"
        )

    @torch.no_grad()
    def restart(self) -> None:
        """Continue the same caches again, reset and prefilled anew (generate reuses a
        capture): their length and padding copied into the step's buffers."""
        problem = fixed_slots_problem(self.caches)
        if problem is not None:
            raise ValueError(f"StaticDecodeStep.restart: {problem}")
        for cache, static in zip(self.caches, self.static, strict=True):
            if cache.k is not static.k or cache.v is not static.v:
                raise ValueError(
                    "the caches' storage changed since the step was made (reorder?): "
                    "make a new StaticDecodeStep"
                )
            static.start.copy_(cache.start)
        self.written = self.caches[0].length
        self._rewind()

    @torch.no_grad()
    def __call__(self, token: Tensor) -> Tensor:
        """token (B, 1) token ids, each sequence's newest -> logits (B, V)."""
        if self.written >= self.slots:
            raise ValueError(self._full())
        if tuple(token.shape) != tuple(self.token.shape):
            raise ValueError(
                f"token must be (batch, 1) = {tuple(self.token.shape)}, got {tuple(token.shape)}"
            )
        self.token.copy_(token)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._function(self.token)
        self.written += 1
        return logits


class GraphLease:
    """One generate call's hold on a model's captured step and the caches it continues
    (kept in the model's StepMemo, so the next call of the same shape replays the same graph): take
    `caches`, prefill them, then `begin()` for the step; `release()` when done.
    compile, capture: StaticDecodeStep's (both off: the step generate's tests run on
    the CPU)."""

    def __init__(
        self,
        model: nn.Module,
        key: tuple,
        caches: list[KVCache],
        *,
        compile: bool = True,
        capture: bool = True,
    ) -> None:
        self._model = weakref.ref(model)
        self.key, self.caches = key, caches
        self.options = {"compile": compile, "capture": capture}
        self.step: StaticDecodeStep | None = None
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Hold the lease unless another call holds it."""
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        if self._lock.locked():
            self._lock.release()

    def begin(self, strict: bool) -> StaticDecodeStep | None:
        """The captured step continuing the prefilled caches: captured on first use,
        restarted after. Where that fails: raise if strict, else warn, remember the
        failure (generate does not try the model again) and return None."""
        model = self._model()
        try:
            if self.step is None:
                self.step = StaticDecodeStep(model, self.caches, **self.options)
            else:
                self.step.restart()
            return self.step
        except Exception as error:
            if strict:
                raise
            memo = step_memo(model)
            memo.refused = reason = f"{type(error).__name__}: {error}"
            if memo.lease is self:
                memo.lease = None
            warnings.warn(
                f"generate decodes uncaptured: its step could not be captured in a CUDA "
                f"graph ({reason[:300]}); pass cuda_graph=False not to try",
                RuntimeWarning,
                stacklevel=4,  # generate's caller (through torch.no_grad's wrapper)
            )
            return None


def graph_lease(
    model: nn.Module, batch: int, length: int, cuda_graph: bool | None
) -> GraphLease | None:
    """generate's captured decoding for `batch` sequences of up to `length` tokens,
    held (release it), or None where it does not apply. cuda_graph None: where the
    model is on CUDA, declares `graph_decoding` and its caches have fixed slots (no
    sliding window), and no capture of it failed before; True: raise where not; False:
    None. Its caches are reset, SLOT_BUCKET-rounded and reused while the model's
    weights stay in place."""
    if cuda_graph is False:
        return None
    strict = cuda_graph is True
    device = next(model.parameters()).device
    if device.type != "cuda":
        if strict:
            raise ValueError(
                f"cuda_graph=True captures the decoding step on a CUDA device, but the "
                f"model is on {device}: move it (model.to('cuda')) or leave cuda_graph unset"
            )
        return None
    memo = step_memo(model)
    if not strict and (not getattr(model, "graph_decoding", False) or memo.refused):
        return None
    slots = -(-length // SLOT_BUCKET) * SLOT_BUCKET
    weights = tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))
    key = (batch, slots, weights)
    held = memo.lease
    if held is not None and held.key == key and held.take():
        for cache in held.caches:
            cache.reset()
        return held
    caches = model.make_caches(batch, slots)
    problem = static_step_problem(model, caches)
    if problem is not None:
        if strict:
            raise ValueError(f"cuda_graph=True: {problem}; pass cuda_graph=False")
        return None
    lease = GraphLease(model, key, caches)
    lease.take()
    if held is None or held.take():  # (a held lease another call uses stays its own)
        if held is not None:
            held.release()
        memo.lease = lease
    return lease
