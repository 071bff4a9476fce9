"""Ring attention over torch.distributed: one sequence sharded across ranks.

Each of P ranks holds L / P positions of q, k and v. The K/V shards travel around the
ring with point-to-point isend/irecv while each rank attends its queries to the shard
it holds; the partial outputs merge by their logsumexp (float32 statistics). Every
block is computed by the tiled flash engine (mhsa.kernels.flash). The backward is
exact: each rank recomputes its blocks from the final logsumexp while dK/dV
accumulators travel with their shards and end at their owners.

Layouts (how the sequence is cut; `shard` and `unshard` implement both):
    contiguous  rank r holds chunk r of P equal chunks
    zigzag      the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r,
                so every rank has the same amount of causal work

Blocks: each chunk is cut into pieces (PIECES_PER_SHARD per shard, none shorter than
MIN_PIECE), and a block is one (query piece, key piece) pair; computing piece by piece
keeps the engine's gradient temporaries a fraction of a shard.

Which blocks are visited: the mask (causal and/or an mhsa.masks pattern, in global
positions) is reduced once to piece resolution with `pattern.block_layout`. A block
that is EMPTY is never computed (so under causal no rank computes a future shard),
and the ring only visits the source ranks that some rank needs: with
SlidingWindow(left, right), rank r needs about ceil(left / shard) ranks before it and
ceil(right / shard) after it, so the shards go one rank at a time through the left
neighbours, then jump once to the farthest right neighbour and come back one at a
time: len(schedule) - 1 transfers instead of P - 1, no compute on the others.

Memory per rank, beyond the inputs: the output, a second K/V shard in flight, one
dK/dV accumulator (it is received before each step's compute and added to in place),
dq and the engine's temporaries of one block: about 1/P of one process's.

`run_local` (from mhsa.launch) starts a local gloo process group of CPU processes,
for tests and benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from . import validate
from .backends.flash import FUSED_BLOCK, plan_for
from .backends.ring import context_parallel
from .kernels.dense import stats_dtype
from .kernels.flash import flash_backward, flash_forward, fused_available
from .kernels.plan import BlockPlan, reduce_blocks
from .launch import free_port, run_local
from .masks import EMPTY, FULL, Causal, Pattern

__all__ = [
    "LAYOUTS",
    "context_parallel",
    "free_port",
    "ring_attention",
    "run_local",
    "shard",
    "unshard",
]

LAYOUTS = ("contiguous", "zigzag")


# layouts --------------------------------------------------------------------------


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _num_chunks(world_size: int, layout: str) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def _rank_chunks(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank holds, in local order."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)


def _rank_pieces(rank: int, world_size: int, layout: str, split: int) -> list[int]:
    """The piece indices rank holds, in local order, each chunk cut into `split` pieces."""
    return [c * split + t for c in _rank_chunks(rank, world_size, layout) for t in range(split)]


def shard(
    x: Tensor, rank: int, world_size: int, layout: str = "contiguous", dim: int = 2
) -> Tensor:
    """Rank's shard of the full sequence x along dim: (..., L, ...) -> (..., L / P, ...).

    contiguous: chunk `rank` of P; zigzag: chunks rank and 2P-1-rank of 2P, concatenated.
    L must be divisible by P (contiguous) or 2P (zigzag).
    """
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    chunks = _num_chunks(world_size, layout)
    length = x.shape[dim]
    if length % chunks:
        raise ValueError(
            f"the {layout} layout cuts the sequence into {chunks} equal chunks, but its "
            f"length (dim {dim}) is {length}; pad it to a multiple of {chunks}"
        )
    pieces = x.chunk(chunks, dim=dim)
    return torch.cat([pieces[c] for c in _rank_chunks(rank, world_size, layout)], dim=dim)


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
    _check_layout(layout)
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
        first, second = _rank_chunks(rank, world_size, layout)
        chunks[first], chunks[second] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


# point-to-point transfers ----------------------------------------------------------


@dataclass
class _Transfer:
    works: list
    received: list[Tensor]

    def wait(self) -> list[Tensor]:
        """The received tensors; the sent ones are released."""
        for work in self.works:
            work.wait()
        received, self.works, self.received = self.received, [], []
        return received


@dataclass
class _Ring:
    group: dist.ProcessGroup | None
    rank: int
    world: int

    def shift(
        self, tensors: list[Tensor], delta: int, tag: int = 0, into: list[Tensor] | None = None
    ) -> _Transfer:
        """Start sending tensors to rank - delta and receiving their likes (into the
        given buffers, or new ones) from rank + delta, the holder of what comes next."""
        send_to, recv_from = (self.rank - delta) % self.world, (self.rank + delta) % self.world
        received = into if into is not None else [torch.empty_like(t) for t in tensors]
        ops = [
            dist.P2POp(dist.isend, t.contiguous(), group=self.group, tag=tag + i,
                       group_peer=send_to)
            for i, t in enumerate(tensors)
        ] + [
            dist.P2POp(dist.irecv, r, group=self.group, tag=tag + i, group_peer=recv_from)
            for i, r in enumerate(received)
        ]  # fmt: skip
        return _Transfer(dist.batch_isend_irecv(ops), received)


class _Travelling:
    """Tensors that travel along the ring: the ones this rank holds now, passed on into
    two alternating receive buffers (allocated once, so no memory churn per step)."""

    def __init__(self, ring: _Ring, tensors: list[Tensor], owned: bool, tag: int) -> None:
        self.ring, self.current, self.tag = ring, tensors, tag
        self.owned = owned  # False: the caller's tensors, never overwritten
        self.spare: list[Tensor] | None = None
        self.incoming: _Transfer | None = None

    def pass_on(self, delta: int) -> None:
        """Start sending the current tensors to rank - delta, receiving from rank + delta."""
        self.incoming = self.ring.shift(self.current, delta, self.tag, into=self.spare)
        self.spare = None

    def receive(self) -> list[Tensor]:
        """Wait for the transfer; the received tensors become the current ones."""
        received = self.incoming.wait()
        self.spare = self.current if self.owned else None
        self.current, self.owned, self.incoming = received, True, None
        return received


# masks of one (query piece, key piece) block ---------------------------------------

PIECES_PER_SHARD = 8  # blocks are computed piece by piece: smaller gradient temporaries
MIN_PIECE = 128  # but never on pieces shorter than this


def _split(chunk: int, layout: str) -> int:
    """Into how many pieces each chunk is cut."""
    for split in range(PIECES_PER_SHARD // len(_rank_chunks(0, 1, layout)), 1, -1):
        if chunk % split == 0 and chunk // split >= MIN_PIECE:
            return split
    return 1


def _tile_block(piece: int, hint: int | None) -> int:
    """The engine's tile size for pieces of this length: the pattern's hint, else the
    largest divisor of the piece in [32, FUSED_BLOCK] (so tiles align with piece
    offsets), else FUSED_BLOCK."""
    if hint:
        return hint
    if piece <= FUSED_BLOCK:
        return piece
    for block in range(FUSED_BLOCK, 31, -1):
        if piece % block == 0:
            return block
    return FUSED_BLOCK


class _BlockMask(Pattern):
    """A global pattern seen from one (query piece, key piece) block, with the key
    piece's padding mask: local query i, key j are global q_start + i, k_start + j."""

    def __init__(self, pattern, q_start, k_start, total, keys, block, global_kinds) -> None:
        self.pattern, self.q_start, self.k_start, self.total = pattern, q_start, k_start, total
        self.keys = keys  # (B, piece) bool or None
        self.block_size = block
        self.global_kinds = global_kinds  # (bq, bk) -> kinds of the pattern on (L, L)
        self.batch_size = keys.shape[0] if keys is not None else None

    def allowed(self, rows, cols, q_len, kv_len):
        mask = None
        if self.pattern is not None:
            mask = self.pattern.allowed(
                rows + self.q_start, cols + self.k_start, self.total, self.total
            )
        if self.keys is not None:
            real = self.keys.to(cols.device)[:, cols.flatten()]
            real = real.view(self.keys.shape[0], 1, 1, -1)
            mask = real if mask is None else mask & real
        return mask

    def kinds(self, q_len, kv_len, block_q, block_k):
        if self.pattern is not None and (self.q_start % block_q or self.k_start % block_k):
            return super().kinds(q_len, kv_len, block_q, block_k)  # unaligned: reduce
        shape = (-(-q_len // block_q), -(-kv_len // block_k))
        kinds = torch.full(shape, FULL, dtype=torch.int8)
        if self.pattern is not None:
            # a local tile lies inside the global tile at the same block index: global
            # FULL or EMPTY hold for it too (the last, shorter tile included)
            qb, kb = self.q_start // block_q, self.k_start // block_k
            kinds = self.global_kinds(block_q, block_k)[qb : qb + shape[0], kb : kb + shape[1]]
        if self.keys is not None:
            real = self.keys.view(self.keys.shape[0], 1, 1, -1).cpu()
            kinds = torch.minimum(kinds, reduce_blocks(real, q_len, kv_len, block_q, block_k))
        return kinds

    def lower_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        if self.keys is not None or self.pattern is None:
            return False
        qs, ks, total = self.q_start, self.k_start, self.total
        return self.pattern.lower_triangular(q0 + qs, q1 + qs, k0 + ks, k1 + ks, total, total)

    def upper_triangular(self, q0, q1, k0, k1, q_len, kv_len):
        if self.keys is not None or self.pattern is None:
            return False
        qs, ks, total = self.q_start, self.k_start, self.total
        return self.pattern.upper_triangular(q0 + qs, q1 + qs, k0 + ks, k1 + ks, total, total)


# the plan of a call: which ranks to visit, which blocks to compute -----------------


def _schedule(world: int, layout: str, piece_kinds: Tensor, split: int) -> list[int]:
    """Source offsets to visit, in order: at step i rank r holds the K/V shard of rank
    (r + offsets[i]) % world. 0 first (its own shard), then the others descending, so
    shards arrive from the previous rank; offsets no rank needs are left out."""
    owner = torch.empty(piece_kinds.shape[0], dtype=torch.long)  # the rank of each piece
    for rank in range(world):
        owner[_rank_pieces(rank, world, layout, split)] = rank
    q_piece, k_piece = (piece_kinds != EMPTY).nonzero(as_tuple=True)
    needed = set(((owner[k_piece] - owner[q_piece]) % world).tolist()) - {0}
    return [0] + sorted(needed, reverse=True)


@dataclass
class _Setup:
    ring: _Ring
    layout: str
    split: int  # pieces per chunk
    piece: int  # positions per piece
    total: int  # L, the whole sequence
    pattern: Pattern | None  # causal and mask, in global positions
    piece_kinds: Tensor  # (num_pieces, num_pieces) EMPTY/PARTIAL/FULL
    schedule: list[int]
    scale: float
    fused: bool
    block: int
    _kinds_cache: dict = field(default_factory=dict)

    def global_kinds(self, block_q: int, block_k: int) -> Tensor:
        key = (block_q, block_k)
        if key not in self._kinds_cache:
            self._kinds_cache[key] = self.pattern.block_layout(
                self.total, self.total, block_q, block_k
            )
        return self._kinds_cache[key]

    def blocks(
        self, src: int, keys: Tensor | None, device: torch.device
    ) -> list[tuple[slice, slice, BlockPlan]]:
        """(local query rows, local key rows, plan) of every block of this rank's
        queries against src's shard that is not EMPTY."""
        ring, piece = self.ring, self.piece
        out = []
        q_pieces = _rank_pieces(ring.rank, ring.world, self.layout, self.split)
        k_pieces = _rank_pieces(src, ring.world, self.layout, self.split)
        for i, pq in enumerate(q_pieces):
            for j, pk in enumerate(k_pieces):
                kind = int(self.piece_kinds[pq, pk])
                if kind == EMPTY:
                    continue
                rows, cols = slice(i * piece, (i + 1) * piece), slice(j * piece, (j + 1) * piece)
                key_piece = None if keys is None else keys[:, cols].bool()
                mask = None
                if kind != FULL or key_piece is not None:
                    pattern = None if kind == FULL else self.pattern
                    mask = _BlockMask(pattern, pq * piece, pk * piece, self.total, key_piece,
                                      self.block, self.global_kinds)  # fmt: skip
                plan = plan_for(mask, False, piece, piece, device, self.fused)
                out.append((rows, cols, plan))
        return out


# forward and backward --------------------------------------------------------------


def _merge_into(out: Tensor, lse: Tensor, rows: slice, part: Tensor, part_lse: Tensor) -> None:
    """Fold a partial (out, lse) of query rows into the running ones by logsumexp, in
    place (no temporaries the size of out)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, part_lse.to(lse.dtype))
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # rows with no key
    keep, add = torch.exp(old - safe).unsqueeze(-1), torch.exp(part_lse - safe).unsqueeze(-1)
    out_rows = out[:, :, rows]
    out_rows.mul_(keep).addcmul_(part.to(out.dtype), add)
    lse[:, :, rows] = new


def _ring_forward(q, k, v, keys, setup: _Setup) -> tuple[Tensor, Tensor]:
    """out (B, H, n, D_v) in q's dtype and lse (B, H, n) in the statistics dtype."""
    ring, schedule = setup.ring, setup.schedule
    dtype = stats_dtype(q.dtype)
    batch, num_heads, length, _ = q.shape
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((batch, num_heads, length), -torch.inf, dtype=dtype, device=q.device)
    shards = _Travelling(ring, [k, v] if keys is None else [k, v, keys], owned=False, tag=0)
    for step, offset in enumerate(schedule):
        last = step + 1 == len(schedule)
        if not last:  # the next shard travels while this one is used
            shards.pass_on(schedule[step + 1] - offset)
        k_cur, v_cur = shards.current[:2]
        key_cur = shards.current[2] if keys is not None else None
        src = (ring.rank + offset) % ring.world
        for rows, cols, plan in setup.blocks(src, key_cur, q.device):
            part, part_lse = flash_forward(
                q[:, :, rows], k_cur[:, :, cols], v_cur[:, :, cols], None, plan, setup.scale,
                None, setup.fused,
            )  # fmt: skip
            _merge_into(out, lse, rows, part, part_lse)
        if not last:
            shards.receive()
    return out.to(q.dtype), lse


def _ring_backward(grad_out, q, k, v, keys, out, lse, setup: _Setup):
    """dq, dk, dv of this rank's shards: blocks recomputed from the final lse.

    The dK/dV accumulator of each shard travels with it: a rank receives it from the
    shard's previous holder before computing (one accumulator per rank, not two:
    every rank finishes its previous step at about the same time, so the wait is one
    transfer), adds its blocks in place and passes it on, home to the owner at the end.
    """
    ring, schedule = setup.ring, setup.schedule
    dtype = stats_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    shards = _Travelling(ring, [k, v] if keys is None else [k, v, keys], owned=False, tag=0)
    zeros = [torch.zeros(t.shape, dtype=dtype, device=q.device) for t in (k, v)]
    grads = _Travelling(ring, zeros, owned=True, tag=8)  # (dk, dv) of the shard held
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
        for rows, cols, plan in setup.blocks(src, key_cur, q.device):
            dq_b, dk_b, dv_b, _ = flash_backward(
                grad_out[:, :, rows], None, q[:, :, rows], k_cur[:, :, cols], v_cur[:, :, cols],
                None, out[:, :, rows], lse[:, :, rows].contiguous(), plan, setup.scale, None,
                setup.fused, False,
            )  # fmt: skip
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
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """(q, k, v, key padding) shards -> out shard; saves only q, k, v, keys, out, lse."""

    @staticmethod
    def forward(ctx, q, k, v, keys, setup):
        out, lse = _ring_forward(q, k, v, keys, setup)
        ctx.save_for_backward(q, k, v, keys, out, lse)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keys, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(grad_out, q, k, v, keys, out, lse, ctx.setup)
        return dq, dk, dv, None, None


# checks that fail on every rank ----------------------------------------------------


def _local_problem(q, k, v, mask, key_padding_mask, causal, scale, dropout_p, layout, world):
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
                    f"mask must be an mhsa.masks pattern in global positions, got "
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


def _check_across_ranks(infos: list[dict]) -> None:
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
    for name in ("dtype", "layout", "causal", "mask", "scale", "key_padding_mask"):
        values = [info[name] for info in infos]
        if len(set(values)) > 1:
            raise ValueError(
                f"ring_attention needs the same {name} on every rank, got {values} by rank"
            )


# the public function ---------------------------------------------------------------


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
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of `group`.

    Every rank of the group calls it with its own shards (n = L / P positions):

    Args:
        q: (B, H, n, D) this rank's queries.
        k: (B, H_kv, n, D) this rank's keys; H % H_kv == 0 (grouped-query attention).
        v: (B, H_kv, n, D_v) this rank's values.
        group: the process group (default: the default group); P = its size.
        causal: the query at global position p sees keys at positions <= p.
        mask: an mhsa.masks pattern (e.g. SlidingWindow(w, 0)) on the whole (L, L)
            sequence, in global positions; the same on every rank.
        key_padding_mask: (B, n) bool, True = real key, for this rank's keys.
        scale: multiplies q k^T; defaults to 1 / sqrt(D).
        layout: "contiguous" or "zigzag", as the shards were cut by `shard`.
        dropout_p: must be 0; dropout is not supported.

    Returns:
        (B, H, n, D_v) this rank's output rows, in q's dtype; gradients flow to q, k
        and v. A query with no allowed key gets 0 output and zero gradients.

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
    problem = _local_problem(
        q, k, v, mask, key_padding_mask, causal, scale, dropout_p, layout, world
    )

    def shape(t):
        return tuple(t.shape) if isinstance(t, Tensor) else None

    info = {
        "problem": problem, "q": shape(q) or (0, 0, -1, 0), "k": shape(k), "v": shape(v),
        "dtype": str(getattr(q, "dtype", None)), "layout": layout, "causal": causal,
        "mask": repr(mask), "scale": repr(scale),
        "key_padding_mask": "given" if key_padding_mask is not None else None,
    }  # fmt: skip
    infos: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(infos, info, group=group)
    _check_across_ranks(infos)

    chunk = q.shape[2] // len(_rank_chunks(0, 1, layout))
    split = _split(chunk, layout)
    piece, total = chunk // split, q.shape[2] * world
    pattern = Causal() if causal else None
    if mask is not None:
        pattern = mask if pattern is None else pattern & mask
    if pattern is None:
        num_pieces = total // piece
        piece_kinds = torch.full((num_pieces, num_pieces), FULL, dtype=torch.int8)
    else:
        piece_kinds = pattern.block_layout(total, total, piece)
    setup = _Setup(
        ring=_Ring(group, rank, world),
        layout=layout,
        split=split,
        piece=piece,
        total=total,
        pattern=pattern,
        piece_kinds=piece_kinds,
        schedule=_schedule(world, layout, piece_kinds, split),
        scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
        fused=fused_available(q, v, 0.0),
        block=_tile_block(piece, getattr(pattern, "block_size", None)),
    )
    keys = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), keys, setup)
