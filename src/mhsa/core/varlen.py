"""Packed, variable-length sequences: attention over several sequences packed into one
row without padding (FlashAttention's varlen layout), and their per-token positions.

    q (total_q, H, D), k (total_k, H_kv, D), v (total_k, H_kv, D_v)
    cu_seqlens_q, cu_seqlens_k (B+1,) int32/int64: sequence s holds the queries
        cu_seqlens_q[s]..cu_seqlens_q[s+1]-1 and the keys cu_seqlens_k[s]..[s+1]-1

`attention_varlen` is one mhsa.attention call on (1, H, total, D) whose mask is the
block-diagonal masks.Segments pattern: every backend serves it through the pattern
(the tiled engines plan only the blocks that segments reach), and the result equals
running each sequence alone.

Positions restart at each sequence. They are given by cu_seqlens or by
transformers-style position_ids (0, 1, 2, 0, 1, ...); `packed_segments` takes
either or both, and when both are given they must describe the same segments (a
disagreement raises: neither silently wins, since the wrong one would leak).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import attention
from .checks import an_int, tensors_of_rank
from .kernels.scored import AtPositions
from .masks.causal import causal_shift
from .masks.segments import Segments, check_cu_seqlens, check_segment_counts
from .scores import ScoreFunction, as_score

PACKED = "(total, num_heads, head_dim)"


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    score: ScoreFunction | list | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of packed sequences, each on its own: softmax(score(q k^T * scale)) v.

    Args:
        q: (total_q, H, D) the queries of B sequences, one after another.
        k: (total_k, H_kv, D) their keys; H % H_kv == 0 (grouped-query attention).
        v: (total_k, H_kv, D_v) their values.
        cu_seqlens_q: (B+1,) int32 or int64 offsets: sequence s holds queries
            cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1; starts at 0, ends at total_q,
            never decreases (equal entries make an empty sequence).
        cu_seqlens_k: (B+1,) the same for the keys (pass cu_seqlens_q again for
            self-attention).
        max_seqlen_q: at least the longest query sequence (FlashAttention's argument).
        max_seqlen_k: at least the longest key sequence.
        causal: within each sequence, query i sees keys j <= i + S_s - L_s (aligned
            bottom-right per sequence, L_s and S_s its query and key counts).
        window: an int w or (left, right): within its sequence a query at position p
            sees keys p - left .. p + right (w is (w, w)); with causal, none after p.
        dropout_p: probability of dropping an attention weight.
        scale: multiplies q k^T; defaults to 1 / sqrt(D).
        score: an mhsa.core.scores function (or a list of them); it sees positions
            within each sequence (query i of sequence s at i + S_s - L_s, key j at j).
        sinks: (H,) float logits of a key without a value, one per query head.
        return_lse: also return the logsumexp of each query's scores.
        backend: "auto" or a name from mhsa.backends(), as for mhsa.attention.

    Returns:
        out (total_q, H, D_v) in q's dtype; with return_lse, (out, lse) with lse
        (H, total_q) float32 (float64 for float64 inputs), FlashAttention's layout.
        A query with no key (an empty key sequence, or masked by causal or the
        window) gets output 0 and lse -inf (its sink's logit, with sinks).
    """
    _check_packed(q, k, v)
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    check_segment_counts(cu_q, cu_k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k)
    pattern = Segments(cu_q, cu_k, causal=causal, window=window)
    score = _per_sequence(as_score(score), cu_q, cu_k, q.device)
    result = attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, H, total_q, D): one packed row
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        pattern,
        scale=scale,
        dropout_p=dropout_p,
        score=score,
        sinks=sinks,
        return_lse=return_lse,
        backend=backend,
    )
    out, lse = result if return_lse else (result, None)
    out = out[0].transpose(0, 1).contiguous()  # (total_q, H, D_v)
    return (out, lse[0]) if return_lse else out


def _per_sequence(score, cu_q: Tensor, cu_k: Tensor, device) -> ScoreFunction | None:
    """The score function at positions within each sequence. A relative one (ALiBi, T5,
    softcap) needs no change where every pair of sequences ends at the same offset from
    the packed row's bottom-right corner (self-attention, say): the packed positions
    then differ from the per-sequence ones by one amount within each sequence."""
    if score is None:
        return None
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    ends_aligned = bool((cu_k[1:] - cu_q[1:] == total_k - total_q).all())
    if score.relative and ends_aligned:
        return score
    shift = causal_shift(cu_q.diff(), cu_k.diff())  # each sequence's first query position
    q_positions = positions_from_cu_seqlens(cu_q) + shift.repeat_interleave(cu_q.diff())
    return AtPositions(
        score,
        q_positions.to(device),
        positions_from_cu_seqlens(cu_k).to(device),
        causal_shift(total_q, total_k),
    )


