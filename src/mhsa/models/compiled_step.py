"""The decoding step compiled once per model (generate(..., compile=True), chat, Whisper).

    compiled_decode_step(model, caches)   token (B, 1) -> logits (B, V), compiled
    compiled_once(model, function, args)  torch.compile(function) made once per model
    static_caches(caches)                 StaticKVCaches continuing prefilled KVCaches
    compile_seconds(model)                what the first compiled call took
    step_memo(model)                      all a model keeps between decoding calls

mhsa.models.graph_step captures this step in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..cache import StaticKVCache
from ..core.backends.common import recompile_limit
from .decoder import Decoder


class StepMemo:
    """What a model keeps between decoding calls, on the model itself
    (model.decoding_memo), never in a module: its compiled functions (by the function
    compiled), the seconds the first compiled call took, generate's GraphLease and why
    a capture failed (generate does not try that model again). A copy or a pickle of
    the model starts with an empty memo: compiled code and captured graphs belong to
    the original's weights."""

    def __init__(self) -> None:
        self.compiled: dict[Callable, Callable] = {}
        self.compile_seconds: float | None = None
        self.lease = None  # graph_step.GraphLease | None
        self.refused: str | None = None

    def __deepcopy__(self, memo: dict) -> StepMemo:
        return StepMemo()

    def __reduce__(self) -> tuple:
        return StepMemo, ()


def step_memo(model: nn.Module) -> StepMemo:
    """model's StepMemo, made on first use."""
    memo = model.__dict__.get("decoding_memo")
    if memo is None:
        memo = model.decoding_memo = StepMemo()
    return memo


def compiled_decode_step(model: nn.Module, caches: list) -> Callable[[Tensor], Tensor]:
    """token (B, 1) -> logits (B, V): model.step compiled once per model
    (fullgraph; inductor's caches keep the compiled code on disk between runs), over
    StaticKVCaches that continue `caches`."""
    static = static_caches(caches)
    return compiled_once(model, decode_step, lambda token: (model, token, static))


def static_caches(caches: list) -> list[StaticKVCache]:
    """StaticKVCaches continuing KVCaches, their slot axis dynamic (one compiled graph
    for every cache length; heads and widths stay fixed)."""
    static = [StaticKVCache(cache) for cache in caches]
    for cache in static:
        torch._dynamo.mark_dynamic(cache.k, 2)
        torch._dynamo.mark_dynamic(cache.v, 2)
    return static


def compiled_once(model: nn.Module, function: Callable, arguments: Callable) -> Callable:
    """x -> function(*arguments(x)), through torch.compile(function) made once per model
    (fullgraph); the first call's seconds (compiling included) go to compile_seconds."""
    memo = step_memo(model)
    made = memo.compiled
    first = function not in made
    if first:
        made[function] = torch.compile(function, fullgraph=True, dynamic=False)
    compiled = made[function]

    fresh = True

    def call(x: Tensor) -> Tensor:
        nonlocal first, fresh
        started = time.perf_counter()
        # this step's first call may compile a version (one per model and shape, many
        # in a process); the later ones reuse it, without the patch's ~60 us a call
        with recompile_limit() if fresh else contextlib.nullcontext():
            result = compiled(*arguments(x))
        fresh = False
        if first:
            memo.compile_seconds, first = time.perf_counter() - started, False
        return result

    return call


def decode_step(model: Decoder, token: Tensor, caches: list) -> Tensor:
    """model.step(token, caches): the function compiled (one per model, whoever calls)."""
    return model.step(token, caches)


def compile_seconds(model: nn.Module) -> float | None:
    """Seconds the first compiled decoding step of model took (compiling included), or
    None before generate(..., compile=True)."""
    return step_memo(model).compile_seconds
