"""The backend registry: what each backend can serve, and which one a call gets.

A backend answers `available()` (can it run on this machine at all) and
`supports(spec)` (can it serve this particular call exactly); both return None for
yes or a human-readable reason for no. A call over paged keys (spec.paged: a pool of
blocks and a block table, mhsa.attention(..., block_table=...)) goes to the backend's
`forward_paged`; a backend that has none says so in `supports`. `auto` takes, among
the backends that say yes, the one with the highest `preference(spec)` (measured speed
and memory).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.paged import PagedCall
from ..tracing import constant_when_traced


@dataclass(frozen=True)
class AttentionSpec:
    """What a call asks for: enough for a backend to decide whether it can serve it."""

    batch: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device
    has_mask: bool
    has_bias: bool
    causal: bool
    dropout_p: float
    return_lse: bool
    has_score: bool = False  # an mhsa.core.scores function
    score_kinds: tuple[str, ...] = ()  # its functions' class names in order (scores.kinds)
    mask_kinds: tuple[str, ...] = ()  # the pattern's parts' class names (masks.part_kinds)
    has_sinks: bool = False
    paged: bool = False  # keys and values in a pool of blocks, read through a block table
    needs_grad: bool = False  # gradients flow to an input (q, k or v, the pools, bias, score)

    @classmethod
    def example(cls, **changes) -> AttentionSpec:
        """A typical call (B=1, H=8, H_kv=2, L=S=1024, D=64, float32, CPU), with changes."""
        fields = dict(
            batch=1,
            num_heads=8,
            num_kv_heads=2,
            q_len=1024,
            kv_len=1024,
            head_dim=64,
            value_dim=64,
            dtype=torch.float32,
            device=torch.device("cpu"),
            has_mask=False,
            has_bias=False,
            causal=False,
            dropout_p=0.0,
            return_lse=False,
        )
        fields.update(changes)
        return cls(**fields)


# what a backend without forward_paged answers in supports for a paged call
PAGED_REASON = "no paged keys (block_table=); flash, reference and triton read pages"


class Backend:
    """Base class: one subclass per file in mhsa/core/backends."""

    name: str = ""
    sharded: bool = False  # q, k, v are one process's shards of longer sequences

    def available(self) -> str | None:
        """None if the backend can run on this machine, else why not."""
        return None

    def supports(self, spec: AttentionSpec) -> str | None:
        """None if the backend serves `spec` exactly, else why not."""
        return None

    def preference(self, spec: AttentionSpec) -> float:
        """How much `auto` prefers this backend for `spec` (higher wins)."""
        return 0.0

    def any_rank(self, flag: bool) -> bool:
        """Whether flag holds on any process taking part in the call: backends whose
        forward is a collective (ring) must take the same branch on every rank."""
        return flag

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        causal: bool,
        scale: float,
        dropout_p: float,
        return_lse: bool,
        score=None,
        sinks: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Return (out (B, H, L, D_v), lse (B, H, L) float32 or None)."""
        raise NotImplementedError

    def prepare_paged(self, call: PagedCall) -> object | None:
        """What forward_paged may reuse for every call like `call` (its shapes, lengths,
        window, scale and score; other q and pools): made at a decoding step's first
        such call and handed back as forward_paged's `prepared` (mhsa.core.paged.PagedStep
        keeps it for the step). It must not depend on the block ids or the keys. None:
        nothing to reuse."""
        return None

    def forward_paged(self, call: PagedCall, prepared: object | None = None) -> Tensor:
        """Attention over paged keys, causal per sequence (see mhsa.core.kernels.paged for the
        layout): call.q (N, H, T, D), pools (num_blocks, block_size, H_kv, D) and
        (..., D_v), block_table (N, max_blocks) int64 (entries past a sequence's keys: any
        valid block), lengths N ints, the resolved scale, a score function and a window
        or None. prepared: prepare_paged of a call like this one, or None. Returns (N, H,
        T, D_v) in q's dtype."""
        raise NotImplementedError(f"backend {self.name!r} does not serve paged keys")


_BACKENDS: dict[str, Backend] = {}
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("mhsa_backend", default=None)
# counts use_backend entries and exits: torch.compile reads it, so a graph traced under
# one forced backend is guarded on it and traced again under another
_forced_generation = 0


