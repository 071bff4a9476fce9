"""Ring attention over torch.distributed: one sequence sharded across ranks.

Each of P ranks holds L / P positions of q, k and v. The K/V shards travel around the
ring with point-to-point isend/irecv while each rank attends its queries to the shard
it holds; the partial outputs merge by their logsumexp (float32 statistics). Every
block is computed by the tiled flash engine (mhsa.core.kernels.flash). The backward is
exact: each rank recomputes its blocks from the final logsumexp while dK/dV
accumulators travel with their shards and end at their owners.

How the sequence is cut is in layout.py, the blocks and schedule of a call in
blocks.py, the transfers in transfer.py. An EMPTY block is never computed (so under
causal no rank computes a future shard), and the ring only visits the source ranks
that some rank needs: with SlidingWindow(left, right), rank r needs about
ceil(left / shard) ranks before it and ceil(right / shard) after it, so the shards go
one rank at a time through the left neighbours, then jump once to the farthest right
neighbour and come back one at a time: len(schedule) - 1 transfers instead of P - 1,
no compute on the others.

Score functions (mhsa.core.scores) are evaluated per tile by the engine, each block seeing
its rows and keys at their global positions (kernels.scored.Shifted), so ALiBi, a relative
bias or a ScoreMod equal one process's under either layout. Sinks join the merged
lse once, after the last step. Gradients of the replicated tensors (sinks, slopes, a
bias table, a ScoreMod's closure) are each rank's share, its queries' rows: summed
over the ranks (with the model's other gradients) they are one process's.

Memory per rank, beyond the inputs: the output, a second K/V shard in flight, one
dK/dV accumulator (it is received before each step's compute and added to in place),
dq and the engine's temporaries of one block: about 1/P of one process's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.kernels.dense import stats_dtype
from ..core.kernels.flash import FlashCall, flash_backward, flash_forward, fused_available
from ..core.kernels.merge import merge_partials
from ..core.kernels.scored import add_sinks, sink_grad
from ..core.masks import FULL, Causal, Pattern
from ..core.scores import ScoreFunction, as_score
from .blocks import Setup, split_pieces, tile_block, visit_order
from .checks import check_across_ranks, describe_score, local_problem
from .layout import rank_chunks
from .transfer import Ring, Travelling

__all__ = ["ring_attention"]


def _merge_into(out: Tensor, lse: Tensor, rows: slice, part: Tensor, part_lse: Tensor) -> None:
    """Fold a partial (out, lse) of query rows into the running ones, in place."""
    merged, merged_lse = merge_partials([(out[:, :, rows], lse[:, :, rows]), (part, part_lse)])
    out[:, :, rows] = merged
    lse[:, :, rows] = merged_lse


def _block_call(q, k, v, rows, cols, plan, score, scale: float, fused: bool) -> FlashCall:
    """The flash engine's call on one block: query rows of q against key columns of k, v."""
    q_b, k_b, v_b = q[:, :, rows], k[:, :, cols], v[:, :, cols]
    return FlashCall(q_b, k_b, v_b, None, plan, scale, fused=fused, score=score)


