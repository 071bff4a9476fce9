"""Argument checks of ring_attention that fail the same way on every rank (a bad
argument on one rank must not leave the others waiting in a collective)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core import validate
from ..core.kernels.dense import stats_dtype
from ..core.masks import Pattern
from ..core.scores import as_score
from .layout import LAYOUTS


def local_problem(
    q, k, v, mask, key_padding_mask, causal, scale, dropout_p, layout, world, score=None, sinks=None
):
    """(error class name, message) for this rank's arguments, or None."""
    try:
        if layout not in LAYOUTS:
            raise ValueError(
                f"layout must be one of {LAYOUTS}, got {layout!r}; use the layout the "
                "shards were cut with by mhsa.distributed.shard"
            )
        if dropout_p != 0:
            raise ValueError(
                f"dropout is not supported (got dropout_p={dropout_p}); "
                "pass dropout_p=0.0 and apply dropout elsewhere, or use mhsa.attention"
            )
        validate.check_qkv(q, k, v)
        validate.check_causal(causal)
        validate.check_scale(scale)
        validate.check_sinks(sinks, q.shape[1], q.device)
        score = as_score(score)
        if score is not None:
            score.check(q.shape[1], q.device, stats_dtype(q.dtype))
        length = q.shape[2]
        if k.shape[2] != length:
            raise ValueError(
                f"k holds {k.shape[2]} positions but q holds {length}: ring attention is "
                "self-attention over one sharded sequence, so q, k and v shards have one length"
            )
        if length == 0:
            raise ValueError("the shards are empty (seq_len 0); every rank needs L / P >= 1")
        if layout == "zigzag" and length % 2:
            raise ValueError(
                f"the zigzag layout needs an even shard length (2 of 2 * world_size chunks "
                f"per rank), got {length}; pad the sequence to a multiple of {2 * world}"
            )
        if mask is not None:
            if not isinstance(mask, Pattern):
                raise TypeError(
                    f"mask must be an mhsa.core.masks pattern in global positions, got "
                    f"{type(mask).__name__}; give key padding as key_padding_mask="
                )
            mask.check_lengths(length * world, length * world)
            mask.check_batch(q.shape[0])
        if key_padding_mask is not None:
            want = (q.shape[0], length)
            if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError(
                    "key_padding_mask must be a bool tensor (batch, shard_len), True = real key"
                )
            if tuple(key_padding_mask.shape) != want or key_padding_mask.device != q.device:
                raise ValueError(
                    f"key_padding_mask must be (batch, shard_len) = {want} on {q.device}, got "
                    f"{tuple(key_padding_mask.shape)} on {key_padding_mask.device}; shard it "
                    "like k with mhsa.distributed.shard(mask, rank, world_size, layout, dim=1)"
                )
    except (ValueError, TypeError) as error:
        return type(error).__name__, str(error)
    return None


def check_across_ranks(infos: list[dict]) -> None:
    """Raise the same error on every rank if any rank's arguments are bad or they differ."""
    for rank, info in enumerate(infos):
        if info["problem"] is not None:
            kind, message = info["problem"]
            error = TypeError if kind == "TypeError" else ValueError
            raise error(f"ring_attention on rank {rank}: {message}")
    lengths = [info["q"][2] for info in infos]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"uneven shard sizes across ranks: seq_len by rank is {lengths}; every rank must "
            "hold L / world_size positions: cut the sequence with mhsa.distributed.shard"
        )
    for name in ("q", "k", "v"):
        shapes = [info[name] for info in infos]
        if len(set(shapes)) > 1:
            raise ValueError(
                f"{name} shapes differ across ranks: {shapes} by rank; every rank needs the "
                "same batch, heads and head_dim, (B, H, L / P, D)"
            )
    for name in (
        "dtype",
        "layout",
        "causal",
        "mask",
        "scale",
        "key_padding_mask",
        "score",
        "sinks",
    ):
        values = [info[name] for info in infos]
        if len(set(values)) > 1:
            shown = [info["mask_repr"] for info in infos] if name == "mask" else values
            raise ValueError(
                f"ring_attention needs the same {name} on every rank (compared by content), "
                f"got {shown} by rank"
            )


def describe_score(score) -> str:
    """What is compared across ranks of a score argument (its kind, not its values)."""
    try:
        return repr(as_score(score))
    except TypeError:
        return repr(score)
