"""Ring attention serving packed sequences: a masks.Segments pattern on the whole
sharded row, its sequences crossing the shard edges (contiguous and zigzag layouts,
causal, a window inside each sequence, ALiBi, a sequence of length 1 and an empty
one), against one process's mhsa.attention_varlen on the whole row, forward and
backward, in a real gloo group of 3 CPU processes."""

from __future__ import annotations

import pytest
import torch

from mhsa.core.masks import Segments
from mhsa.core.scores import ALiBi
from mhsa.core.varlen import attention_varlen
from mhsa.distributed import ring_attention, run_local, shard, unshard
from mhsa.nn.positional import alibi_slopes

# name: (layout, causal, window, alibi)
CASES = {
    "contiguous": ("contiguous", False, None, False),
    "causal contiguous": ("contiguous", True, None, False),
    "causal zigzag": ("zigzag", True, None, False),
    "window zigzag": ("zigzag", False, (3, 2), False),
    "causal window contiguous, ALiBi": ("contiguous", True, (4, 0), True),
}
CHUNK = 6  # tokens per chunk: every sequence below crosses at least one shard edge
HEADS, KV_HEADS, DIM = 4, 2, 8


def lengths_for(total: int) -> list[int]:
    """Sequences of 1, 0, 7, 2, ... tokens filling the row: most cross a chunk edge."""
    lengths, pattern = [], [1, 0, 7, 2, 11, 5, 3]
    while sum(lengths) < total:
        lengths.append(min(pattern[len(lengths) % len(pattern)], total - sum(lengths)))
    return lengths


def _check(rank: int, world: int, spec: tuple) -> dict[str, float]:
    layout, causal, window, alibi = spec
    total = CHUNK * world * (2 if layout == "zigzag" else 1)
    lengths = lengths_for(total)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)  # the same whole row on every rank
    q = torch.randn(total, HEADS, DIM, generator=gen)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=gen) for _ in range(2))
    grad = torch.randn(total, HEADS, DIM, generator=gen)
    score = ALiBi(alibi_slopes(HEADS)) if alibi else None

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    longest = max(lengths)
    expected = attention_varlen(
        *leaves, cu, cu, longest, longest, causal=causal, window=window, score=score
    )
    (expected * grad).sum().backward()

    def rows(t):  # (total, H, D) -> this rank's (1, H, n, D)
        return shard(t.transpose(0, 1).unsqueeze(0), rank, world, layout)

    local = [rows(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(
        *local, mask=Segments(cu, causal=causal, window=window), layout=layout, score=score
    )
    (out * rows(grad)).sum().backward()
    pairs = {"out": (out.detach(), expected)}
    for name, mine, full in zip(("dq", "dk", "dv"), local, leaves, strict=True):
        pairs[name] = (mine.grad, full.grad)
    return {
        name: (unshard(mine, world, layout)[0].transpose(0, 1) - full).abs().max().item()
        for name, (mine, full) in pairs.items()
    }


def _worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    return {name: _check(rank, world, spec) for name, spec in CASES.items()}


def _results(world: int) -> list[dict]:
    return run_local(_worker, world, timeout=120)


@pytest.mark.slow
def test_packed_sequences_across_shard_edges_match_one_process():
    world = 3
    for rank, result in enumerate(_results(world)):
        for name, errors in result.items():
            bad = {k: e for k, e in errors.items() if not e <= 1e-5}
            assert not bad, f"world {world}, rank {rank}, {name}: {bad}"


def test_the_sequences_cross_the_shard_edges():
    for world in (2, 3):
        cu = torch.tensor(lengths_for(CHUNK * world)).cumsum(0)
        crossing = [e for e in range(CHUNK, CHUNK * world, CHUNK) if e not in cu.tolist()]
        assert crossing == list(range(CHUNK, CHUNK * world, CHUNK))
