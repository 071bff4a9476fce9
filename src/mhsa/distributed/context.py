"""Context parallelism: the `ring` backend and the block that turns it on.

Inside `context_parallel(group, layout)` every process holds one shard of each
sequence (see mhsa.distributed.shard), and every attention call - from mhsa.attention
or any module built on it - goes to ring_attention, which sees the whole sequence.
Outside that block the backend serves nothing. It lives here, above the backends,
and registers itself when mhsa.distributed is imported (mhsa's own import does so).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..core.backends.registry import PAGED_REASON, AttentionSpec, Backend, register, use_backend
from ..core.masks import Pattern
from .ring import ring_attention

_active: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "mhsa_context_parallel", default=None
)


@contextlib.contextmanager
def context_parallel(group=None, layout: str = "zigzag") -> Iterator[None]:
    """Run every attention call in the block as ring attention over `group` (default:
    the whole world), the local tensors being this rank's shard in `layout`. A call
    the ring cannot serve raises instead of silently attending only locally."""
    token = _active.set((group, layout))
    try:
        with use_backend("ring"):
            yield
    finally:
        _active.reset(token)


class RingBackend(Backend):
    name = "ring"
    sharded = True

    def available(self) -> str | None:
        return None if dist.is_available() else "torch.distributed is not available"

    def supports(self, spec: AttentionSpec) -> str | None:
        if _active.get() is None:
            return "only inside mhsa.distributed.context_parallel(...)"
        if spec.paged:
            return PAGED_REASON
        if spec.has_bias:
            return "an additive bias is not supported across processes"
        if spec.dropout_p:
            return "dropout is not supported across processes"
        if spec.return_lse:
            return "return_lse is not supported"
        return None

    def any_rank(self, flag: bool) -> bool:
        group, _ = _active.get()
        nccl = dist.get_backend(group) == "nccl"  # NCCL reduces CUDA tensors only
        votes = torch.tensor([int(flag)], device="cuda" if nccl else "cpu")
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        return bool(votes.item())

    def forward(
        self, q, k, v, *, mask, bias, causal, scale, dropout_p, return_lse, score=None, sinks=None
    ):
        """ring_attention over the whole sequences; mask: None or a pattern in global
        positions. Returns (out, None): no lse."""
        if mask is not None and not isinstance(mask, Pattern):
            raise ValueError(
                "the ring backend takes masks as mhsa.core.masks patterns (global positions); "
                "a tensor mask of the local shard is ambiguous"
            )
        group, layout = _active.get()
        out = ring_attention(
            q,
            k,
            v,
            group=group,
            causal=causal,
            mask=mask,
            scale=scale,
            layout=layout,
            score=score,
            sinks=sinks,
        )
        return out, None


register(RingBackend())