def _ring_forward(q, k, v, keys, sinks, setup: Setup) -> tuple[Tensor, Tensor]:
    """out (B, H, n, D_v) in q's dtype and lse (B, H, n) in the statistics dtype; the
    sinks (H,) join the merged lse once, after the last step."""
    ring, schedule = setup.ring, setup.schedule
    dtype = stats_dtype(q.dtype)
    batch, num_heads, length, _ = q.shape
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((batch, num_heads, length), -torch.inf, dtype=dtype, device=q.device)
    shards = Travelling(ring, [k, v] if keys is None else [k, v, keys], owned=False, tag=0)
    for step, offset in enumerate(schedule):
        last = step + 1 == len(schedule)
        if not last:  # the next shard travels while this one is used
            shards.pass_on(schedule[step + 1] - offset)
        k_cur, v_cur = shards.current[:2]
        key_cur = shards.current[2] if keys is not None else None
        src = (ring.rank + offset) % ring.world
        for rows, cols, plan, score in setup.blocks(src, key_cur, q.device):
            block = _block_call(q, k_cur, v_cur, rows, cols, plan, score, setup.scale, setup.fused)
            part, part_lse = flash_forward(block)
            _merge_into(out, lse, rows, part, part_lse)
        if not last:
            shards.receive()
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def _ring_backward(grad_out, q, k, v, keys, out, lse, setup: Setup, params=()):
    """dq, dk, dv of this rank's shards and the gradients of the score function's
    params from this rank's queries: blocks recomputed from the final out and lse
    (sinks included, so each block's gradient is already the sinks' softmax's).

    The dK/dV accumulator of each shard travels with it: a rank receives it from the
    shard's previous holder before computing (one accumulator per rank, not two:
    every rank finishes its previous step at about the same time, so the wait is one
    transfer), adds its blocks in place and passes it on, home to the owner at the end.
    """
    ring, schedule = setup.ring, setup.schedule
    dtype = stats_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    shards = Travelling(ring, [k, v] if keys is None else [k, v, keys], owned=False, tag=0)
    zeros = [torch.zeros(t.shape, dtype=dtype, device=q.device) for t in (k, v)]
    grads = Travelling(ring, zeros, owned=True, tag=8)  # (dk, dv) of the shard held
    param_grads: list[Tensor | None] = [None] * len(params)
    fused = setup.fused and not params  # the fused kernel gives no score gradients
    for step, offset in enumerate(schedule):
        last = step + 1 == len(schedule)
        if not last:
            shards.pass_on(schedule[step + 1] - offset)
        if step > 0:  # what the shard's earlier holders accumulated
            grads.receive()
        k_cur, v_cur = shards.current[:2]
        key_cur = shards.current[2] if keys is not None else None
        dk, dv = grads.current
        src = (ring.rank + offset) % ring.world
        for rows, cols, plan, score in setup.blocks(src, key_cur, q.device):
            block = _block_call(q, k_cur, v_cur, rows, cols, plan, score, setup.scale, fused)
            block_out, block_lse = out[:, :, rows], lse[:, :, rows].contiguous()
            dq_b, dk_b, dv_b, _, _, found = flash_backward(
                block, grad_out[:, :, rows], None, block_out, block_lse, score_params=params
            )
            _accumulate(param_grads, found)
            dq[:, :, rows] += dq_b
            dk[:, :, cols] += dk_b
            dv[:, :, cols] += dv_b
            del dq_b, dk_b, dv_b
        del k_cur, v_cur, key_cur, dk, dv
        # pass the accumulator on with the shard, or home to its owner after the last step
        delta = -offset if last else schedule[step + 1] - offset
        if delta % ring.world:
            grads.pass_on(delta)
        if not last:
            shards.receive()
    del shards
    if grads.incoming is not None:
        grads.receive()
    dk, dv = grads.current
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), param_grads


def _accumulate(total: list[Tensor | None], found: list[Tensor | None]) -> None:
    """total[i] += found[i], where found[i] is not None."""
    for i, grad in enumerate(found):
        if grad is not None:
            total[i] = grad if total[i] is None else total[i] + grad


class _RingAttention(torch.autograd.Function):
    """(q, k, v, key padding, sinks, *score tensors) shards -> out shard; saves only the
    inputs, out and lse. The gradients of sinks and score tensors are this rank's
    queries' share: summed over the ranks they give one process's."""

    @staticmethod
    def forward(ctx, q, k, v, keys, sinks, setup, *score_params):
        out, lse = _ring_forward(q, k, v, keys, sinks, setup)
        ctx.save_for_backward(q, k, v, keys, sinks, out, lse, *score_params)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keys, sinks, out, lse, *saved_params = ctx.saved_tensors
        wanted = ctx.needs_input_grad[6:]
        params = tuple(p for p, want in zip(saved_params, wanted, strict=True) if want)
        dq, dk, dv, found = _ring_backward(grad_out, q, k, v, keys, out, lse, ctx.setup, params)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)
            dsinks = sink_grad(sinks, lse, delta)
        found = iter(found)
        param_grads = [
            _zero_if_none(next(found), p) if want else None
            for p, want in zip(saved_params, wanted, strict=True)
        ]
        return (dq, dk, dv, None, dsinks, None, *param_grads)


