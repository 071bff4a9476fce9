"""Content-based sparse attention: Reformer-style LSH bucketing.

Queries and keys are hashed by random rotations into buckets; each is sorted by
(bucket, position) and cut into chunks of `chunk_size`. Query chunk i attends key
chunks i and i - 1, so similar queries and keys tend to meet while memory stays
O(L * chunk_size). With several hashes each round is attended on its own and the
rounds combine by their logsumexp: a key met in n rounds counts n times, as in
softmax(scores + log n).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import validate
from .attention import empty_result
from .checks import int_at_least
from .kernels.dense import masked_softmax, stats_dtype
from .kernels.merge import merge_partials
from .masks import Causal
from .masks.causal import causal_shift


def lsh_buckets(x: Tensor, num_buckets: int, seed: int) -> Tensor:
    """Angular LSH: bucket = argmax([x R, -x R]) of the normalised x, with a random
    rotation R (D, num_buckets / 2) drawn from `seed`. x (..., T, D) -> (..., T) int64."""
    generator = torch.Generator().manual_seed(seed)
    rotation = torch.randn(x.shape[-1], num_buckets // 2, generator=generator, dtype=torch.float64)
    projected = F.normalize(x.to(torch.float64), dim=-1) @ rotation.to(x.device)
    return torch.cat([projected, -projected], dim=-1).argmax(dim=-1)


def _sorted_order(buckets: Tensor) -> Tensor:
    """Indices sorting (..., T) by (bucket, position)."""
    length = buckets.shape[-1]
    positions = torch.arange(length, device=buckets.device)
    return torch.argsort(buckets * length + positions, dim=-1)


def _chunks(x: Tensor, chunk_size: int, total: int, value: float = 0.0) -> Tensor:
    """(B, H, T, X) -> (B, H, total / c, c, X), padded at the end to `total` rows."""
    x = F.pad(x, (0, 0, 0, total - x.shape[2]), value=value)
    return x.view(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])


def _with_previous(x: Tensor) -> Tensor:
    """Chunks (B, H, n, c, X) -> each chunk preceded by the previous one (B, H, n, 2c, X)."""
    previous = torch.roll(x, shifts=1, dims=2)
    return torch.cat([previous, x], dim=3)


def _one_round(q, k, v, q_buckets, k_buckets, chunk_size, causal, scale):
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    dtype = stats_dtype(q.dtype)
    q_order, k_order = _sorted_order(q_buckets), _sorted_order(k_buckets)  # (B, H, T)

    def gather(x, order):
        return x.gather(2, order.unsqueeze(-1).expand(*order.shape, x.shape[-1]))

    # both sides padded to the same number of chunks; padded keys are masked
    total = -(-max(q_len, kv_len) // chunk_size) * chunk_size
    num_chunks = total // chunk_size
    qs = _chunks(gather(q, q_order).to(dtype), chunk_size, total)  # (B, H, n, c, D)
    ks = _with_previous(_chunks(gather(k, k_order).to(dtype), chunk_size, total))  # 2c keys
    vs = _with_previous(_chunks(gather(v, k_order).to(dtype), chunk_size, total))
    q_pos = _chunks(q_order.unsqueeze(-1), chunk_size, total, value=-1).squeeze(-1)
    k_pos = _with_previous(_chunks(k_order.unsqueeze(-1), chunk_size, total, value=-1))
    k_pos = k_pos.squeeze(-1)  # (B, H, n, 2c): original key position, -1 for padding
    # the first half of chunk 0 is the last chunk rolled around: not a previous chunk
    first_half = torch.arange(2 * chunk_size, device=q.device) < chunk_size
    wrapped = (torch.arange(num_chunks, device=q.device) == 0).view(-1, 1) & first_half
    allowed = (k_pos >= 0).unsqueeze(-2) & ~wrapped.view(1, 1, num_chunks, 1, -1)
    if causal:
        q_at = q_pos.unsqueeze(-1) + causal_shift(q_len, kv_len)
        allowed = allowed & Causal().positions(q_at, k_pos.unsqueeze(-2))
    scores = (qs @ ks.transpose(-1, -2)) * scale  # (B, H, nq, c, 2c)
    probs, lse = masked_softmax(scores.masked_fill(~allowed, -torch.inf))
    out = (probs @ vs).reshape(batch, heads, -1, v.shape[-1])[:, :, :q_len]
    lse = lse.reshape(batch, heads, -1)[:, :, :q_len]
    # un-sort: row j of the sorted order belongs to query q_order[j]
    unsort = torch.argsort(q_order, dim=-1)
    out = out.gather(2, unsort.unsqueeze(-1).expand_as(out))
    return out, lse.gather(2, unsort)


def cluster_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    num_buckets: int,
    chunk_size: int,
    num_hashes: int = 1,
    causal: bool = False,
    scale: float | None = None,
    seed: int = 0,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reformer LSH attention. q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v).

    num_buckets (even) buckets per hash, num_hashes rounds with seeds seed, seed+1, ...;
    each round sorts queries and keys by bucket, and query chunk i (of chunk_size)
    attends key chunks i and i - 1. causal applies on original positions,
    bottom-right aligned. Returns (B, H, L, D_v), and with return_lse the combined
    logsumexp (B, H, L). Rows that meet no allowed key give 0.
    """
    validate.check_qkv(q, k, v)
    validate.check_causal(causal)
    validate.check_scale(scale)
    int_at_least("num_buckets", num_buckets, 2)
    int_at_least("chunk_size", chunk_size, 1)
    int_at_least("num_hashes", num_hashes, 1)
    if num_buckets % 2:
        raise ValueError(f"num_buckets must be even (x R and -x R), got {num_buckets}")
    if 0 in (q.shape[0], q.shape[2], k.shape[2]):
        return empty_result(q, k, v, None, return_lse)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rounds = []
    for round_ in range(num_hashes):
        q_buckets = lsh_buckets(q.detach(), num_buckets, seed + round_)
        k_buckets = lsh_buckets(k.detach(), num_buckets, seed + round_)
        rounds.append(_one_round(q, k, v, q_buckets, k_buckets, chunk_size, causal, scale))
    out, lse = merge_partials(rounds)  # a key met in n rounds counts n times
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def implied_counts(
    q: Tensor,
    k: Tensor,
    *,
    num_buckets: int,
    chunk_size: int,
    num_hashes: int = 1,
    causal: bool = False,
    seed: int = 0,
) -> Tensor:
    """(B, H, L, S) int: in how many hash rounds query i meets key j. Attention with
    bias log(counts) (and mask counts > 0) is what cluster_attention computes."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    q_len, kv_len = q.shape[2], k.shape[2]
    counts = torch.zeros(q.shape[0], q.shape[1], q_len, kv_len, dtype=torch.long, device=q.device)
    for round_ in range(num_hashes):
        q_rank = torch.argsort(_sorted_order(lsh_buckets(q, num_buckets, seed + round_)), dim=-1)
        k_rank = torch.argsort(_sorted_order(lsh_buckets(k, num_buckets, seed + round_)), dim=-1)
        delta = (q_rank // chunk_size).unsqueeze(-1) - (k_rank // chunk_size).unsqueeze(-2)
        counts += ((delta == 0) | (delta == 1)).long()
    if causal:
        counts = counts * Causal().dense(q_len, kv_len, q.device)
    return counts
