"""PagedLayer: one layer's part of a PagedKVCache in one forward pass, the `cache` that
MultiHeadAttention writes the new keys and values through. It stores and hands out
pages; attention reads them through the pass's PagedStep (mhsa.paged_attention), which
every layer of the pass shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.paged_step import PagedStep
from .base import Cache


@dataclass
class PagedPass:
    """One forward pass of a PagedKVCache: its pools, its sequences and their pages (the
    PagedStep every layer's attention takes), where their new tokens go, and what to
    call once every layer has written them."""

    k: Tensor  # the cache's keys (num_layers, num_blocks, block_size, H_kv, D)
    v: Tensor  # and values (..., H_kv, D_v)
    seq_ids: list[int]
    paged: PagedStep  # the block table and the lengths after the pass, checked
    positions: Tensor  # (N, T) positions of the new tokens
    slots: Tensor  # (N * T,) block * block_size + row of each new token
    written_by_all: Callable[[], None]  # (the cache then caches the full prompt blocks)
    written: set[int] = field(default_factory=set)  # layers that wrote
    valid: bool = True


class PagedLayer(Cache):
    """One layer's part of a PagedKVCache for one forward pass (PagedKVCache.batch gives
    one per layer): the `cache` of that layer's MultiHeadAttention. update writes the
    new keys and values into the sequences' blocks and returns the layer's pools;
    paged_step (the pass's, the same object in every layer) says where each sequence's
    keys are, for mhsa.paged_attention(q, k_pool, v_pool, paged_step), causal per
    sequence. next_positions gives each sequence's own positions (Llama, GPT)."""

    def __init__(self, forward_pass: PagedPass, layer: int) -> None:
        self.forward_pass, self.layer = forward_pass, layer

    @property
    def paged_step(self) -> PagedStep:
        """The pass's block table and lengths, checked once for every layer."""
        return self.forward_pass.paged

    @property
    def block_table(self) -> Tensor:
        """(N, max_blocks) the sequences' block ids (0 past a sequence's blocks)."""
        return self.forward_pass.paged.block_table

    @property
    def seq_lens(self) -> list[int]:
        """Each sequence's keys once this step's tokens are written."""
        return self.forward_pass.paged.seq_lens

    @property
    def length(self) -> int:
        """The longest sequence's length before this step. Positions differ per
        sequence: take them from next_positions."""
        return max(self.seq_lens) - self.forward_pass.positions.shape[1]

    def next_positions(self, count: int) -> Tensor:
        """(N, count) positions of the new tokens: each sequence's length + 0..count-1."""
        if count != self.forward_pass.positions.shape[1]:
            raise ValueError(
                f"this step adds {self.forward_pass.positions.shape[1]} tokens per "
                f"sequence (batch(..., new_tokens)), got {count}"
            )
        return self.forward_pass.positions

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k (N, H_kv, T, D), v (N, H_kv, T, D_v) into the sequences' slots; return
        this layer's pools (num_blocks, block_size, H_kv, D) and (..., D_v)."""
        run = self.forward_pass
        if not run.valid:
            raise ValueError(
                "these PagedLayers are stale: the cache was batched again, or "
                "one of their sequences freed or forked, since batch() made "
                "them; call batch() for each forward pass"
            )
        if self.layer in run.written:
            raise ValueError(
                f"layer {self.layer}'s PagedLayer already served a forward "
                "pass; call cache.batch(...) for the next one"
            )
        self._check(k, v)
        flat = (k.shape[0] * k.shape[2], k.shape[1])  # (N * T, H_kv)
        for pool, new in ((run.k, k), (run.v, v)):
            rows = pool[self.layer].flatten(0, 1)  # (num_blocks * block_size, H_kv, D)
            rows.index_copy_(0, run.slots, new.transpose(1, 2).reshape(*flat, new.shape[-1]))
        run.written.add(self.layer)
        if len(run.written) == run.k.shape[0]:
            run.written_by_all()
        return run.k[self.layer], run.v[self.layer]

    def reorder(self, index: Tensor) -> None:
        raise ValueError("a PagedLayer does not reorder; fork the PagedKVCache's sequences instead")

    def _check(self, k: Tensor, v: Tensor) -> None:
        run = self.forward_pass
        want = (len(run.seq_ids), run.k.shape[3], run.positions.shape[1], run.k.shape[4])
        if tuple(k.shape) != want or tuple(v.shape) != (*want[:3], run.v.shape[4]):
            raise ValueError(
                f"this step's k must be (N, H_kv, T, D) = {want} and v (..., "
                f"{run.v.shape[4]}); got k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}"
            )
        dtype = run.k.dtype
        if k.dtype != dtype or v.dtype != dtype:
            raise TypeError(
                f"the cache holds {dtype}, got k {k.dtype}, v {v.dtype}: make "
                "the PagedKVCache in the model's dtype"
            )
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError(
                "a PagedKVCache serves inference: run the model under "
                "torch.no_grad() or torch.inference_mode()"
            )
