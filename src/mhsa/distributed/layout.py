"""How a sequence is cut across ranks, and `shard` / `unshard` for both layouts:

contiguous  rank r holds chunk r of P equal chunks
zigzag      the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r,
            so every rank has the same amount of causal work
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_chunks(world_size: int, layout: str) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def rank_chunks(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank holds, in local order."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)


def rank_pieces(rank: int, world_size: int, layout: str, split: int) -> list[int]:
    """The piece indices rank holds, in local order, each chunk cut into `split` pieces."""
    return [c * split + t for c in rank_chunks(rank, world_size, layout) for t in range(split)]


def shard(
    x: Tensor, rank: int, world_size: int, layout: str = "contiguous", dim: int = 2
) -> Tensor:
    """Rank's shard of the full sequence x along dim: (..., L, ...) -> (..., L / P, ...).

    contiguous: chunk `rank` of P; zigzag: chunks rank and 2P-1-rank of 2P, concatenated.
    L must be divisible by P (contiguous) or 2P (zigzag).
    """
    check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    chunks = num_chunks(world_size, layout)
    length = x.shape[dim]
    if length % chunks:
        raise ValueError(
            f"the {layout} layout cuts the sequence into {chunks} equal chunks, but its "
            f"length (dim {dim}) is {length}; pad it to a multiple of {chunks}"
        )
    pieces = x.chunk(chunks, dim=dim)
    return torch.cat([pieces[c] for c in rank_chunks(rank, world_size, layout)], dim=dim)


def unshard(
    shards_or_tensor: Tensor | Sequence[Tensor],
    world_size: int,
    layout: str = "contiguous",
    dim: int = 2,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The full sequence from the shards of every rank, the inverse of `shard`.

    Given a list of world_size shards (in rank order), it reassembles them locally;
    given this rank's shard, it all-gathers the shards of the group first (every rank
    must call it; the result is not differentiable).
    """
    check_layout(layout)
    if isinstance(shards_or_tensor, Tensor):
        local = shards_or_tensor.contiguous()
        shards = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(shards, local, group=group)
    else:
        shards = list(shards_or_tensor)
    if len(shards) != world_size:
        raise ValueError(f"got {len(shards)} shards for world_size {world_size}")
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    chunks: list[Tensor | None] = [None] * (2 * world_size)
    for rank, piece in enumerate(shards):
        first, second = rank_chunks(rank, world_size, layout)
        chunks[first], chunks[second] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