def _check_packed(q: Tensor, k: Tensor, v: Tensor) -> None:
    tensors_of_rank(3, f"{PACKED} (sequences packed along dim 0)", q=q, k=k, v=v)


def _check_max_seqlen(name: str, value: int, cu: Tensor) -> None:
    an_int(name, value)
    longest = int(cu.diff().max()) if cu.numel() > 1 else 0
    if value < longest:
        at = int(cu.diff().argmax())
        raise ValueError(
            f"{name}={value} is smaller than sequence {at}, of length {longest}; pass the "
            "longest sequence's length (or more)"
        )


def positions_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """(total,) int64 position of each token within its sequence (0, 1, ..., 0, 1, ...),
    on cu_seqlens's device: what rotary embeddings and position tables read."""
    cu = check_cu_seqlens("cu_seqlens", cu_seqlens)
    lengths = cu.diff()
    starts = cu[:-1].repeat_interleave(lengths)
    return (torch.arange(int(cu[-1])) - starts).to(cu_seqlens.device)


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """(B+1,) int32 offsets of the sequences of transformers-style position_ids: each
    sequence counts 0, 1, 2, ... and a 0 starts the next. position_ids (total,) or
    (rows, L) (flattened row by row; each row starts a sequence, at 0). Raises
    ValueError where a position is neither 0 nor one more than the previous one in its
    row."""
    if (
        not isinstance(position_ids, Tensor)
        or position_ids.is_floating_point()
        or position_ids.dtype == torch.bool
        or position_ids.dim() not in (1, 2)
    ):
        got = (
            f"{position_ids.dtype} {tuple(position_ids.shape)}"
            if isinstance(position_ids, Tensor)
            else type(position_ids).__name__
        )
        raise TypeError(f"position_ids must be an integer tensor (total,) or (rows, L), got {got}")
    flat = position_ids.detach().reshape(-1).cpu().long()
    if flat.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=position_ids.device)
    starts = flat == 0
    follows = torch.cat([flat.new_zeros(1), flat[:-1] + 1]) == flat
    if position_ids.dim() == 2:  # no sequence runs on from one row into the next
        follows[:: position_ids.shape[1]] = False
    bad = ~(starts | follows)
    if bad.any():
        at = int(bad.nonzero()[0])
        raise ValueError(
            f"position_ids must count 0, 1, 2, ... within each packed sequence and restart "
            f"at 0, got {int(flat[at])} at token {at}"
        )
    cu = torch.cat([starts.nonzero().flatten(), torch.tensor([flat.numel()])])
    return cu.to(device=position_ids.device, dtype=torch.int32)


def packed_segments(
    cu_seqlens: Tensor | None = None,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(cu_seqlens (B+1,) int32, position_ids (total,) int64) of a packed batch given by
    cu_seqlens, by position_ids restarting at 0, or by both, which must then agree
    (ValueError otherwise: neither wins silently). attention_mask, a transformers-style
    2-D padding mask (1 = real token) of the packed row, may come along: all ones, it
    changes nothing (packing stays detected, unlike transformers' flash path); with a
    padded token it is refused, since padding inside a pack is ambiguous."""
    if cu_seqlens is None and position_ids is None:
        raise ValueError("give cu_seqlens or position_ids (or both) to describe the packed batch")
    from_ids = None if position_ids is None else cu_seqlens_from_position_ids(position_ids)
    if cu_seqlens is None:
        cu = from_ids
    else:
        cu = check_cu_seqlens("cu_seqlens", cu_seqlens).to(torch.int32)
        if from_ids is not None and not torch.equal(_nonempty(cu), from_ids.cpu()):
            raise ValueError(
                f"cu_seqlens {cu.tolist()} and position_ids (sequences at "
                f"{from_ids.tolist()}) describe different sequences; pass one of them, or "
                "make them agree"
            )
        cu = cu.to(cu_seqlens.device)
    if attention_mask is not None:
        if attention_mask.numel() != int(cu[-1]):
            raise ValueError(
                f"attention_mask has {attention_mask.numel()} entries but the packed batch "
                f"holds {int(cu[-1])} tokens"
            )
        if not bool((attention_mask != 0).all()):
            raise ValueError(
                "attention_mask marks padded tokens inside a packed batch; drop them from "
                "the pack (cu_seqlens and position_ids describe what is real)"
            )
    return cu, positions_from_cu_seqlens(cu)


def _nonempty(cu: Tensor) -> Tensor:
    """cu_seqlens without its empty sequences (position_ids cannot show those)."""
    cu = cu.cpu()
    keep = torch.cat([torch.tensor([True]), cu.diff() > 0])
    return cu[keep]