def _zero_if_none(grad: Tensor | None, param: Tensor) -> Tensor:
    """A rank whose blocks never read a tensor still returns its (zero) gradient, so
    that every rank's gradient has the same shape for an all-reduce."""
    return torch.zeros_like(param) if grad is None else grad.to(param.dtype)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    mask: Pattern | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    dropout_p: float = 0.0,
    score: ScoreFunction | list | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of `group`.

    Every rank of the group calls it with its own shards (n = L / P positions):

    Args:
        q: (B, H, n, D) this rank's queries.
        k: (B, H_kv, n, D) this rank's keys; H % H_kv == 0 (grouped-query attention).
        v: (B, H_kv, n, D_v) this rank's values.
        group: the process group (default: the default group); P = its size.
        causal: the query at global position p sees keys at positions <= p.
        mask: an mhsa.core.masks pattern (e.g. SlidingWindow(w, 0)) on the whole (L, L)
            sequence, in global positions; the same on every rank. Packed sequences:
            Segments(cu_seqlens, causal=..., window=...) of the whole row (sequences
            may cross shard edges; a relative score such as ALiBi or T5 then sees
            the offsets each sequence has alone).
        key_padding_mask: (B, n) bool, True = real key, for this rank's keys.
        scale: multiplies q k^T; defaults to 1 / sqrt(D).
        layout: "contiguous" or "zigzag", as the shards were cut by `shard`.
        dropout_p: must be 0; dropout is not supported.
        score: an mhsa.core.scores function (ALiBi, RelativeBias, Softcap, ScoreMod) or a
            list of them, the same on every rank; it sees global positions (a query's
            and a key's place in the whole sequence, whatever the layout).
        sinks: (H,) per-head logits of a key without a value, the same on every rank;
            each joins its row's softmax denominator once.

    Returns:
        (B, H, n, D_v) this rank's output rows, in q's dtype; gradients flow to q, k
        and v. A query with no allowed key gets 0 output and zero gradients.

    Gradients of replicated tensors (sinks, a score function's slopes, bias table or
    closure tensors) are this rank's share: those of its own query rows against every
    key. Like the gradient of any weight applied to this rank's shard, they sum over
    the ranks to one process's gradient: all-reduce them with the model's other
    gradients (as DistributedDataParallel or mhsa.apps.train's context parallel do).

    Each call all-gathers the shard shapes once, so a bad argument on any rank (uneven
    shards, mismatched B/H/D, odd shard length for zigzag, unknown layout, dropout)
    raises ValueError on every rank instead of hanging. Communication: K/V (and key
    padding) shards move around the ring with isend/irecv, overlapped with compute;
    chunk pairs that the mask leaves EMPTY are skipped and ranks no one needs are not
    visited (see the module docstring).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring_attention needs torch.distributed: call torch.distributed."
            "init_process_group first (mhsa.distributed.run_local starts a local group)"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problem = local_problem(
        q, k, v, mask, key_padding_mask, causal, scale, dropout_p, layout, world, score, sinks
    )

    def shape(t):
        return tuple(t.shape) if isinstance(t, Tensor) else None

    info = {
        "problem": problem,
        "q": shape(q) or (0, 0, -1, 0),
        "k": shape(k),
        "v": shape(v),
        "dtype": str(getattr(q, "dtype", None)),
        "layout": layout,
        "causal": causal,
        "mask": mask.fingerprint() if isinstance(mask, Pattern) else repr(mask),
        "mask_repr": repr(mask),
        "scale": repr(scale),
        "key_padding_mask": "given" if key_padding_mask is not None else None,
        "score": describe_score(score),
        "sinks": "given" if sinks is not None else None,
    }
    infos: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(infos, info, group=group)
    check_across_ranks(infos)
    score = as_score(score)

    chunk = q.shape[2] // len(rank_chunks(0, 1, layout))
    split = split_pieces(chunk, layout)
    piece, total = chunk // split, q.shape[2] * world
    pattern = Causal() if causal else None
    if mask is not None:
        pattern = mask if pattern is None else pattern & mask
    if pattern is None:
        num_pieces = total // piece
        piece_kinds = torch.full((num_pieces, num_pieces), FULL, dtype=torch.int8)
    else:
        piece_kinds = pattern.block_layout(total, total, piece)
    setup = Setup(
        ring=Ring(group, rank, world),
        layout=layout,
        split=split,
        piece=piece,
        total=total,
        pattern=pattern,
        piece_kinds=piece_kinds,
        schedule=visit_order(world, layout, piece_kinds, split),
        scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
        # the fused kernel adds a float tile: additive score functions only
        fused=fused_available(q, v, 0.0) and (score is None or score.additive),
        block=tile_block(piece, getattr(pattern, "block_size", None)),
        score=score,
    )
    keys = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    params = () if score is None else score.tensors()
    return _RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), keys, sinks, setup, *params
    )
