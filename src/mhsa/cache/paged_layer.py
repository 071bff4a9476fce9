"""PagedLayer: one layer's part of a PagedKVCache in one forward pass, the `cache` that
MultiHeadAttention writes the new keys and values through and attends over pages with."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kernels.dense import stats_dtype
from ..kernels.paged import paged_reference, paged_tiled
from ..masks import SlidingWindow
from ..positional import AttentionPosition, RotaryEmbedding
from ..scores import ScoreFunction


@dataclass
class PagedStep:
    """One forward pass of a PagedKVCache: its pools, its sequences, where their new
    tokens go, and what to call once every layer has written them."""

    k: Tensor  # the cache's keys (num_layers, num_blocks, block_size, H_kv, D)
    v: Tensor  # and values (..., H_kv, D_v)
    seq_ids: list[int]
    table: Tensor  # (N, max_blocks) block ids, 0 past a sequence's blocks
    lengths: list[int]  # tokens per sequence after the step
    positions: Tensor  # (N, T) positions of the new tokens
    slots: Tensor  # (N * T,) block * block_size + row of each new token
    written_by_all: Callable[[], None]  # (the cache then caches the full prompt blocks)
    written: set[int] = field(default_factory=set)  # layers that wrote
    valid: bool = True


class PagedLayer:
    """One layer's part of a PagedKVCache for one forward pass (PagedKVCache.batch gives
    one per layer): the `cache` of that layer's MultiHeadAttention, which then writes
    the new keys and values into the sequences' blocks and attends over their pages
    (attend). next_positions gives each sequence's own positions (Llama, GPT)."""

    def __init__(self, step: PagedStep, layer: int) -> None:
        self.step, self.layer = step, layer

    @property
    def length(self) -> int:
        """The longest sequence's length before this step. Positions differ per
        sequence: take them from next_positions."""
        return max(self.step.lengths) - self.step.positions.shape[1]

    def next_positions(self, count: int) -> Tensor:
        """(N, count) positions of the new tokens: each sequence's length + 0..count-1."""
        if count != self.step.positions.shape[1]:
            raise ValueError(f"this step adds {self.step.positions.shape[1]} tokens per "
                             f"sequence (batch(..., new_tokens)), got {count}")  # fmt: skip
        return self.step.positions

    def key_padding(self) -> None:
        """No padding: every sequence's keys are its own."""
        return None

    def rotate(self, position: AttentionPosition | None, q: Tensor,
               k: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        """q (N, H, T, D), k (N, H_kv, T, D) rotated at each sequence's positions."""
        if position is None:
            return q, k
        if isinstance(position, RotaryEmbedding):
            position = position.at(self.step.positions)
        base = AttentionPosition
        fixed = isinstance(getattr(position, "positions", None), Tensor)  # rotary.at(...)
        if (not fixed and type(position).rotate is not base.rotate) or \
                type(position).attention_bias is not base.attention_bias:  # fmt: skip
            raise TypeError(f"a PagedLayer takes rotary positions and score functions "
                            f"(ALiBi, T5), not {type(position).__name__}, which rotates from "
                            "one offset or adds a dense bias")  # fmt: skip
        return position.rotate(q, k, 0)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: SlidingWindow | None = None,
        causal: bool = True,
        scale: float | None = None,
        score: ScoreFunction | None = None,
        backend: str = "auto",
    ) -> Tensor:
        """Write k (N, H_kv, T, D), v (N, H_kv, T, D_v) into the sequences' slots, then
        attend from q (N, H, T, D) over each sequence's pages: query t sees its
        sequence's keys up to position length_before + t (causal bottom-right),
        within SlidingWindow(left, 0) if that is the mask. Returns (N, H, T, D_v).
        backend: "auto" (tiled), "tiled" or "reference" (see mhsa.paged_attention)."""
        step = self.step
        if not step.valid:
            raise ValueError("these PagedLayers are stale: the cache was batched again, or "
                             "one of their sequences freed or forked, since batch() made "
                             "them; call batch() for each forward pass")  # fmt: skip
        if self.layer in step.written:
            raise ValueError(f"layer {self.layer}'s PagedLayer already served a forward "
                             "pass; call cache.batch(...) for the next one")  # fmt: skip
        window = self._window(mask, causal, step.positions.shape[1])
        self._check(q, k, v)
        if backend not in ("auto", "tiled", "reference"):
            raise ValueError(f"backend must be 'auto', 'tiled' or 'reference', got {backend!r}")
        if score is not None:
            score.check(q.shape[1], q.device, stats_dtype(q.dtype))
        flat = (k.shape[0] * k.shape[2], k.shape[1])  # (N * T, H_kv)
        for pool, new in ((step.k, k), (step.v, v)):
            rows = pool[self.layer].view(-1, *pool.shape[3:])  # (num_blocks * block_size, ...)
            rows.index_copy_(0, step.slots, new.transpose(1, 2).reshape(*flat, -1))
        kernel = paged_reference if backend == "reference" else paged_tiled
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        out = kernel(q, step.k[self.layer], step.v[self.layer], step.table, step.lengths,
                     scale=scale, score=score, window=window)  # fmt: skip
        step.written.add(self.layer)
        if len(step.written) == step.k.shape[0]:
            step.written_by_all()
        return out

    @staticmethod
    def _window(mask, causal: bool, new_tokens: int) -> int | None:
        """The window of a SlidingWindow(left, 0) mask, None for plain causal."""
        if isinstance(mask, SlidingWindow) and mask.right == 0:
            return mask.left
        if mask is None and (causal or new_tokens == 1):
            return None
        raise ValueError(f"a PagedLayer attends causally (causal=True), optionally within "
                         f"SlidingWindow(left, 0); got mask {mask!r}, causal={causal}")  # fmt: skip

    def _check(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        step = self.step
        want = (len(step.seq_ids), step.k.shape[3], step.positions.shape[1], step.k.shape[4])
        if tuple(k.shape) != want or tuple(v.shape) != (*want[:3], step.v.shape[4]) \
                or q.dim() != 4 or q.shape[0] != want[0] or q.shape[2] != want[2] \
                or q.shape[3] != want[3] or q.shape[1] % want[1]:  # fmt: skip
            raise ValueError(f"this step's k must be (N, H_kv, T, D) = {want}, v (..., "
                             f"{step.v.shape[4]}) and q (N, H, T, D), H a multiple of H_kv; "
                             f"got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")  # fmt: skip
        dtype = step.k.dtype
        if k.dtype != dtype or v.dtype != dtype or q.dtype != dtype:
            raise TypeError(f"the cache holds {dtype}, got q {q.dtype}, k {k.dtype}, v "
                            f"{v.dtype}: make the PagedKVCache in the model's dtype")  # fmt: skip
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("a PagedKVCache serves inference: run the model under "
                             "torch.no_grad() or torch.inference_mode()")  # fmt: skip