def register(backend: Backend) -> Backend:
    """Add a backend; registration order breaks ties in `auto` preference."""
    _BACKENDS[backend.name] = backend
    return backend


def names() -> list[str]:
    """Backend names in registration order."""
    return list(_BACKENDS)


def get(name: str) -> Backend:
    if name not in _BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {names()}, got {name!r}")
    return _BACKENDS[name]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force one backend for every attention call inside the block.

    >>> with mhsa.use_backend("reference"):
    ...     out = mhsa.attention(q, k, v)
    """
    global _forced_generation
    if name != "auto":
        get(name)
    token = _forced.set(name)
    _forced_generation += 1
    try:
        yield
    finally:
        _forced.reset(token)
        _forced_generation += 1


def serves_paged(backend: Backend) -> bool:
    """Whether the backend has a forward_paged (reads keys through a block table)."""
    return type(backend).forward_paged is not Backend.forward_paged


def reason_unusable(backend: Backend, spec: AttentionSpec) -> str | None:
    if spec.paged and not serves_paged(backend):
        return PAGED_REASON
    return backend.available() or backend.supports(spec)


def select(spec: AttentionSpec, requested: str) -> Backend:
    """The backend that serves `spec`: the forced one, the requested one, or the best."""
    if torch.compiler.is_compiling():
        sizes = {name: _traced_size(getattr(spec, name)) for name in ("batch", "q_len", "kv_len")}
        # heads and widths are the model's: specialised to their values
        widths = {
            name: _specialized(getattr(spec, name))
            for name in ("num_heads", "num_kv_heads", "head_dim", "value_dim")
        }
        # a float argument is symbolic under dynamic=True: the choice asks only whether
        # there is dropout
        fixed = sizes | widths | {"dropout_p": 0.0 if spec.dropout_p == 0 else 0.5}
        fields = tuple(fixed.get(f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec))
        return get(_select_when_traced(fields, requested, _forced_generation))
    return _select(spec, requested)


# forced(): the backend use_backend forces here (None or "auto": none)
forced = _forced.get


# While torch.compile traces, one graph may serve every size (dynamic shapes), so the
# choice cannot depend on them: sizes other than 1 are taken as this. Each backend
# that serves a call is exact; only speed depends on the choice.
TRACED_SIZE = 1024


def _traced_size(size: int) -> int:
    return 1 if size == 1 else TRACED_SIZE


def _specialized(size: int) -> int:
    """A size as a plain int while torch.compile traces. A symbolic one (dynamic=True
    makes heads and widths symbolic too; int() of it stays symbolic, and dynamo calls
    it an int) is found by bisection: each comparison becomes a guard, so the graph is
    specialised to the value, as to any of the model's constants."""
    low, high = 0, 1
    while size >= high:
        low, high = high, 2 * high
    while high - low > 1:  # low <= size < high
        middle = (low + high) // 2
        if size >= middle:
            low = middle
        else:
            high = middle
    return low


@constant_when_traced
def _select_when_traced(fields: tuple, requested: str, generation: int) -> str:
    """select() while torch.compile traces, run once: its answer is a constant of the
    graph, which is guarded on `generation` (use_backend changes it). `auto` then takes
    sdpa wherever it serves the call: torch's own operator, which inductor knows;
    flash enters the graph as its custom op (backends.flash_op) otherwise."""
    spec = AttentionSpec(*fields)
    sdpa = _BACKENDS.get("sdpa")
    automatic = requested == "auto" and _forced.get() in (None, "auto")
    if automatic and sdpa is not None and reason_unusable(sdpa, spec) is None:
        return "sdpa"
    return _select(spec, requested).name


def _select(spec: AttentionSpec, requested: str) -> Backend:
    forced = _forced.get()
    if forced is not None and forced != "auto":
        requested = forced
    if requested != "auto":
        backend = get(requested)
        reason = reason_unusable(backend, spec)
        if reason is not None:
            raise ValueError(f"backend {requested!r} cannot serve this call: {reason}")
        return backend
    usable, reasons = [], []
    for backend in _BACKENDS.values():
        reason = reason_unusable(backend, spec)
        if reason is None:
            usable.append(backend)
        else:
            reasons.append(f"{backend.name}: {reason}")
    if not usable:
        raise ValueError("no backend can serve this call: " + "; ".join(reasons))
    return max(usable, key=lambda b: b.preference(spec))  # first of equals wins
