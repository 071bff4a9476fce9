"""Packing: token sequences of mixed lengths into batches of at most max_tokens tokens,
without padding, in the layout of mhsa.attention_varlen (cu_seqlens offsets) and of
transformers' packed batches (position_ids restarting at 0)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE = -100  # the target of a token that predicts nothing (F.cross_entropy's default)


@dataclass
class PackedBatch:
    """Sequences packed one after another.

    tokens (total,) int64; cu_seqlens (n+1,) int32: sequence i holds tokens
    cu_seqlens[i] .. cu_seqlens[i+1]-1; max_seqlen: the longest one's length;
    position_ids (total,) int64: each token's position in its sequence; indices: which
    of the input sequences these are, in order."""

    tokens: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    position_ids: Tensor
    indices: list[int]

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def pack(sequences: Sequence[Tensor | Sequence[int]], max_tokens: int) -> list[PackedBatch]:
    """Greedy packing (first fit, longest first): each sequence, longest first, goes
    into the first batch it fits in, else starts a new one; each batch then holds its
    sequences in input order. Every batch has at most max_tokens tokens; a sequence
    longer than that raises ValueError (split or truncate it first). Empty sequences
    are kept (an empty segment)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    tokens = [_as_tokens(i, s) for i, s in enumerate(sequences)]
    for i, t in enumerate(tokens):
        if t.numel() > max_tokens:
            raise ValueError(
                f"sequence {i} has {t.numel()} tokens, more than max_tokens={max_tokens}; "
                "split or truncate it, or raise max_tokens"
            )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i].numel(), i)):
        size = tokens[i].numel()
        fits = next((b for b, free in enumerate(room) if free >= size), None)
        if fits is None:
            bins.append([])
            room.append(max_tokens)
            fits = len(bins) - 1
        bins[fits].append(i)
        room[fits] -= size
    return [_batch(sorted(members), tokens) for members in bins]


def next_token_targets(tokens: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Targets (like tokens, (total,) or (1, total)) for next-token prediction in a
    packed row: each token's successor in its own sequence, IGNORE (-100) at each
    sequence's last token, so that no loss crosses a boundary."""
    cu_seqlens = check_cu_seqlens("cu_seqlens", cu_seqlens, tokens.numel())
    flat = tokens.reshape(-1)
    targets = torch.full_like(flat, IGNORE)
    targets[:-1] = flat[1:]
    ends = cu_seqlens[1:].long().to(flat.device) - 1
    targets[ends[ends >= 0]] = IGNORE  # (an empty first sequence ends at -1)
    return targets.view(tokens.shape)


def check_cu_seqlens(name: str, cu_seqlens, total: int | None = None) -> Tensor:
    """cu_seqlens as int64 on the CPU after checking it: a 1-D int32 or int64 tensor of
    B + 1 offsets that starts at 0, never decreases and (given total) ends at total."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        got = cu_seqlens.dtype if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__
        raise TypeError(
            f"{name} must be an int32 or int64 tensor of B+1 offsets, got {got}; "
            "e.g. torch.tensor([0, 3, 8], dtype=torch.int32)"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(
            f"{name} must be 1-D with B+1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    # a copy: the caller may refill its buffer before backward, which plans from these
    offsets = cu_seqlens.detach().to("cpu", torch.int64, copy=True)
    if int(offsets[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(offsets[0])}; prepend a 0")
    steps = offsets.diff()
    if (steps < 0).any():
        at = int((steps < 0).nonzero()[0]) + 1
        raise ValueError(
            f"{name} must not decrease (offsets of segments of length >= 0), but entry "
            f"{at} is {int(offsets[at])} after {int(offsets[at - 1])}"
        )
    if total is not None and int(offsets[-1]) != total:
        raise ValueError(
            f"{name} ends at {int(offsets[-1])} but the packed tensor holds {total} tokens: "
            "its last entry must be the total"
        )
    return offsets


def _batch(members: list[int], tokens: list[Tensor]) -> PackedBatch:
    parts = [tokens[i] for i in members]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    cu = torch.zeros(len(parts) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    positions = [torch.arange(p.numel()) for p in parts]
    return PackedBatch(
        tokens=torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64),
        cu_seqlens=cu,
        max_seqlen=int(lengths.max()) if parts else 0,
        position_ids=torch.cat(positions) if parts else torch.zeros(0, dtype=torch.int64),
        indices=members,
    )


def _as_tokens(index: int, sequence) -> Tensor:
    t = torch.as_tensor(sequence)
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(
            f"sequence {index} must be a 1-D sequence of integer token ids, got "
            f"{t.dtype} of shape {tuple(t.shape)}"
        )
    return t.long()
