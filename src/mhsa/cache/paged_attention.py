"""paged_attention: causal attention of new queries over a paged key/value cache (the
layout and the math: mhsa.kernels.paged)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import validate
from ..kernels.dense import stats_dtype
from ..kernels.paged import paged_reference, paged_tiled
from ..scores import ScoreFunction, as_score

BACKENDS = ("auto", "reference", "tiled")


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    lengths: Tensor | Sequence[int],
    *,
    scale: float | None = None,
    score: ScoreFunction | list | None = None,
    window: int | None = None,
    backend: str = "auto",
    tile_size: int = 256,
) -> Tensor:
    """Attention of each sequence's new queries over its keys in a paged cache.

    Args:
        q: (N, H, T, D) the queries of T new tokens of each of N sequences.
        k_pool: (num_blocks, block_size, H_kv, D) the keys of every block;
            H % H_kv == 0 (grouped-query).
        v_pool: (num_blocks, block_size, H_kv, D_v) the values.
        block_table: (N, max_blocks) integer block ids: sequence n's key j is row
            j % block_size of block block_table[n, j // block_size]. Entries past a
            sequence's keys are ignored (any value).
        lengths: (N,) keys of each sequence, the new ones included, at most
            max_blocks * block_size. Causal, aligned bottom-right per sequence: query
            t of sequence n sits at position lengths[n] - T + t and sees the keys up
            to it (a query with no key, lengths[n] < T, gets 0).
        scale: multiplies q k^T; default 1 / sqrt(D).
        score: an mhsa.scores function (ALiBi, RelativeBias, Softcap, ScoreMod) or a
            list, evaluated per tile at each sequence's own positions.
        window: a query at position p sees keys p - window .. p only
            (SlidingWindow(window, 0)); None: every key before it.
        backend: "reference" gathers each sequence's pages and attends densely
            (differentiable); "tiled" gathers tile_size keys (whole pages) at a time
            and merges them with an online softmax (inference); "auto" is "tiled"
            unless gradients are needed.

    Returns:
        (N, H, T, D_v) in q's dtype. Unwritten slots of the pools may hold anything.
    """
    lengths = _check(q, k_pool, v_pool, block_table, lengths, window, backend, tile_size)
    validate.check_scale(scale)
    score = as_score(score)
    if score is not None:
        score.check(q.shape[1], q.device, stats_dtype(q.dtype))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    grads = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k_pool, v_pool, *(score.tensors() if score else ()))
    )
    if backend == "tiled" and grads:
        raise ValueError("the tiled paged backend is for inference (no gradients): use "
                         "backend='reference', or run under torch.no_grad()")  # fmt: skip
    if q.shape[0] == 0 or q.shape[2] == 0:
        return q.new_zeros(*q.shape[:3], v_pool.shape[3])
    table = block_table.long().clamp(0, k_pool.shape[0] - 1)  # unused entries: any value
    options = {"scale": scale, "score": score, "window": window}
    if backend == "reference" or (backend == "auto" and grads):
        return paged_reference(q, k_pool, v_pool, table, lengths, **options)
    return paged_tiled(q, k_pool, v_pool, table, lengths, tile_size=tile_size, **options)


def _check(q, k_pool, v_pool, block_table, lengths, window, backend, tile_size) -> list[int]:
    """Raise on a bad call; return lengths as a list of ints."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D float tensor, got {got}; layout: q (N, H, "
                             "T, D), pools (num_blocks, block_size, H_kv, D)")  # fmt: skip
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"q, k_pool and v_pool must share one dtype, got {q.dtype}, "
                        f"{k_pool.dtype}, {v_pool.dtype}; cast them with .to(q.dtype)")  # fmt: skip
    if k_pool.device != q.device or v_pool.device != q.device:
        raise ValueError(f"q, k_pool and v_pool must be on one device, got {q.device}, "
                         f"{k_pool.device}, {v_pool.device}")  # fmt: skip
    batch, num_heads, _, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, key_dim = k_pool.shape
    if tuple(v_pool.shape[:3]) != (num_blocks, block_size, num_kv_heads):
        raise ValueError(f"v_pool must be (num_blocks, block_size, H_kv, D_v) = ({num_blocks}, "
                         f"{block_size}, {num_kv_heads}, *) like k_pool, got "
                         f"{tuple(v_pool.shape)}")  # fmt: skip
    if key_dim != head_dim or min(num_blocks, block_size, num_kv_heads, head_dim) == 0:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} must hold keys of q's head_dim "
                         f"{head_dim}, with no empty dimension")  # fmt: skip
    if num_heads % num_kv_heads:
        raise ValueError(f"q's num_heads ({num_heads}) must be a multiple of the pools' "
                         f"num_kv_heads ({num_kv_heads}) for grouped-query attention")  # fmt: skip
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 \
            or block_table.shape[0] != batch:  # fmt: skip
        got = tuple(block_table.shape) if isinstance(block_table, Tensor) else block_table
        raise ValueError(f"block_table must be a (N, max_blocks) = ({batch}, *) tensor of "
                         f"block ids, got {got}")  # fmt: skip
    if block_table.is_floating_point() or block_table.is_complex() \
            or block_table.dtype == torch.bool:  # fmt: skip
        raise TypeError(f"block_table must hold integer block ids, got {block_table.dtype}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
    lengths = _lengths(lengths, batch, block_table.shape[1] * block_size)
    used = torch.arange(block_table.shape[1], device=q.device).view(1, -1) * block_size
    used = used < torch.tensor(lengths, device=q.device).view(-1, 1)
    ids = block_table[used]
    low, high = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
    if low < 0 or high >= num_blocks:
        raise ValueError(f"block_table's blocks holding keys must be in 0..{num_blocks - 1} "
                         f"(the pools' num_blocks), got {low}..{high}")  # fmt: skip
    if window is not None:
        validate.int_at_least("window", window, 0)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    validate.int_at_least("tile_size", tile_size, 1)
    return lengths


def _lengths(lengths, batch: int, capacity: int) -> list[int]:
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise TypeError(f"lengths must be a 1-D integer tensor (N,), got {lengths.dtype} "
                            f"{tuple(lengths.shape)}")  # fmt: skip
        lengths = lengths.tolist()
    lengths = list(lengths)
    if len(lengths) != batch or not all(isinstance(n, int) and not isinstance(n, bool)
                                        for n in lengths):  # fmt: skip
        raise ValueError(f"lengths must hold {batch} ints (one per sequence), got {lengths}")
    if any(not 0 <= n <= capacity for n in lengths):
        raise ValueError(f"lengths must be in 0..{capacity} (block_table's max_blocks * "
                         f"block_size), got {lengths}")  # fmt: skip
    return lengths
